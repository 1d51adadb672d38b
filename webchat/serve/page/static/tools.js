// @ts-check
/**
 * The tool loop (issue 66; docs/tools.md, "In the page"): a reply's calls wait for the user's Allow or Deny (a tool
 * allowed in this chat runs at once); allowed calls run one at a time on the server (`call_tool` → `tool_result`), in
 * the reply's order, and each outcome becomes a `tool` message (a denied call's tells the model so); once every call
 * is settled the model goes on with the results (a new `generate` with the history), at most Settings → Tool rounds
 * times a question, after which it answers without tools. Stop ends the loop at any point, a running call included
 * (the server cancels its task and tells the tool's server).
 */

import { newId } from "./store.js";
import { cardCall, cardHooks } from "./toolcards.js";
import { DENIED, SETTLED, fromDone, roundsSince, toolFields } from "./toolwire.js";
import { allMessages, append, path } from "./tree.js";

/**
 * @typedef {import("./store.js").Message} Message
 * @typedef {import("./store.js").ToolCall} ToolCall
 * @typedef {import("./tree.js").Conversation} Conversation
 * @typedef {import("./connection.js").ServerMessage} ServerMessage
 * @typedef {{connection: import("./connection.js").Connection, lib: import("./conversations.js").Library,
 *   turns: import("./turns.js").Turns, refresh: () => void, error: (text: string, code: string) => void,
 *   progress: (text: string) => void, rounds: () => number, ready: () => Set<string>}} LoopDeps
 *   `rounds`: the most rounds of calls a question may take (Settings); `ready`: the tools ready servers list now.
 * @typedef {{id: string, conv: Conversation, msg: Message, index: number, stopping: boolean}} Running
 * @typedef {{text: string, is_error: boolean, error: string | null, truncated: boolean, ms: number}} Outcome
 */

const STOP_TIMEOUT_MS = 15000;
/** A call not yet settled: the loop still holds it. */
const UNSETTLED = ["pending", "allowed", "running"];

/** Calls left undecided or unfinished in stored conversations: the page that would run them is gone. */
/** @param {Conversation[]} convs */
export function settleStored(convs) {
  for (const conv of convs) {
    for (const m of allMessages(conv.root)) {
      for (const c of m.toolCalls ?? []) if (UNSETTLED.includes(c.status)) c.status = "cancelled";
    }
  }
}

export class ToolLoop {
  /** @param {LoopDeps} deps */
  constructor(deps) {
    this.d = deps;
    /** @type {Running | null} the call in flight */
    this.running = null;
    this.counter = 0;
    cardHooks.actionable = (msg) => this.actionable(msg);
    cardHooks.busy = () => this.busy;
  }

  /** @returns {boolean} a request of this tab is in flight (one at a time on the socket) */
  get busy() {
    return this.running !== null || this.d.turns.active !== null;
  }

  /**
   * Allow / Deny clicks on the cards of a message list.
   * @param {HTMLElement} list
   */
  attach(list) {
    list.addEventListener("click", (e) => {
      const button = e.target instanceof Element ? e.target.closest("[data-call-action]") : null;
      const card = button?.closest(".tool-call");
      const at = card ? cardCall.get(card) : undefined;
      if (button instanceof HTMLElement && at) this.decide(at.msg, at.index, button.dataset.callAction ?? "");
    });
  }

  /**
   * Whether a reply's calls can be decided now: it is the shown chat's last reply (only its results follow it).
   * @param {Message} msg
   */
  actionable(msg) {
    const steps = path(this.d.lib.current);
    const i = steps.findIndex((s) => s.msg === msg);
    return i >= 0 && steps.slice(i + 1).every((s) => s.msg.role === "tool");
  }

  /**
   * A generate's `tools` and `tool_choice` (a Turns hook).
   * @param {Conversation} conv
   * @param {Message[]} history
   * @param {boolean} cont
   * @returns {Record<string, unknown>}
   */
  fields(conv, history, cont) {
    const out = toolFields(conv, this.d.ready(), history, cont, this.d.rounds());
    if (out.tool_choice === "none") {
      this.d.progress(`${roundsSince(history)} rounds of tool calls: the model answers without tools now`);
    }
    return out;
  }

  /**
   * A reply ended (a Turns hook): its calls, if any, wait for the user or run.
   * @param {Conversation} conv
   * @param {Message} msg
   * @param {string} reason
   * @param {import("./toolwire.js").WireCall[] | undefined} calls
   */
  afterReply(conv, msg, reason, calls) {
    if (!calls?.length) return;
    msg.toolCalls = fromDone(calls, reason === "cancelled");
    for (const c of msg.toolCalls) {
      if (c.status === "pending" && conv.allowedTools?.includes(c.name)) c.status = "allowed";
    }
    this.advance(conv, msg);
  }

  /**
   * The user's answer to call `index` of `msg`: allow, always (allow, and every later call of its tool in this chat),
   * or deny.
   * @param {Message} msg
   * @param {number} index
   * @param {string} action
   */
  decide(msg, index, action) {
    const call = msg.toolCalls?.[index];
    if (!call || call.status !== "pending" || this.busy || !this.actionable(msg)) return;
    const conv = this.d.lib.current;
    if (action === "deny") call.status = "denied";
    else if (action === "allow") call.status = "allowed";
    else if (action === "always") {
      conv.allowedTools = [...new Set([...(conv.allowedTools ?? []), call.name])];
      for (const c of msg.toolCalls ?? []) if (c.status === "pending" && c.name === call.name) c.status = "allowed";
    } else return;
    this.advance(conv, msg);
  }

  /**
   * Takes the reply's calls in order: a denied one is told, an allowed one runs (and the loop waits for its result),
   * a pending one waits for the user; once all are settled the model goes on with their results.
   * @param {Conversation} conv
   * @param {Message} msg
   */
  advance(conv, msg) {
    const calls = msg.toolCalls ?? [];
    for (const [i, call] of calls.entries()) {
      if (call.status === "denied" && !this.told(conv, call)) {
        append(conv, { role: "tool", content: DENIED, toolCallId: call.id, toolName: call.name });
      } else if (call.status === "allowed") {
        this.run(conv, msg, i);
        return;
      } else if (call.status === "pending") {
        this.d.lib.save(conv);
        this.d.progress("The model asks to run a tool: Allow or Deny it below");
        this.d.refresh();
        return;
      }
    }
    this.d.lib.save(conv);
    this.d.progress("");
    if (!calls.some((c) => SETTLED.includes(c.status)) || !this.d.turns.resume(conv)) this.d.refresh();
  }

  /**
   * @param {Conversation} conv
   * @param {ToolCall} call
   * @returns {boolean} whether the model has been told this call's outcome (its tool message is on the path)
   */
  told(conv, call) {
    return path(conv).some((s) => s.msg.role === "tool" && s.msg.toolCallId === call.id);
  }

  /**
   * @param {Conversation} conv
   * @param {Message} msg
   * @param {number} index
   */
  run(conv, msg, index) {
    const call = /** @type {ToolCall} */ (msg.toolCalls?.[index]);
    const id = `t${++this.counter}-${newId()}`;
    if (!this.d.connection.send({ type: "call_tool", id, name: call.name, arguments: call.arguments })) {
      call.status = "pending";
      this.d.error("not connected to the server: the call was not run; Allow it again once reconnected", "offline");
      this.d.refresh();
      return;
    }
    call.status = "running";
    this.running = { id, conv, msg, index, stopping: false };
    this.d.progress(`Running ${call.name}…`);
    this.d.lib.save(conv);
    this.d.refresh();
  }

  /**
   * A server message for the call in flight (`tool_result`, or an `error` naming it); false when it is not one.
   * @param {ServerMessage} m
   * @returns {boolean}
   */
  onServer(m) {
    const r = this.running;
    if (m.type === "tool_result") {
      if (r && m.id === r.id) this.settle(r, m);
      return true;  // a late one (its call was given up) is dropped
    }
    if (m.type === "error" && r && m.id === r.id) {
      this.settle(r, { text: m.message, is_error: true, error: m.code, truncated: false, ms: 0 });
      return true;
    }
    return false;
  }

  /**
   * The call's outcome: a stopped call ends the loop; any other is told to the model as a `tool` message.
   * @param {Running} r
   * @param {Outcome} out
   */
  settle(r, out) {
    this.running = null;
    const call = /** @type {ToolCall} */ (r.msg.toolCalls?.[r.index]);
    call.ms = out.ms;
    if (out.error === "cancelled") {
      for (const c of r.msg.toolCalls ?? []) if (UNSETTLED.includes(c.status)) c.status = "cancelled";
      this.d.lib.save(r.conv);
      this.d.progress("Stopped: the tool call was cancelled");
      this.d.refresh();
      return;
    }
    call.status = out.error ? "error" : "done";
    /** @type {Message} */
    const result = { role: "tool", content: out.error ? `Error (${out.error}): ${out.text}` : out.text,
      toolCallId: call.id, toolName: call.name };
    if (out.is_error) result.isError = true;
    if (out.error) result.error = out.error;
    if (out.truncated) result.truncated = true;
    append(r.conv, result);
    this.advance(r.conv, r.msg);
  }

  /** Stop: the call in flight is cancelled (the server answers `cancelled` at once), and the loop ends. */
  stop() {
    const r = this.running;
    if (!r || r.stopping) return;
    r.stopping = true;
    if (!this.d.connection.send({ type: "stop", id: r.id })) this.lost();
    this.d.refresh();
    window.setTimeout(() => {  // a stop the server never answers must not leave the page stuck
      if (this.running === r) this.settle(r, { text: "", is_error: true, error: "cancelled", truncated: false, ms: 0 });
    }, STOP_TIMEOUT_MS);
  }

  /** The socket closed: the call in flight is lost (the server abandons it), and the loop ends. */
  lost() {
    const r = this.running;
    if (!r) return;
    this.settle(r, { text: "", is_error: true, error: "cancelled", truncated: false, ms: 0 });
    this.d.error("the connection to the server was lost during a tool call; it was not finished", "disconnected");
  }

  /**
   * A new question: the last reply's calls still waiting are skipped (never run; the model is not told of them).
   * @param {Conversation} conv
   */
  skipPending(conv) {
    for (const s of path(conv)) {
      for (const c of s.msg.toolCalls ?? []) if (["pending", "allowed"].includes(c.status)) c.status = "cancelled";
    }
  }
}
