// @ts-check
/** The conversation view: the shown path of messages, their actions and ‹ n/m › versions, inline errors. */

import { renderText } from "./blocks.js";
import { thumbnails } from "./imageview.js";
import { ReplyView } from "./reply.js";
import { rawText } from "./thinking.js";
import { renderToolResult } from "./toolcards.js";
import { outsideCalls } from "./toolwire.js";

/**
 * @typedef {import("./store.js").Message} Message
 * @typedef {import("./tree.js").Step} Step
 * @typedef {import("./images.js").StoredImage} StoredImage
 * @typedef {{onEdit: (step: Step, text: string) => void, onRegenerate: (step: Step) => void,
 *            onContinue: (step: Step) => void, onDelete: (step: Step) => void,
 *            onVersion: (step: Step, delta: number) => void, onImage: (img: StoredImage) => void,
 *            score?: ScoreHooks}} Actions
 *   `onImage`: a message's thumbnail was clicked (the viewer enlarges it).
 * @typedef {{state: (step: Step) => {label: string, disabled: boolean, title: string}, onScore: (step: Step) => void,
 *            decorate: (el: HTMLElement, step: Step) => void}} ScoreHooks  a message's Score button and its panel
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
    this.busy = false;
    list.addEventListener("scroll", () => {
      this.stickToEnd = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
    }, { passive: true });
  }

  /**
   * Follows the end of the list once per frame, unless the reader scrolled up.
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
   * Renders the shown path. `live` is a reply still streaming (its view is returned), `busy` disables the actions
   * that would start a request.
   * @param {Step[]} steps
   * @param {Message | null} live
   * @param {boolean} busy
   * @returns {ReplyView | null}
   */
  render(steps, live, busy) {
    this.busy = busy;
    this.list.replaceChildren();
    /** @type {ReplyView | null} */
    let liveView = null;
    for (const step of steps) {
      const el = this.messageEl(step, step.index === steps.length - 1);
      this.actions.score?.decorate(el, step);
      if (step.msg.role === "user") {
        const body = /** @type {HTMLElement} */ (el.querySelector(".msg-body"));
        renderText(body, step.msg.content);
        if (step.msg.images?.length) body.before(thumbnails(step.msg.images, this.actions.onImage));
        if (step.msg.content === "") body.hidden = true;  // an image sent without words
        continue;
      }
      if (step.msg.role === "tool") {  // a call's result, as the model is told it
        renderToolResult(/** @type {HTMLElement} */ (el.querySelector(".msg-body")), step.msg);
        continue;
      }
      const view = new ReplyView(el, step.msg, this.focusable);
      if (step.msg === live) {
        liveView = view;
        el.dataset.state = "streaming";
        view.flush();
      } else {
        view.finishRender();
      }
    }
    if (steps.length === 0) this.list.append(emptyHint());
    return liveView;
  }

  /**
   * Appends a message element with its action bar.
   * @param {Step} step
   * @param {boolean} last
   * @returns {HTMLElement}
   */
  messageEl(step, last) {
    const msg = step.msg;
    const el = document.createElement("article");
    el.className = `msg msg-${msg.role}`;
    el.dataset.testid = `${msg.role}-message`;
    el.setAttribute("aria-label", msg.role === "user" ? "You said" : msg.role === "tool" ? "A tool's result"
      : "The model replied");
    const body = document.createElement("div");
    body.className = "msg-body";
    body.dataset.testid = "message-body";
    const meta = document.createElement("div");
    meta.className = "msg-meta";
    meta.dataset.testid = "reply-status";
    const bar = document.createElement("div");
    bar.className = "msg-actions";
    if (step.thread.versions.length > 1) bar.append(this.versions(step));
    const a = this.actions;
    if (msg.role === "assistant" && msg.model) {
      const who = document.createElement("span");
      who.className = "msg-model";
      who.dataset.testid = "reply-model";
      who.textContent = msg.model;
      bar.append(who);
    }
    if (msg.role === "assistant") {
      // the answer, never the thinking, nor its tool calls' markup
      const words = msg.toolCalls ? outsideCalls(msg.content, msg.toolCalls) : msg.content;
      bar.append(button("Copy", "copy", (b) => copy(words, b)));
      bar.append(button("Regenerate", "regenerate", () => a.onRegenerate(step), this.busy));
      if (last) bar.append(button("Continue", "continue", () => a.onContinue(step), this.busy || rawText(msg) === ""));
    } else if (msg.role === "tool") {
      bar.append(button("Copy", "copy", (b) => copy(msg.content, b)));
    } else {
      bar.append(button("Edit", "edit", () => this.edit(el, step), this.busy));
    }
    const score = msg.role === "tool" ? null : a.score?.state(step);
    if (a.score && score) {
      const idle = !this.busy || score.label !== "Score";
      const b = button(score.label, "score", () => a.score?.onScore(step), score.disabled || !idle);
      b.title = score.title;
      bar.append(b);
    }
    bar.append(button("Delete", "delete", () => a.onDelete(step), this.busy));
    el.append(body, meta, bar);
    this.list.append(el);
    return el;
  }

  /**
   * ‹ n/m › for a message with several versions.
   * @param {Step} step
   * @returns {HTMLElement}
   */
  versions(step) {
    const nav = document.createElement("span");
    nav.className = "versions";
    const n = step.thread.current + 1;
    const m = step.thread.versions.length;
    const prev = button("‹", "version-prev", () => this.actions.onVersion(step, -1), n === 1);
    prev.setAttribute("aria-label", "Previous version");
    const next = button("›", "version-next", () => this.actions.onVersion(step, 1), n === m);
    next.setAttribute("aria-label", "Next version");
    const label = document.createElement("span");
    label.dataset.testid = "version";
    label.textContent = `${n}/${m}`;
    label.setAttribute("aria-label", `version ${n} of ${m}`);
    nav.append(prev, label, next);
    return nav;
  }

  /**
   * Replaces a user message with an editor; saving adds a new version and asks for a new reply.
   * @param {HTMLElement} el
   * @param {Step} step
   */
  edit(el, step) {
    const body = /** @type {HTMLElement} */ (el.querySelector(".msg-body"));
    body.hidden = false;
    const area = document.createElement("textarea");
    area.className = "edit-area";
    area.dataset.testid = "edit-input";
    area.setAttribute("aria-label", "Edit your message");
    area.value = step.msg.content;
    area.rows = Math.min(10, step.msg.content.split("\n").length + 1);
    const save = button("Save and send", "edit-save", () => this.actions.onEdit(step, area.value), this.busy);
    save.classList.replace("link", "primary");
    const cancel = button("Cancel", "edit-cancel", () => {
      body.replaceChildren();
      renderText(body, step.msg.content);
      body.hidden = step.msg.content === "";
      el.querySelector(".edit-bar")?.remove();
    });
    const editBar = document.createElement("div");
    editBar.className = "edit-bar";
    editBar.append(save, cancel);
    body.replaceChildren(area);
    body.classList.remove("plain");
    body.after(editBar);
    area.focus();
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
      body.querySelectorAll(".tok:not(.tok-cont)").forEach((t, i) => {
        /** @type {HTMLElement} */ (t).tabIndex = on && i === 0 ? 0 : -1;
      });
    }
  }
}

/**
 * @param {string} label
 * @param {string} testid
 * @param {(b: HTMLButtonElement) => void} onClick
 * @param {boolean} [disabled]
 * @returns {HTMLButtonElement}
 */
function button(label, testid, onClick, disabled = false) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "link";
  b.textContent = label;
  b.dataset.testid = testid;
  b.disabled = disabled;
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
 * @param {HTMLButtonElement} b
 */
async function copy(text, b) {
  try {
    await navigator.clipboard.writeText(text);
    b.textContent = "Copied";
  } catch {
    b.textContent = "Copy failed";
  }
  window.setTimeout(() => { b.textContent = "Copy"; }, 1500);
}
