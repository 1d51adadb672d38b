// @ts-check
/**
 * The one schema of a stored or exported conversation, checked field by field: every field the renderer reads has
 * the type and range it expects. `checkConversation` names the first bad field (an import is refused as a whole on
 * it); `repairConversation` keeps what is sound of a stored conversation that is not (the page renders it, marked,
 * and goes on loading the others). Pure: no DOM, no storage.
 */

/**
 * @typedef {import("./tree.js").Conversation} Conversation
 * @typedef {import("./tree.js").Thread} Thread
 * @typedef {import("./store.js").Message} Message
 */

import { checkImages } from "./images.js";
import { checkFormat } from "./replyformat.js";
import { checkConversationTools, checkToolFields } from "./toolschema.js";

const MAX_DEPTH = 10000;
const STATS = ["ttft_ms", "decode_tps", "new_tokens", "prompt_tokens", "reused_tokens", "drafted", "accepted",
  "image_tokens", "encode_ms"];

/** @param {unknown} v */
const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
/** @param {unknown} v */
const finite = (v) => typeof v === "number" && Number.isFinite(v);
/** @param {unknown} v */
const shown = (v) => {
  const s = JSON.stringify(v);
  return s === undefined ? String(v) : s.length > 60 ? `${s.slice(0, 60)}…` : s;
};

/**
 * The first problem of one message, as "field: expected …, got …", or "".
 * @param {unknown} m
 * @param {string} at
 * @returns {string}
 */
export function checkMessage(m, at) {
  if (!isObject(m)) return `${at}: expected a message object, got ${shown(m)}`;
  const msg = /** @type {Record<string, unknown>} */ (m);
  if (msg.role !== "user" && msg.role !== "assistant" && msg.role !== "tool") {
    return `${at}.role: expected "user", "assistant" or "tool", got ${shown(msg.role)}`;
  }
  if (typeof msg.content !== "string") return `${at}.content: expected a string, got ${shown(msg.content)}`;
  const parts = checkToolFields(msg, at) || checkImages(msg, at);
  if (parts) return parts;
  if (msg.reason !== undefined && typeof msg.reason !== "string") return `${at}.reason: expected a string, got ${shown(msg.reason)}`;
  if (msg.settings !== undefined && !isObject(msg.settings)) return `${at}.settings: expected an object, got ${shown(msg.settings)}`;
  if (msg.model !== undefined && typeof msg.model !== "string") return `${at}.model: expected a string, got ${shown(msg.model)}`;
  if (msg.format !== undefined && checkFormat(msg.format, `${at}.format`)) return checkFormat(msg.format, `${at}.format`);
  if (msg.thinking !== undefined && typeof msg.thinking !== "string") return `${at}.thinking: expected a string, got ${shown(msg.thinking)}`;
  if (msg.thoughtMs !== undefined && !(finite(msg.thoughtMs) && /** @type {number} */ (msg.thoughtMs) >= 0)) {
    return `${at}.thoughtMs: expected a number ≥ 0, got ${shown(msg.thoughtMs)}`;
  }
  if (msg.stats !== undefined) {
    if (!isObject(msg.stats)) return `${at}.stats: expected an object, got ${shown(msg.stats)}`;
    const stats = /** @type {Record<string, unknown>} */ (msg.stats);
    for (const key of STATS) {
      if (stats[key] !== undefined && !(finite(stats[key]) && /** @type {number} */ (stats[key]) >= 0)) {
        return `${at}.stats.${key}: expected a number ≥ 0, got ${shown(stats[key])}`;
      }
    }
  }
  if (msg.scores !== undefined) {
    const err = checkScores(msg.scores, `${at}.scores`);
    if (err) return err;
  }
  if (msg.scoreHidden !== undefined && typeof msg.scoreHidden !== "boolean") {
    return `${at}.scoreHidden: expected true or false, got ${shown(msg.scoreHidden)}`;
  }
  if (msg.tokens !== undefined) {
    return checkTokens(msg.tokens, msg.content, typeof msg.thinking === "string" ? msg.thinking : "", `${at}.tokens`);
  }
  return "";
}

/**
 * A text's scores (score.js): up to two views {model, tokens, at}, each token as a reply's.
 * @param {unknown} scores
 * @param {string} at
 * @returns {string}
 */
export function checkScores(scores, at) {
  if (!Array.isArray(scores) || scores.length > 2) return `${at}: expected a list of at most 2 views, got ${shown(scores)}`;
  for (const [i, s] of scores.entries()) {
    const view = /** @type {Record<string, unknown>} */ (s);
    if (!isObject(s) || typeof view.model !== "string" || !finite(view.at) || !Array.isArray(view.tokens)) {
      return `${at}[${i}]: expected {model: string, tokens: list, at: time}, got ${shown(s)}`;
    }
    const text = view.tokens.map((t) => (isObject(t) ? /** @type {Record<string, unknown>} */ (t).text : "")).join("");
    const err = checkTokens(view.tokens, text, `${at}[${i}].tokens`);
    if (err) return err;
  }
  return "";
}

/**
 * @param {unknown} tokens
 * @param {string} content the answer: its tokens' texts must start it
 * @param {string} thinking the thinking: its tokens' (part "thinking") texts must start it
 * @param {string} at
 * @returns {string}
 */
function checkTokens(tokens, content, thinking, at) {
  if (!Array.isArray(tokens)) return `${at}: expected a list, got ${shown(tokens)}`;
  let text = "";
  let thought = "";
  for (const [i, t] of tokens.entries()) {
    const here = `${at}[${i}]`;
    if (!isObject(t)) return `${here}: expected a token object, got ${shown(t)}`;
    const tok = /** @type {Record<string, unknown>} */ (t);
    if (typeof tok.text !== "string") return `${here}.text: expected a string, got ${shown(tok.text)}`;
    if (tok.p !== null && !(finite(tok.p) && /** @type {number} */ (tok.p) >= 0 && /** @type {number} */ (tok.p) <= 1)) {
      return `${here}.p: expected a probability in [0, 1] or null, got ${shown(tok.p)}`;
    }
    if (tok.rank !== null && !(Number.isInteger(tok.rank) && /** @type {number} */ (tok.rank) >= 1)) {
      return `${here}.rank: expected an integer ≥ 1 or null, got ${shown(tok.rank)}`;
    }
    if (tok.id !== undefined && tok.id !== null && !Number.isInteger(tok.id)) {
      return `${here}.id: expected an integer or null, got ${shown(tok.id)}`;
    }
    if (tok.sp !== undefined && !finite(tok.sp)) return `${here}.sp: expected a number, got ${shown(tok.sp)}`;
    if (tok.parts !== undefined && !Number.isInteger(tok.parts)) return `${here}.parts: expected an integer, got ${shown(tok.parts)}`;
    if (tok.forbidden !== undefined && !(Array.isArray(tok.forbidden) && tok.forbidden.every(Number.isInteger))) {
      return `${here}.forbidden: expected a list of token ids, got ${shown(tok.forbidden)}`;
    }
    if (tok.picked !== undefined && typeof tok.picked !== "boolean") return `${here}.picked: expected true or false, got ${shown(tok.picked)}`;
    if (tok.part !== undefined && tok.part !== "thinking") return `${here}.part: expected "thinking" or none, got ${shown(tok.part)}`;
    if (tok.raw !== undefined && typeof tok.raw !== "string") return `${here}.raw: expected a string, got ${shown(tok.raw)}`;
    if (!Array.isArray(tok.top)) return `${here}.top: expected a list, got ${shown(tok.top)}`;
    for (const [j, a] of tok.top.entries()) {
      const alt = /** @type {Record<string, unknown>} */ (a);
      if (!isObject(a) || typeof alt.text !== "string" || !(finite(alt.p) && /** @type {number} */ (alt.p) >= 0
          && /** @type {number} */ (alt.p) <= 1) || (alt.id !== undefined && alt.id !== null && !Number.isInteger(alt.id))) {
        return `${here}.top[${j}]: expected {text: string, p: number in [0, 1], id?: integer}, got ${shown(a)}`;
      }
    }
    if (tok.part === "thinking") thought += tok.text;
    else text += tok.text;
  }
  if (!content.startsWith(text)) return `${at}: the tokens' text does not match the message's content`;
  if (!thinking.startsWith(thought)) return `${at}: the thinking tokens' text does not match the message's thinking`;
  return "";
}

/**
 * @param {unknown} t
 * @param {string} at
 * @param {number} depth
 * @returns {string}
 */
function checkThread(t, at, depth) {
  if (depth > MAX_DEPTH) return `${at}: a conversation deeper than ${MAX_DEPTH} messages`;
  if (!isObject(t)) return `${at}: expected a thread {versions, current}, got ${shown(t)}`;
  const thread = /** @type {Record<string, unknown>} */ (t);
  if (!Array.isArray(thread.versions) || thread.versions.length === 0) {
    return `${at}.versions: expected a non-empty list, got ${shown(thread.versions)}`;
  }
  if (!Number.isInteger(thread.current) || /** @type {number} */ (thread.current) < 0
      || /** @type {number} */ (thread.current) >= thread.versions.length) {
    return `${at}.current: expected an index in [0, ${thread.versions.length - 1}], got ${shown(thread.current)}`;
  }
  for (const [i, v] of thread.versions.entries()) {
    const here = `${at}.versions[${i}]`;
    if (!isObject(v)) return `${here}: expected a version {msg, next}, got ${shown(v)}`;
    const version = /** @type {Record<string, unknown>} */ (v);
    const err = checkMessage(version.msg, `${here}.msg`)
      || (version.next === null || version.next === undefined ? "" : checkThread(version.next, `${here}.next`, depth + 1));
    if (err) return err;
  }
  return "";
}

/**
 * The first problem of a conversation, naming the field, or "".
 * @param {unknown} c
 * @returns {string}
 */
export function checkConversation(c) {
  if (!isObject(c)) return `expected a conversation object, got ${shown(c)}`;
  const conv = /** @type {Record<string, unknown>} */ (c);
  if (typeof conv.id !== "string" || conv.id === "") return `id: expected a non-empty string, got ${shown(conv.id)}`;
  if (conv.title !== undefined && typeof conv.title !== "string") return `title: expected a string, got ${shown(conv.title)}`;
  if (conv.named !== undefined && typeof conv.named !== "boolean") return `named: expected true or false, got ${shown(conv.named)}`;
  if (conv.model !== undefined && typeof conv.model !== "string") return `model: expected a string, got ${shown(conv.model)}`;
  if (conv.format !== undefined && checkFormat(conv.format, "format")) return checkFormat(conv.format, "format");
  if (conv.think !== undefined && typeof conv.think !== "boolean") return `think: expected true or false, got ${shown(conv.think)}`;
  const tools = checkConversationTools(conv);
  if (tools) return tools;
  for (const key of ["created", "updated"]) {
    if (conv[key] !== undefined && !finite(conv[key])) return `${key}: expected a time in ms, got ${shown(conv[key])}`;
  }
  if (conv.scoredText !== undefined) {
    const kept = /** @type {Record<string, unknown>} */ (conv.scoredText);
    if (!isObject(kept) || typeof kept.text !== "string") return `scoredText: expected {text, scores}, got ${shown(kept)}`;
    const err = checkScores(kept.scores, "scoredText.scores");
    if (err) return err;
  }
  if (conv.root === null) return "";
  return checkThread(conv.root, "root", 0);
}

/**
 * What is sound of a message: its role and text always (content made a string); stats, tokens, settings and reason
 * only where they check out.
 * @param {unknown} m
 * @returns {Message | null}
 */
function repairMessage(m) {
  if (!isObject(m)) return null;
  const raw = /** @type {Record<string, unknown>} */ (m);
  if (raw.role !== "user" && raw.role !== "assistant" && raw.role !== "tool") return null;
  /** @type {Message} */
  const msg = { role: raw.role, content: typeof raw.content === "string" ? raw.content : "" };
  if (raw.role === "tool") {  // a result is nothing without the call it answers
    if (typeof raw.toolCallId !== "string" || raw.toolCallId === "") return null;
    msg.toolCallId = raw.toolCallId;
  }
  const keys = /** @type {const} */ (["reason", "settings", "stats", "thinking", "thoughtMs", "tokens", "model",
    "format", "scores", "scoreHidden", "toolCalls", "toolName", "isError", "error", "truncated", "images"]);
  for (const key of keys) {
    if (raw[key] === undefined) continue;
    const trial = /** @type {Record<string, unknown>} */ ({ role: msg.role, content: msg.content, thinking: msg.thinking,
      toolCallId: msg.toolCallId, [key]: raw[key] });
    if (!checkMessage(trial, "m")) /** @type {Record<string, unknown>} */ (msg)[key] = raw[key];
  }
  return msg;
}

/**
 * @param {unknown} t
 * @param {number} depth
 * @returns {Thread | null}
 */
function repairThread(t, depth) {
  if (!isObject(t) || depth > MAX_DEPTH) return null;
  const raw = /** @type {Record<string, unknown>} */ (t);
  const versions = [];
  for (const v of Array.isArray(raw.versions) ? raw.versions : []) {
    const msg = isObject(v) ? repairMessage(/** @type {Record<string, unknown>} */ (v).msg) : null;
    if (msg) versions.push({ msg, next: repairThread(/** @type {Record<string, unknown>} */ (v).next, depth + 1) });
  }
  if (versions.length === 0) return null;
  const current = Number.isInteger(raw.current) ? /** @type {number} */ (raw.current) : 0;
  return { versions, current: Math.max(0, Math.min(versions.length - 1, current)) };
}

/**
 * A stored conversation made safe to render: unchanged when it checks out; else what is sound of it, with `damaged`
 * naming the first problem found (shown in the sidebar; nothing is thrown, the other conversations load).
 * @param {unknown} c
 * @param {() => string} newId
 * @returns {Conversation & {damaged?: string}}
 */
export function repairConversation(c, newId) {
  const problem = checkConversation(c);
  if (!problem) {
    // a repaired copy saved since: it checks out now, so its old mark goes
    if (isObject(c) && "damaged" in c) delete (/** @type {Record<string, unknown>} */ (c)).damaged;
    return /** @type {Conversation} */ (c);
  }
  const raw = isObject(c) ? /** @type {Record<string, unknown>} */ (c) : {};
  const now = Date.now();
  return {
    id: typeof raw.id === "string" && raw.id !== "" ? raw.id : newId(),
    title: typeof raw.title === "string" ? raw.title : "Damaged chat",
    named: raw.named === true,
    ...(typeof raw.model === "string" ? { model: raw.model } : {}),
    ...(raw.format !== undefined && !checkFormat(raw.format, "format")
      ? { format: /** @type {import("./replyformat.js").ReplyFormat} */ (raw.format) } : {}),
    ...(typeof raw.think === "boolean" ? { think: raw.think } : {}),
    ...(!checkConversationTools({ tools: raw.tools }) && Array.isArray(raw.tools) ? { tools: raw.tools } : {}),
    created: finite(raw.created) ? /** @type {number} */ (raw.created) : now,
    updated: finite(raw.updated) ? /** @type {number} */ (raw.updated) : now,
    root: repairThread(raw.root, 0),
    damaged: problem,
  };
}
