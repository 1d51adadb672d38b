// @ts-check
/**
 * The tool fields of a stored or exported conversation (issue 66), checked field by field as schema.js checks the
 * rest: an assistant's `toolCalls`, a `tool` message's call, a chat's switched-on and allowed tools and its choice.
 * Each check returns "field: expected …, got …", or "". Pure.
 */

const STATUSES = ["pending", "allowed", "running", "done", "error", "denied", "cancelled"];
const MAX_NAME = 64;

/** @param {unknown} v */
const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
/** @param {unknown} v */
const shown = (v) => {
  const s = JSON.stringify(v);
  return s === undefined ? String(v) : s.length > 60 ? `${s.slice(0, 60)}…` : s;
};
/** @param {unknown} v */
const name = (v) => typeof v === "string" && v.length > 0 && v.length <= MAX_NAME;

/**
 * @param {Record<string, unknown>} msg a message whose role and content checked out
 * @param {string} at
 * @returns {string}
 */
export function checkToolFields(msg, at) {
  if (msg.role === "tool") {
    if (typeof msg.toolCallId !== "string" || msg.toolCallId === "") {
      return `${at}.toolCallId: expected the id of the call it answers, got ${shown(msg.toolCallId)}`;
    }
    if (msg.toolName !== undefined && !name(msg.toolName)) {
      return `${at}.toolName: expected a tool's name, got ${shown(msg.toolName)}`;
    }
    for (const key of ["isError", "truncated"]) {
      if (msg[key] !== undefined && typeof msg[key] !== "boolean") {
        return `${at}.${key}: expected true or false, got ${shown(msg[key])}`;
      }
    }
    if (msg.error !== undefined && typeof msg.error !== "string") {
      return `${at}.error: expected a string, got ${shown(msg.error)}`;
    }
  } else if (msg.toolCallId !== undefined) {
    return `${at}.toolCallId: only a tool message answers a call, got one on a ${msg.role} message`;
  }
  if (msg.toolCalls === undefined) return "";
  if (msg.role !== "assistant") return `${at}.toolCalls: only a reply makes calls, got them on a ${msg.role} message`;
  if (!Array.isArray(msg.toolCalls)) return `${at}.toolCalls: expected a list, got ${shown(msg.toolCalls)}`;
  for (const [i, c] of msg.toolCalls.entries()) {
    const here = `${at}.toolCalls[${i}]`;
    const call = /** @type {Record<string, unknown>} */ (c);
    if (!isObject(c) || typeof call.id !== "string" || call.id === "" || !name(call.name)
        || typeof call.arguments !== "string") {
      return `${here}: expected {id, name, arguments: JSON text, status}, got ${shown(c)}`;
    }
    if (!STATUSES.includes(/** @type {string} */ (call.status))) {
      return `${here}.status: expected one of ${STATUSES.join(", ")}, got ${shown(call.status)}`;
    }
    const span = /** @type {unknown[]} */ (call.span);
    if (call.span !== undefined && !(Array.isArray(span) && span.length === 2 && span.every(Number.isInteger)
        && /** @type {number} */ (span[0]) >= 0 && /** @type {number} */ (span[0]) <= /** @type {number} */ (span[1])
        && /** @type {number} */ (span[1]) <= /** @type {string} */ (msg.content).length)) {
      return `${here}.span: expected [start, end] within the reply's text, got ${shown(call.span)}`;
    }
    if (call.ms !== undefined && !(typeof call.ms === "number" && call.ms >= 0)) {
      return `${here}.ms: expected a number ≥ 0, got ${shown(call.ms)}`;
    }
  }
  return "";
}

/**
 * A conversation's tool settings.
 * @param {Record<string, unknown>} conv
 * @returns {string}
 */
export function checkConversationTools(conv) {
  for (const key of ["tools", "allowedTools"]) {
    const list = conv[key];
    if (list !== undefined && !(Array.isArray(list) && list.length <= 4096 && list.every(name))) {
      return `${key}: expected a list of tool names, got ${shown(list)}`;
    }
  }
  if (conv.toolChoice !== undefined && !name(conv.toolChoice)) {
    return `toolChoice: expected "auto", "required" or a tool's name, got ${shown(conv.toolChoice)}`;
  }
  return "";
}
