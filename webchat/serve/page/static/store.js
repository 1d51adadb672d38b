// @ts-check
/**
 * Persistence: conversations in IndexedDB (database "webchat", store "conversations"), and in localStorage the
 * current conversation's id, settings, presets and view preferences. Conversations that older pages kept in
 * localStorage move to IndexedDB once.
 */

import { fromFlat, messages } from "./tree.js";

/**
 * @typedef {import("./heatmap.js").Tok} Tok
 * @typedef {{ttft_ms?: number, decode_tps?: number, new_tokens?: number, prompt_tokens?: number,
 *            reused_tokens?: number, drafted?: number, accepted?: number, image_tokens?: number,
 *            encode_ms?: number}} Stats
 *   `image_tokens`, `encode_ms`: a reply about images (the prompt's image slots; encoding them, 0 from the cache).
 * @typedef {{role: "user" | "assistant" | "tool", content: string, tokens?: Tok[], reason?: string, stats?: Stats,
 *            settings?: Record<string, unknown>, model?: string, format?: import("./replyformat.js").ReplyFormat,
 *            thinking?: string, thoughtMs?: number, scores?: import("./scoreview.js").Score[],
 *            scoreHidden?: boolean, toolCalls?: ToolCall[], toolCallId?: string, toolName?: string,
 *            isError?: boolean, error?: string, truncated?: boolean,
 *            images?: import("./images.js").StoredImage[]}} Message
 *   `reason` is the `done` reason of an assistant reply (`cancelled` = stopped by the user), or `interrupted`;
 *   `settings` the sampling settings it was generated with (for the post-sampling probability); `model` the model
 *   that wrote the reply, on a server with several (hello.models); `format` the reply format it was made under.
 *   `content` is a reply's answer; `thinking` its thinking (shown folded, never as answer text), `thoughtMs` how long
 *   the thinking streamed (thinking.js); `scores` how one or two models read the message (score.js), `scoreHidden`
 *   its panel folded away.
 *   Tools (issue 66, tools.js): `toolCalls` an assistant reply's calls; a `tool` message is a call's outcome as the
 *   model is told it: `toolCallId` and `toolName` its call, `content` the result as text, `isError` the tool failed
 *   or gave no result (`error` why: `timeout`, `server_died`, …), `truncated` the result was cut.
 *   `images`: a user message's images (issue 61, images.js), sent as `image_url` parts after its text.
 * @typedef {{id: string, name: string, arguments: string, span?: number[], ms?: number,
 *            status: "pending" | "allowed" | "running" | "done" | "error" | "denied" | "cancelled"}} ToolCall
 *   One call as the model wrote it (`arguments`: its JSON text; `span`: [start, end) of its text in the reply's answer,
 *   markup included) and what became of it: waiting for the user, allowed (queued), running, done, failed, denied, or
 *   cancelled (stopped, skipped by a new question, or left when the page closed: never run, the model is not told).
 * @typedef {import("./tree.js").Conversation} Conversation
 */

const KEY_CONVS = "webchat.conversations.v1";
const KEY_CURRENT = "webchat.current.v1";
const KEY_SETTINGS = "webchat.settings.v1";
const KEY_VIEW = "webchat.view.v1";
const KEY_PRESETS = "webchat.presets.v1";
const DB_NAME = "webchat";
const STORE = "conversations";

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
  return { id: newId(), title: "New chat", created: now, updated: now, root: null };
}

/** @returns {Promise<IDBDatabase>} the "webchat" database, store "conversations" keyed by id */
function openDb() {
  return new Promise((resolve, reject) => {
    const req = indexedDB.open(DB_NAME, 1);
    req.onupgradeneeded = () => req.result.createObjectStore(STORE, { keyPath: "id" });
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
}

/** @type {Promise<IDBDatabase> | null} */
let dbPromise = null;
/** @returns {Promise<IDBDatabase>} */
const db = () => (dbPromise = dbPromise ?? openDb());

/** Writes not yet committed, shown as `body[data-saving]` (a reload before a commit loses that write). */
let pending = 0;
/** @param {number} change */
function countPending(change) {
  pending += change;
  if (typeof document !== "undefined" && document.body) document.body.dataset.saving = String(pending);
}

/**
 * Runs one read-write transaction over the store; resolves once it committed.
 * @param {(store: IDBObjectStore) => void} work
 * @returns {Promise<void>}
 */
async function writeTx(work) {
  countPending(1);
  try {
    const tx = (await db()).transaction(STORE, "readwrite");
    work(tx.objectStore(STORE));
    await new Promise((resolve, reject) => {
      tx.oncomplete = () => resolve(undefined);
      tx.onerror = () => reject(tx.error);
      tx.onabort = () => reject(tx.error);
    });
  } finally {
    countPending(-1);
  }
}

/**
 * Moves the conversations of localStorage (before IndexedDB) into the database once; the old key is removed only
 * after the transaction committed, so a failure loses nothing and the next load tries again.
 * @returns {Promise<number>} how many conversations moved
 */
async function migrate() {
  const old = read(KEY_CONVS, /** @type {unknown} */ (null));
  if (!Array.isArray(old)) return 0;
  const convs = old.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages)).map(fromFlat);
  await writeTx((st) => { for (const c of convs) st.put(c); });
  localStorage.removeItem(KEY_CONVS);
  return convs.length;
}

/** @returns {Promise<Conversation[]>} every stored conversation, newest first (migrating localStorage first) */
export async function loadConversations() {
  await migrate();
  const st = (await db()).transaction(STORE, "readonly").objectStore(STORE);
  const all = await new Promise((resolve, reject) => {
    const req = st.getAll();
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
  return /** @type {Conversation[]} */ (all).sort((a, b) => b.updated - a.updated);
}

/**
 * Saves one conversation (a structured clone: token data and all).
 * @param {Conversation} conv
 * @returns {Promise<void>}
 */
export function putConversation(conv) {
  return writeTx((st) => st.put(conv));
}

/**
 * @param {string} id
 * @returns {Promise<void>}
 */
export function deleteConversation(id) {
  return writeTx((st) => st.delete(id));
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
  if (conv.named) return conv.title;
  const first = messages(conv).find((m) => m.role === "user");
  if (!first) return "New chat";
  const line = first.content.trim().split("\n")[0];
  const named = line || (first.images?.length ? `Image: ${first.images[0].name ?? "pasted"}` : "");
  return named.length > 48 ? `${named.slice(0, 47)}…` : named || "New chat";
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

/** @returns {Record<string, Record<string, string>>} the user's saved presets, by name */
export function loadPresets() {
  const v = read(KEY_PRESETS, /** @type {Record<string, Record<string, string>>} */ ({}));
  return v && typeof v === "object" && !Array.isArray(v) ? v : {};
}

/** @param {Record<string, Record<string, string>>} presets */
export function savePresets(presets) {
  write(KEY_PRESETS, presets);
}
