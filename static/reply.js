// @ts-check
/** One assistant reply: token spans (merged byte pieces), the live stream, its status line (stats, stop reason). */

import { BlockWriter } from "./blocks.js";
import { paintToken } from "./heatmap.js";

/**
 * @typedef {import("./heatmap.js").Tok} Tok
 * @typedef {import("./store.js").Message} Message
 * @typedef {import("./store.js").Stats} Stats
 * @typedef {import("./connection.js").WireToken} WireToken
 */

/** Token data of each span, for the popover. */
export const tokenData = /** @type {WeakMap<Element, Tok>} */ (new WeakMap());

/**
 * Merges byte tokens that together complete one character: all but the last have text "" (docs/protocol.md).
 * p = Π p_i (the joint probability), rank = max rank_i, alternatives of the first part.
 * @param {WireToken[]} parts
 * @returns {Tok}
 */
export function mergeParts(parts) {
  const last = parts[parts.length - 1];
  if (parts.length === 1) return { id: last.id, text: last.text, p: last.p, rank: last.rank, top: last.top };
  const p = parts.reduce((acc, t) => acc * t.p, 1);
  const rank = Math.max(...parts.map((t) => t.rank));
  return { id: parts[0].id, text: last.text, p, rank, top: parts[0].top, parts: parts.length };
}

/**
 * Human summary of a reply's stats: time to first token, tokens/s, token count, acceptance rate with speculation.
 * @param {Stats} s
 * @returns {string}
 */
export function statsLine(s) {
  const parts = [];
  if (s.ttft_ms !== undefined) parts.push(`first token ${Math.round(s.ttft_ms)} ms`);
  if (s.decode_tps !== undefined) parts.push(`${s.decode_tps.toFixed(1)} tok/s`);
  if (s.new_tokens !== undefined) parts.push(`${s.new_tokens} tokens`);
  if (s.drafted) parts.push(`accepted ${Math.round((100 * (s.accepted ?? 0)) / s.drafted)}% of ${s.drafted} drafted`);
  return parts.join(" · ");
}

/** @type {Record<string, string>} */
const REASONS = {
  cancelled: "stopped", max_new_tokens: "length limit", context_full: "context full", interrupted: "connection lost",
};

/** One assistant reply being streamed: appends tokens live and keeps the message object up to date. */
export class ReplyView {
  /**
   * @param {HTMLElement} el the message element
   * @param {Message} msg
   * @param {boolean} focusable whether the first token joins the tab order (heatmap on)
   */
  constructor(el, msg, focusable) {
    this.el = el;
    this.msg = msg;
    this.body = /** @type {HTMLElement} */ (el.querySelector(".msg-body"));
    this.meta = /** @type {HTMLElement} */ (el.querySelector(".msg-meta"));
    this.writer = new BlockWriter(this.body);
    this.focusable = focusable;
    /** @type {WireToken[]} */
    this.pending = [];
    this.sentAt = performance.now();
    /** @type {number | null} */
    this.firstAt = null;
    this.count = 0;
    msg.tokens = msg.tokens ?? [];
  }

  /** @param {number} position */
  queued(position) {
    this.el.dataset.state = "queued";
    this.meta.textContent = `waiting in queue: position ${position}`;
  }

  started() {
    this.el.dataset.state = "prefill";
    this.meta.textContent = "reading the prompt…";
  }

  /** @param {{text: string, tokens?: WireToken[]}} chunk */
  chunk(chunk) {
    this.el.dataset.state = "streaming";
    if (this.firstAt === null) this.firstAt = performance.now();
    this.msg.content += chunk.text;
    if (chunk.tokens) {
      for (const t of chunk.tokens) this.addWireToken(t);
      this.count += chunk.tokens.length;
    } else {
      this.writer.append(document.createTextNode(chunk.text), chunk.text);
      this.count += 1;
    }
    const secs = (performance.now() - this.firstAt) / 1000;
    const rate = secs > 0.05 ? ` · ${((this.count - 1) / secs).toFixed(1)} tok/s` : "";
    this.meta.textContent = `${this.count} tokens${rate}`;
  }

  /** @param {WireToken} t */
  addWireToken(t) {
    this.pending.push(t);
    if (t.text === "") return;
    const tok = mergeParts(this.pending);
    this.pending = [];
    /** @type {Tok[]} */ (this.msg.tokens).push(tok);
    const first = this.body.querySelector(".tok") === null;
    this.writer.append(tokenSpan(tok, first && this.focusable), tok.text);
  }

  /**
   * @param {string} reason
   * @param {Stats | undefined} stats
   */
  finish(reason, stats) {
    this.msg.reason = reason;
    if (stats) this.msg.stats = stats;
    this.el.dataset.state = "done";
    this.el.dataset.reason = reason;
    if (!this.msg.tokens || this.msg.tokens.length === 0) delete this.msg.tokens;
    setMeta(this.meta, this.msg);
  }
}

/**
 * One token span: its text as textContent, its probability in data-p, colours as CSS custom properties.
 * @param {Tok} tok
 * @param {boolean} tabbable
 * @returns {HTMLSpanElement}
 */
export function tokenSpan(tok, tabbable) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = tok.text;
  span.dataset.testid = "token";
  span.dataset.p = String(tok.p);
  span.dataset.rank = String(tok.rank);
  if (tok.parts && tok.parts > 1) span.dataset.parts = String(tok.parts);
  span.tabIndex = tabbable ? 0 : -1;
  paintToken(span, tok);
  tokenData.set(span, tok);
  return span;
}

/**
 * @param {HTMLElement} meta
 * @param {Message} msg
 */
export function setMeta(meta, msg) {
  meta.replaceChildren();
  const reason = msg.reason && REASONS[msg.reason];
  if (reason) {
    const badge = document.createElement("span");
    badge.className = `badge badge-${msg.reason}`;
    badge.dataset.testid = msg.reason === "cancelled" ? "stopped" : `reason-${msg.reason}`;
    badge.textContent = reason;
    meta.append(badge);
  }
  if (msg.stats) meta.append(document.createTextNode(statsLine(msg.stats)));
}
