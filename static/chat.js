// @ts-check
/** The conversation view: the message list, stored replies re-rendered, action buttons, inline errors. */

import { BlockWriter, renderText } from "./blocks.js";
import { ReplyView, setMeta, tokenSpan } from "./reply.js";

/**
 * @typedef {import("./store.js").Message} Message
 * @typedef {{onRegenerate: () => void, onEdit: () => void}} Actions
 */

/** The message list. */
export class ChatView {
  /**
   * @param {HTMLElement} list
   * @param {Actions} actions
   */
  constructor(list, actions) {
    this.list = list;
    this.actions = actions;
    this.focusable = false;
    this.stickToEnd = true;
    this.scrollQueued = false;
    list.addEventListener("scroll", () => {
      this.stickToEnd = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
    }, { passive: true });
  }

  /**
   * Follows the end of the list once per frame (reading scrollHeight forces a layout: never once per chunk), unless
   * the reader scrolled up.
   * @param {boolean} force
   */
  scrollToEnd(force) {
    if (force) this.stickToEnd = true;
    if (this.scrollQueued) return;
    this.scrollQueued = true;
    requestAnimationFrame(() => {
      this.scrollQueued = false;
      if (this.stickToEnd) this.list.scrollTop = this.list.scrollHeight;
    });
  }

  /**
   * Renders a whole conversation; the last user message can be edited, the last reply regenerated.
   * @param {Message[]} messages
   */
  render(messages) {
    this.list.replaceChildren();
    const lastUser = messages.map((m) => m.role).lastIndexOf("user");
    messages.forEach((msg, i) => {
      const el = this.messageEl(msg, { edit: i === lastUser, regenerate: i === messages.length - 1 && msg.role === "assistant" });
      if (msg.role === "assistant") fillReply(el, msg, this.focusable);
      else renderText(/** @type {HTMLElement} */ (el.querySelector(".msg-body")), msg.content);
    });
    if (messages.length === 0) this.list.append(emptyHint());
  }

  /**
   * Appends a message element with its action buttons.
   * @param {Message} msg
   * @param {{edit: boolean, regenerate: boolean}} can
   * @returns {HTMLElement}
   */
  messageEl(msg, can) {
    this.list.querySelector(".empty-hint")?.remove();
    const el = document.createElement("article");
    el.className = `msg msg-${msg.role}`;
    el.dataset.testid = `${msg.role}-message`;
    const body = document.createElement("div");
    body.className = "msg-body";
    body.dataset.testid = "message-body";
    const meta = document.createElement("div");
    meta.className = "msg-meta";
    meta.dataset.testid = "reply-status";
    const bar = document.createElement("div");
    bar.className = "msg-actions";
    if (msg.role === "assistant") {
      bar.append(button("Copy", "copy", (b) => copy(msg.content, b)));
      if (can.regenerate) bar.append(button("Regenerate", "regenerate", () => this.actions.onRegenerate()));
    } else if (can.edit) {
      bar.append(button("Edit", "edit", () => this.actions.onEdit()));
    }
    el.append(body, meta, bar);
    this.list.append(el);
    return el;
  }

  /**
   * Appends an empty assistant message and returns its streaming view.
   * @param {Message} msg
   * @returns {ReplyView}
   */
  startReply(msg) {
    const el = this.messageEl(msg, { edit: false, regenerate: false });
    el.dataset.state = "waiting";
    const view = new ReplyView(el, msg, this.focusable);
    view.meta.textContent = "sending…";
    return view;
  }

  /**
   * Shows a server or connection error inline, below the messages.
   * @param {string} text
   * @param {string} code
   */
  showError(text, code) {
    this.clearError();
    const el = document.createElement("div");
    el.className = "error";
    el.dataset.testid = "error";
    el.dataset.code = code;
    el.setAttribute("role", "alert");
    const strong = document.createElement("strong");
    strong.textContent = code ? `${code}: ` : "";
    el.append(strong, document.createTextNode(text));
    this.list.append(el);
  }

  clearError() {
    this.list.querySelectorAll(".error").forEach((e) => e.remove());
  }

  /**
   * Puts the first token of every reply into (or out of) the tab order: one tab stop per reply, arrows inside.
   * @param {boolean} on
   */
  setFocusable(on) {
    this.focusable = on;
    for (const body of this.list.querySelectorAll(".msg-assistant .msg-body")) {
      body.querySelectorAll(".tok").forEach((t, i) => { /** @type {HTMLElement} */ (t).tabIndex = on && i === 0 ? 0 : -1; });
    }
  }
}

/**
 * Fills a stored reply: token spans when the token texts add up to the content, else plain text.
 * @param {HTMLElement} el
 * @param {Message} msg
 * @param {boolean} focusable
 */
function fillReply(el, msg, focusable) {
  const body = /** @type {HTMLElement} */ (el.querySelector(".msg-body"));
  const toks = msg.tokens ?? [];
  if (toks.length > 0 && toks.map((t) => t.text).join("") === msg.content) {
    const writer = new BlockWriter(body);
    toks.forEach((tok, i) => writer.append(tokenSpan(tok, focusable && i === 0), tok.text));
  } else {
    renderText(body, msg.content);
  }
  el.dataset.state = "done";
  if (msg.reason) el.dataset.reason = msg.reason;
  setMeta(/** @type {HTMLElement} */ (el.querySelector(".msg-meta")), msg);
}

/**
 * @param {string} label
 * @param {string} testid
 * @param {(b: HTMLButtonElement) => void} onClick
 * @returns {HTMLButtonElement}
 */
function button(label, testid, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "link";
  b.textContent = label;
  b.dataset.testid = testid;
  b.addEventListener("click", () => onClick(b));
  return b;
}

/** @returns {HTMLElement} */
function emptyHint() {
  const el = document.createElement("div");
  el.className = "empty-hint";
  el.textContent = "Start a conversation below. Turn on the heatmap to see how sure the model was of every token.";
  return el;
}

/**
 * Copies a reply's text to the clipboard; the button says whether it worked.
 * @param {string} text
 * @param {HTMLButtonElement} button
 */
async function copy(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  window.setTimeout(() => { button.textContent = "Copy"; }, 1500);
}
