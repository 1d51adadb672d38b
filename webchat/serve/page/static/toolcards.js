// @ts-check
/**
 * Tool calls on screen (issue 66): each call of a reply as a card under its text (the tool, what became of the call,
 * the reply's own tokens that spell it, coloured by probability like any token of a reply, and Allow / Deny while it
 * waits), and a `tool` message as the result the model was told, as text. Everything a server or the model wrote
 * enters the DOM as text nodes only.
 */

import { CallRouter } from "./toolwire.js";

/**
 * @typedef {import("./store.js").Message} Message
 * @typedef {import("./store.js").ToolCall} ToolCall
 * @typedef {import("./blocks.js").MakeSpan} MakeSpan
 * @typedef {import("./heatmap.js").Tok} Tok
 */

/** The call of each card's element: the click handler (tools.js) finds it here. */
export const cardCall = /** @type {WeakMap<Element, {msg: Message, index: number}>} */ (new WeakMap());

/** Set by tools.js: whether a reply's pending calls can be decided now, and whether a request is in flight. */
export const cardHooks = {
  /** @type {(msg: Message) => boolean} */
  actionable: () => false,
  /** @type {() => boolean} */
  busy: () => false,
};

/** @type {Record<ToolCall["status"], string>} */
const STATUS = {
  pending: "waiting for you: run it?", allowed: "allowed: about to run", running: "running…", done: "done",
  error: "failed: the model is told why", denied: "denied: the model is told so", cancelled: "not run",
};

/**
 * The tool's own name and its server, from the name the model calls it by (`server__tool`).
 * @param {string} name
 * @returns {[string, string]}
 */
export function splitName(name) {
  const at = name.indexOf("__");
  return at < 0 ? ["", name] : [name.slice(0, at), name.slice(at + 2)];
}

/** A reply's calls as cards, filled with the reply's pieces that spell each call. */
export class CallCards {
  /**
   * @param {HTMLElement} el the reply's message element
   * @param {Message} msg
   * @param {MakeSpan} makeSpan the reply's token spans (the heatmap's colours, the popover's data)
   */
  constructor(el, msg, makeSpan) {
    const calls = /** @type {ToolCall[]} */ (msg.toolCalls);
    this.makeSpan = makeSpan;
    this.router = new CallRouter(calls);
    this.box = document.createElement("div");
    this.box.className = "tool-calls";
    this.box.dataset.testid = "tool-calls";
    /** @type {HTMLElement[]} */
    this.texts = [];
    const cards = calls.map((call, i) => this.card(msg, call, i));
    this.box.append(...cards);
    /** @type {HTMLElement} */ (el.querySelector(".msg-body")).after(this.box);
  }

  /**
   * @param {string} text the answer's next text
   * @returns {[string, number][]} its pieces: outside the calls (-1) or in call i
   */
  route(text) {
    return this.router.route(text);
  }

  /**
   * Adds a piece of call i's text: its token's span, or text alone (a reply kept without tokens).
   * @param {number} i
   * @param {string} text
   * @param {Tok | null} tok
   */
  push(i, text, tok) {
    const code = this.texts[i];
    if (!tok) {
      code.append(text);
      return;
    }
    const span = this.makeSpan({ a: 0, b: text.length, data: tok, index: 1 }, true);  // index 1: no tab stop
    span.textContent = text;
    code.append(span);
  }

  /** Calls without a span (a reply from elsewhere): their name and arguments as text. */
  finish() {
    this.texts.forEach((code, i) => {
      if (code.childNodes.length === 0) code.textContent = `${this.nameOf(i)}(${this.argsOf(i)})`;
    });
  }

  /** @param {number} i */
  nameOf(i) {
    return /** @type {HTMLElement} */ (this.texts[i].closest(".tool-call")).dataset.name ?? "";
  }

  /** @param {number} i */
  argsOf(i) {
    return /** @type {HTMLElement} */ (this.texts[i].closest(".tool-call")).dataset.args ?? "";
  }

  /**
   * @param {Message} msg
   * @param {ToolCall} call
   * @param {number} i
   * @returns {HTMLElement}
   */
  card(msg, call, i) {
    const card = document.createElement("section");
    card.className = "tool-call";
    card.dataset.testid = "tool-call";
    card.dataset.status = call.status;
    card.dataset.name = call.name;
    card.dataset.args = call.arguments;
    const [server, tool] = splitName(call.name);
    card.setAttribute("aria-label", `Tool call: ${tool}${server ? ` of ${server}` : ""}`);
    cardCall.set(card, { msg, index: i });
    const head = document.createElement("div");
    head.className = "tool-call-head";
    const name = document.createElement("strong");
    name.dataset.testid = "tool-call-name";
    name.textContent = tool;
    const from = document.createElement("span");
    from.className = "tool-call-server";
    from.textContent = server ? `from ${server}` : "";
    const status = document.createElement("span");
    status.className = "tool-call-status";
    status.dataset.testid = "tool-call-status";
    const open = cardHooks.actionable(msg);
    status.textContent = call.status === "pending" && !open ? "not run" : STATUS[call.status]
      + (call.status === "done" && call.ms !== undefined ? ` in ${Math.round(call.ms)} ms` : "");
    head.append(name, from, status);
    const pre = document.createElement("pre");
    pre.className = "tool-call-text";
    pre.title = "The reply's tokens that spell this call; hover one for how sure the model was";
    const code = document.createElement("code");
    code.dataset.testid = "tool-call-text";
    pre.append(code);
    this.texts.push(code);
    card.append(head, pre);
    if (call.status === "pending" && open) card.append(actions(tool));
    return card;
  }
}

/**
 * Allow, Allow in this chat, Deny.
 * @param {string} tool
 * @returns {HTMLElement}
 */
function actions(tool) {
  const bar = document.createElement("div");
  bar.className = "tool-call-actions";
  const busy = cardHooks.busy();
  /** @type {[string, string, string, string][]} */
  const buttons = [["Allow", "allow", "tool-allow", "primary"],
    ["Allow in this chat", "always", "tool-allow-always", "secondary"], ["Deny", "deny", "tool-deny", "secondary"]];
  for (const [label, action, testid, cls] of buttons) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = cls;
    b.textContent = label;
    b.dataset.callAction = action;
    b.dataset.testid = testid;
    b.disabled = busy;
    if (action === "always") b.title = `Run this call, and every later call of ${tool} in this chat without asking`;
    bar.append(b);
  }
  return bar;
}

/**
 * A tool message: which call it answers and the result as text (never HTML).
 * @param {HTMLElement} body
 * @param {Message} msg
 */
export function renderToolResult(body, msg) {
  const head = document.createElement("div");
  head.className = "tool-result-head";
  const name = document.createElement("code");
  name.textContent = splitName(msg.toolName ?? "")[1] || "a tool";
  const why = msg.error ? `no result: ${msg.error.replace(/_/g, " ")}`
    : msg.isError ? "the tool reported an error" : "";
  const notes = [why, msg.truncated ? "cut to its first characters" : ""].filter((n) => n);
  head.append("Result of ", name, notes.length ? ` · ${notes.join(" · ")}` : "");
  const pre = document.createElement("pre");
  pre.className = "tool-result";
  pre.dataset.testid = "tool-result-text";
  pre.textContent = msg.content;
  body.replaceChildren(head, pre);
  if (msg.isError) body.dataset.error = "true";
}
