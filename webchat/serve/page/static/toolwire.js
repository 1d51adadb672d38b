// @ts-check
/**
 * Tool calls in a conversation, as pure functions (issue 66; docs/protocol.md, "Messages and their parts"): the
 * messages a `generate` sends (an assistant's `tool_calls`, a `tool` message's `tool_call_id`), a reply's text outside
 * its calls, the rounds of calls since the user last wrote, and a generate's `tools` / `tool_choice`. No DOM.
 */

import { wireContent } from "./images.js";
import { rawText } from "./thinking.js";

/**
 * @typedef {import("./store.js").Message} Message
 * @typedef {import("./store.js").ToolCall} ToolCall
 * @typedef {{id: string, type: "function", function: {name: string, arguments: string}, span?: number[]}} WireCall
 */

/** What a call's tool message tells the model when the user denied it. */
export const DENIED = "The user denied this tool call; it was not run.";
/** Calls whose outcome the model is told (a `tool` message follows them). */
export const SETTLED = ["done", "error", "denied"];

/**
 * A reply's answer without its calls' text (the markup the model wrote for them): what the reply says in words.
 * @param {string} content
 * @param {ToolCall[]} calls
 * @returns {string}
 */
export function outsideCalls(content, calls) {
  const spans = calls.map((c) => c.span).filter((s) => Array.isArray(s)).sort((a, b) => a[0] - b[0]);
  let out = "";
  let at = 0;
  for (const [start, end] of /** @type {number[][]} */ (spans)) {
    out += content.slice(at, Math.max(at, start));
    at = Math.max(at, end);
  }
  return (out + content.slice(at)).trim();
}

/**
 * The messages of a `generate`: role and text as the model wrote it (thinking.js), an assistant's settled calls as
 * `tool_calls` (their markup out of its text), a tool message's `tool_call_id`. A call the model was never told the
 * outcome of (stopped, skipped) is left out, with its markup: a history stays one the model could have written. A user
 * message's images follow its text as `image_url` parts.
 * @param {Message[]} messages
 * @returns {Record<string, unknown>[]}
 */
export function toWire(messages) {
  const told = new Set(messages.filter((m) => m.role === "tool").map((m) => m.toolCallId));
  return messages.map((m) => {
    if (m.role === "tool") return { role: "tool", content: m.content, tool_call_id: m.toolCallId };
    const raw = rawText(m);
    if (!m.toolCalls?.length) return { role: m.role, content: wireContent(raw, m.images) };
    // the text as written is its thinking (markers and all) followed by its answer: the answer loses its calls
    const head = raw.endsWith(m.content) ? raw.slice(0, raw.length - m.content.length) : "";
    /** @type {Record<string, unknown>} */
    const out = { role: m.role, content: head + outsideCalls(m.content, m.toolCalls) };
    const calls = m.toolCalls.filter((c) => told.has(c.id));
    if (calls.length) {
      out.tool_calls = calls.map((c) => ({ id: c.id, type: "function",
        function: { name: c.name, arguments: c.arguments } }));
    }
    return out;
  });
}

/**
 * A reply's calls as the page keeps them, from `done.tool_calls`.
 * @param {WireCall[]} calls
 * @param {boolean} cut the reply was stopped: its calls are not run
 * @returns {ToolCall[]}
 */
export function fromDone(calls, cut) {
  return calls.map((c) => {
    /** @type {ToolCall} */
    const call = { id: c.id, name: c.function.name, arguments: c.function.arguments,
      status: cut ? "cancelled" : "pending" };
    if (Array.isArray(c.span) && c.span.length === 2) call.span = [c.span[0], c.span[1]];
    return call;
  });
}

/**
 * Rounds of tool calls since the user last wrote: the replies with calls after the last user message.
 * @param {Message[]} history
 * @returns {number}
 */
export function roundsSince(history) {
  let n = 0;
  for (let i = history.length - 1; i >= 0 && history[i].role !== "user"; i--) {
    if (history[i].role === "assistant" && history[i].toolCalls?.length) n++;
  }
  return n;
}

/**
 * A generate's `tools` and `tool_choice` (docs/protocol.md): the chat's switched-on tools that a ready server lists;
 * the chat's choice (a tool named, or any tool required) for the first reply to the user only, `none` once the
 * rounds are used up (the model then answers in words), and none for a continued reply.
 * @param {{tools?: string[], toolChoice?: string}} conv
 * @param {Set<string>} ready the tools ready servers list now
 * @param {Message[]} history the messages before the reply
 * @param {boolean} cont
 * @param {number} maxRounds
 * @returns {Record<string, unknown>}
 */
export function toolFields(conv, ready, history, cont, maxRounds) {
  const names = (conv.tools ?? []).filter((n) => ready.has(n));
  if (names.length === 0) return {};
  /** @type {Record<string, unknown>} */
  const out = { tools: names };
  if (cont) return out;
  const last = history[history.length - 1];
  const choice = conv.toolChoice ?? "auto";
  if (last?.role === "user") {
    if (choice === "required") out.tool_choice = "required";
    else if (names.includes(choice)) out.tool_choice = { type: "function", function: { name: choice } };
  } else if (roundsSince(history) >= maxRounds) {
    out.tool_choice = "none";
  }
  return out;
}

/**
 * Pieces of a reply's answer, each outside the calls (-1) or inside call i: a stream's text cut where spans begin and
 * end (the offsets count the whole answer, so the router keeps its place).
 */
export class CallRouter {
  /** @param {ToolCall[]} calls */
  constructor(calls) {
    /** @type {[number, number, number][]} start, end, call index */
    const spans = calls.flatMap((c, i) => (c.span ? [[c.span[0], c.span[1], i]] : []));
    this.spans = /** @type {[number, number, number][]} */ (spans).sort((a, b) => a[0] - b[0]);
    this.at = 0;
  }

  /**
   * @param {string} text the answer's next text
   * @returns {[string, number][]} its pieces and where each goes
   */
  route(text) {
    /** @type {[string, number][]} */
    const out = [];
    let i = 0;
    while (i < text.length) {
      const pos = this.at + i;
      const inside = this.spans.find(([s, e]) => pos >= s && pos < e);
      const next = inside ? inside[1] : Math.min(...this.spans.map(([s]) => s).filter((s) => s > pos), Infinity);
      const take = Math.min(text.length - i, next - pos);
      out.push([text.slice(i, i + take), inside ? inside[2] : -1]);
      i += take;
    }
    this.at += text.length;
    return out;
  }
}
