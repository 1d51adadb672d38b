// @ts-check
/** localStorage persistence: conversations, the current conversation, settings and view preferences. */

/**
 * @typedef {import("./heatmap.js").Tok} Tok
 * @typedef {{ttft_ms?: number, decode_tps?: number, new_tokens?: number, prompt_tokens?: number,
 *            reused_tokens?: number, drafted?: number, accepted?: number}} Stats
 * @typedef {{role: "user" | "assistant", content: string, tokens?: Tok[], reason?: string, stats?: Stats}} Message
 *   `reason` is the `done` reason of an assistant reply (`cancelled` = stopped by the user), or `interrupted`.
 * @typedef {{id: string, title: string, created: number, updated: number, messages: Message[]}} Conversation
 */

const KEY_CONVS = "webchat.conversations.v1";
const KEY_CURRENT = "webchat.current.v1";
const KEY_SETTINGS = "webchat.settings.v1";
const KEY_VIEW = "webchat.view.v1";

/**
 * Parses a stored JSON value, or returns the fallback when it is absent or corrupt.
 * @template T
 * @param {string} key
 * @param {T} fallback
 * @returns {T}
 */
function read(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : /** @type {T} */ (JSON.parse(raw));
  } catch {
    return fallback;
  }
}

/**
 * @param {string} key
 * @param {unknown} value
 * @returns {boolean} false when the quota is exceeded
 */
function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
    return true;
  } catch {
    return false;
  }
}

/** @returns {string} a short random id */
export function newId() {
  return Math.random().toString(36).slice(2, 10) + Date.now().toString(36).slice(-4);
}

/** @returns {Conversation} */
export function newConversation() {
  const now = Date.now();
  return { id: newId(), title: "New chat", created: now, updated: now, messages: [] };
}

/** @returns {Conversation[]} newest first */
export function loadConversations() {
  const list = read(KEY_CONVS, /** @type {Conversation[]} */ ([]));
  if (!Array.isArray(list)) return [];
  return list.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages))
    .sort((a, b) => b.updated - a.updated);
}

/**
 * Saves all conversations. When the quota is exceeded, drops the per-token data (heatmap) of the oldest replies
 * first and retries: the text is always kept.
 * @param {Conversation[]} convs
 */
export function saveConversations(convs) {
  if (write(KEY_CONVS, convs)) return;
  const copy = /** @type {Conversation[]} */ (JSON.parse(JSON.stringify(convs))).sort((a, b) => a.updated - b.updated);
  for (const conv of copy) {
    for (const msg of conv.messages) delete msg.tokens;
    if (write(KEY_CONVS, copy)) return;
  }
  console.warn("webchat: localStorage is full; conversations were not saved");
}

/** @returns {string | null} */
export function loadCurrentId() {
  return read(KEY_CURRENT, null);
}

/** @param {string} id */
export function saveCurrentId(id) {
  write(KEY_CURRENT, id);
}

/**
 * Title of a conversation: the start of its first user message.
 * @param {Conversation} conv
 * @returns {string}
 */
export function titleOf(conv) {
  const first = conv.messages.find((m) => m.role === "user");
  if (!first) return "New chat";
  const line = first.content.trim().split("\n")[0];
  return line.length > 48 ? `${line.slice(0, 47)}…` : line || "New chat";
}

/** @returns {Record<string, unknown>} raw stored settings (validated by settings.js) */
export function loadSettings() {
  const s = read(KEY_SETTINGS, /** @type {Record<string, unknown>} */ ({}));
  return s && typeof s === "object" && !Array.isArray(s) ? s : {};
}

/** @param {Record<string, unknown>} settings */
export function saveSettings(settings) {
  write(KEY_SETTINGS, settings);
}

/**
 * @typedef {{heatmap: boolean, mode: import("./heatmap.js").HeatMode}} View
 * @returns {View}
 */
export function loadView() {
  const v = read(KEY_VIEW, /** @type {{heatmap?: unknown, mode?: unknown}} */ ({}));
  /** @type {import("./heatmap.js").HeatMode[]} */
  const modes = ["prob", "rank", "entropy"];
  const mode = modes.find((m) => m === v?.mode) ?? "prob";
  return { heatmap: Boolean(v?.heatmap), mode };
}

/** @param {View} view */
export function saveView(view) {
  write(KEY_VIEW, view);
}
