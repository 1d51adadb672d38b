// @ts-check
/**
 * One assistant reply: the token data kept on its message (merged byte pieces), the live Markdown rendering with one
 * span per token, and its status line (stats, mean log-probability, perplexity, stop reason).
 */

import { MarkdownWriter } from "./blocks.js";
import { JsonWriter } from "./jsonview.js";
import { paintToken } from "./heatmap.js";
import { ThinkingFold, tokensFit } from "./thinking.js";
import { CallCards } from "./toolcards.js";

/**
 * @typedef {import("./heatmap.js").Tok} Tok
 * @typedef {import("./store.js").Message} Message
 * @typedef {import("./store.js").Stats} Stats
 * @typedef {import("./connection.js").WireToken} WireToken
 * @typedef {import("./blocks.js").Piece} Piece
 * @typedef {"thinking" | "answer"} Part
 * @typedef {[string, Tok | null, Part, number]} Shown  text, its token (null: text only), its part, the token's index
 */

/** Token data of each span (primary and continuation), for the popover; the token's index in its reply. */
export const tokenData = /** @type {WeakMap<Element, Tok>} */ (new WeakMap());
export const tokenIndex = /** @type {WeakMap<Element, number>} */ (new WeakMap());
/**
 * The streaming reply reaches the DOM at most every FLUSH_MS (20 times a second) and nothing else on the page changes
 * per chunk: the browser shares the CPU with the model on a small machine, and redrawing on every animation frame made
 * the engine decode at 70 / 59 tok/s (heatmap off / on) behind headless Chromium on 2 cores against ~146 for a socket
 * client; now 85 / 81 against ~133 (bench/bench_page.py, docs/perf-history.md).
 * A flush costs more as the block it writes into grows (the browser lays out a paragraph or a code block whole), and
 * where it costs more the page flushes less often: at least FLUSH_BUDGET times a flush's own time apart (its script,
 * style and layout, averaged), up to FLUSH_MAX_MS. On a fast machine that stays at FLUSH_MS; behind a long paragraph on
 * 2 busy cores it keeps the browser's CPU a token from doubling.
 */
const FLUSH_MS = 50;
const FLUSH_MAX_MS = 200;
const FLUSH_BUDGET = 60;

/**
 * Merges byte tokens that together complete one character: all but the last have text "" (docs/protocol.md).
 * p = Π p_i (the joint probability), sp = Π sampled_p_i, rank = max rank_i, alternatives of the first part.
 * @param {WireToken[]} parts
 * @returns {Tok}
 */
export function mergeParts(parts) {
  const last = parts[parts.length - 1];
  const sps = parts.map((t) => t.sampled_p);
  const sp = sps.every((x) => typeof x === "number") ? sps.reduce((acc, x) => acc * /** @type {number} */ (x), 1) : null;
  /** @type {Tok} */
  const tok = parts.length === 1 ? { id: last.id, text: last.text, p: last.p, rank: last.rank, top: last.top }
    : { id: parts[0].id, text: last.text,
      p: parts.every((t) => t.p !== null) ? parts.reduce((acc, t) => acc * /** @type {number} */ (t.p), 1) : null,
      rank: parts.every((t) => t.rank !== null) ? Math.max(...parts.map((t) => /** @type {number} */ (t.rank))) : null,
      top: parts[0].top, parts: parts.length };
  if (sp !== null) tok.sp = sp;
  if (last.forbidden && last.forbidden.length) tok.forbidden = last.forbidden;
  return tok;
}

/**
 * Mean natural log-probability of a reply's tokens and its perplexity exp(-mean), or null without token data.
 * @param {Tok[] | undefined} tokens
 * @returns {{mean: number, ppl: number} | null}
 */
export function confidence(tokens) {
  const ps = /** @type {number[]} */ ((tokens ?? []).map((t) => t.p).filter((p) => p !== null && p > 0));
  if (ps.length === 0) return null;
  const mean = ps.reduce((acc, p) => acc + Math.log(p), 0) / ps.length;
  return { mean, ppl: Math.exp(-mean) };
}

/**
 * Human summary of a reply's stats: time to first token, tokens/s, token count, with speculation the tokens
 * drafted and how many of them the model accepted, and about images their tokens and the time encoding them took.
 * @param {Stats} s
 * @returns {string}
 */
export function statsLine(s) {
  const parts = [];
  if (s.ttft_ms !== undefined) parts.push(`first token ${Math.round(s.ttft_ms)} ms`);
  if (s.decode_tps !== undefined) parts.push(`${s.decode_tps.toFixed(1)} tok/s`);
  if (s.new_tokens !== undefined) parts.push(`${s.new_tokens} tokens`);
  if (s.drafted) {
    const accepted = s.accepted ?? 0;
    parts.push(`drafted ${s.drafted}, accepted ${accepted} (${Math.round((100 * accepted) / s.drafted)}%)`);
  }
  if (s.image_tokens) {
    const ms = s.encode_ms ?? 0;
    const how = ms > 0 ? `encoded in ${(ms / 1000).toFixed(1)} s` : "from the cache";
    parts.push(`${s.image_tokens} image tokens, ${how}`);
  }
  return parts.join(" · ");
}

/** @type {Record<string, string>} */
const REASONS = {
  cancelled: "stopped", max_new_tokens: "length limit", context_full: "context full", interrupted: "connection lost",
  error: "error",
};

/**
 * Keeps a reply's message up to date from chunks, with or without a view (a reply streaming in the background): the
 * answer in `content`, the thinking in `thinking` (and how long it took, `thoughtMs`), every token in `tokens`.
 */
export class ReplyData {
  /** @param {Message} msg */
  constructor(msg) {
    this.msg = msg;
    /** @type {WireToken[]} */
    this.pending = [];
    msg.tokens = msg.tokens ?? [];
    /** @type {number | null} when this request's thinking began (less what an earlier request already thought) */
    this.thinkFrom = null;
  }

  /**
   * Applies a chunk; returns the pieces that now have text.
   * @param {{text: string, thinking?: string, tokens?: WireToken[]}} chunk
   * @returns {Shown[]}
   */
  apply(chunk) {
    const msg = this.msg;
    msg.content += chunk.text;
    if (chunk.thinking) {
      msg.thinking = (msg.thinking ?? "") + chunk.thinking;
      this.thinkFrom = this.thinkFrom ?? performance.now() - (msg.thoughtMs ?? 0);
    }
    if (this.thinkFrom !== null && (chunk.thinking || chunk.text)) msg.thoughtMs = performance.now() - this.thinkFrom;
    if (chunk.text) this.thinkFrom = null;  // the answer began: the thinking's time is taken
    const toks = /** @type {Tok[]} */ (msg.tokens);
    if (!chunk.tokens || chunk.tokens.length === 0) {  // text only (an engine that returned no tokens)
      return /** @type {Shown[]} */ ([[chunk.thinking ?? "", null, "thinking", -1], [chunk.text, null, "answer", -1]])
        .filter(([text]) => text !== "");
    }
    /** @type {Shown[]} */
    const out = [];
    for (const t of chunk.tokens) {
      this.pending.push(t);
      if (t.text === "" && t.raw === undefined) continue;  // a byte of a character the next token completes
      const tok = mergeParts(this.pending);
      this.pending = [];
      if (t.part === "thinking") tok.part = "thinking";
      if (t.raw !== undefined && tok.parts === undefined) tok.raw = t.raw;
      toks.push(tok);
      out.push([tok.text, tok, tok.part ?? "answer", toks.length - 1]);
    }
    return out;
  }
}

/** One assistant reply on screen: renders its stored text and tokens, then what streams in. */
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
    this.focusable = focusable;
    this.index = 0;
    /** @type {(piece: Piece, primary: boolean) => HTMLElement} */
    const span = (piece, primary) => this.span(piece, primary);
    // a reply made under a JSON format: highlighted JSON, every token still its own span (jsonview.js)
    this.writer = msg.format ? new JsonWriter(this.body, span) : new MarkdownWriter(this.body, span);
    /** @type {CallCards | null} its tool calls as cards (toolcards.js), given the answer's text that spells them */
    this.cards = msg.toolCalls?.length ? new CallCards(el, msg, span) : null;
    this.queuedFlush = false;
    this.flushedAt = 0;
    this.flushCost = 0;  // ms a flush takes on the main thread, averaged
    this.sentAt = performance.now();
    /** @type {number | null} */
    this.firstAt = null;
    this.count = 0;
    /** @type {ThinkingFold | null} */
    this.fold = null;
    /** @type {Map<Tok, number>} each token's index in the reply's tokens (for a branch) */
    this.indexOf = new Map();
    const toks = msg.tokens ?? [];
    if (msg.thinking !== undefined) this.openFold();
    if (toks.length > 0 && tokensFit(msg)) {
      toks.forEach((t, i) => this.push(t.text, t, t.part ?? "answer", i));
    } else {
      this.push(msg.thinking ?? "", null, "thinking", -1);
      this.push(msg.content, null, "answer", -1);
    }
  }

  /** @returns {ThinkingFold} the thinking's fold, made when the first thinking arrives */
  openFold() {
    this.fold = this.fold ?? new ThinkingFold(this.body, (piece, primary) => this.span(piece, primary));
    return this.fold;
  }

  /**
   * @param {string} text
   * @param {Tok | null} tok
   * @param {Part} part
   * @param {number} index
   */
  push(text, tok, part, index) {
    if (tok) this.indexOf.set(tok, index);
    if (text === "") return;
    if (part === "thinking") this.openFold().writer.push(text, tok);
    else if (!this.cards) this.writer.push(text, tok);
    else for (const [piece, call] of this.cards.route(text)) {
      if (call < 0) this.writer.push(piece, tok);
      else this.cards.push(call, piece, tok);
    }
  }

  /**
   * @param {Piece} piece
   * @param {boolean} primary
   * @returns {HTMLElement}
   */
  span(piece, primary) {
    const tok = /** @type {Tok} */ (piece.data);
    const span = tokenSpan(tok, primary && piece.index === 0 && this.focusable, primary);
    tokenIndex.set(span, this.indexOf.get(tok) ?? piece.index);
    return span;
  }

  /** Renders what arrived (the thinking's fold too) while the reply streams. */
  flush() {
    this.writer.flush();
    if (this.fold) {
      this.fold.writer.flush();
      this.fold.show(this.msg, this.el.dataset.state === "streaming" && this.msg.content === "");
    }
  }

  /** Renders what is stored as final (a finished reply). */
  finishRender() {
    this.writer.finish();
    this.cards?.finish();
    if (this.fold) {
      this.fold.writer.finish();
      this.fold.show(this.msg, false);
    }
    this.el.dataset.state = "done";
    if (this.msg.reason) this.el.dataset.reason = this.msg.reason;
    setMeta(this.meta, this.msg);
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

  /**
   * Renders pieces that ReplyData applied; the DOM (the reply and its count line) catches up at most every FLUSH_MS.
   * @param {Shown[]} pieces
   */
  chunk(pieces) {
    this.el.dataset.state = "streaming";
    if (this.firstAt === null) this.firstAt = performance.now();
    for (const [text, tok, part, index] of pieces) this.push(text, tok, part, index);
    this.count += pieces.length;
    if (this.queuedFlush) return;
    this.queuedFlush = true;
    const interval = Math.min(FLUSH_MAX_MS, Math.max(FLUSH_MS, FLUSH_BUDGET * this.flushCost));
    const wait = Math.max(0, this.flushedAt + interval - performance.now());
    setTimeout(() => requestAnimationFrame(() => {
      this.queuedFlush = false;
      const start = this.flushedAt = performance.now();
      if (this.el.dataset.state === "done") return;
      this.flush();
      const secs = (start - /** @type {number} */ (this.firstAt)) / 1000;
      const rate = secs > 0.05 ? ` · ${((this.count - 1) / secs).toFixed(1)} tok/s` : "";
      this.meta.textContent = `${this.count} tokens${rate}`;
      void this.body.offsetHeight; // style and layout now, inside the time measured (the frame needs them anyway)
      this.flushCost = 0.7 * this.flushCost + 0.3 * (performance.now() - start);
    }), wait);
  }

  /**
   * @param {string} reason
   * @param {Stats | undefined} stats
   */
  finish(reason, stats) {
    this.msg.reason = reason;
    if (stats) this.msg.stats = stats;
    if (this.msg.tokens && this.msg.tokens.length === 0) delete this.msg.tokens;
    this.finishRender();
  }
}

/**
 * One token span: its text added by the writer, its probability in data-p, colours as CSS custom properties.
 * A continuation span (the same token's text in a second element) is not a tab stop of its own.
 * @param {Tok} tok
 * @param {boolean} tabbable
 * @param {boolean} primary
 * @returns {HTMLSpanElement}
 */
export function tokenSpan(tok, tabbable, primary) {
  const span = document.createElement("span");
  span.className = primary ? "tok" : "tok tok-cont";
  span.dataset.testid = primary ? "token" : "token-part";
  span.dataset.p = String(tok.p);
  span.dataset.rank = String(tok.rank);
  if (tok.parts && tok.parts > 1) span.dataset.parts = String(tok.parts);
  if (tok.picked) span.dataset.picked = "true";
  if (primary) span.tabIndex = tabbable ? 0 : -1;
  paintToken(span, tok);
  tokenData.set(span, tok);
  return span;
}

/**
 * The status line: stop reason badge, stats, mean log-probability and perplexity.
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
  const parts = msg.stats ? [statsLine(msg.stats)] : [];
  const c = confidence(msg.tokens);
  if (c) parts.push(`mean logprob ${c.mean.toFixed(2)} · perplexity ${c.ppl.toFixed(2)}`);
  meta.append(document.createTextNode(parts.filter((p) => p).join(" · ")));
  if (c) meta.dataset.meanLogprob = String(c.mean);
}
