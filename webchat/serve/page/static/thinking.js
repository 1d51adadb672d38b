// @ts-check
/**
 * A reply's thinking: the "Thinking" fold above its answer (open while the thinking streams, folded once the answer
 * starts, "Thought for 4.2 s · 180 tokens"), written by the same Markdown writer and token spans as the answer, so
 * the heatmap, the popover and branching work inside it; the text the model wrote (markers and all) for a branch or
 * Continue; and a stored or imported reply whose text holds a `<think>…</think>` block, split into the two parts.
 */

import { MarkdownWriter } from "./blocks.js";

/**
 * @typedef {import("./store.js").Message} Message
 * @typedef {import("./heatmap.js").Tok} Tok
 * @typedef {import("./blocks.js").MakeSpan} MakeSpan
 */

/** Start and end markers reasoning models write (webchat.text.thinking.KNOWN_MARKERS, the same list). */
export const MARKERS = [["<think>", "</think>"], ["<|begin_of_thought|>", "<|end_of_thought|>"],
  ["<thinking>", "</thinking>"], ["<|START_THINKING|>", "<|END_THINKING|>"], ["◁think▷", "◁/think▷"],
  ["<seed:think>", "</seed:think>"]];

/**
 * The text the model wrote for this reply: its tokens' own text (`raw` where the split took a marker out), or, for a
 * reply without tokens, its thinking in the first markers, then its answer.
 * @param {Message} msg
 * @returns {string}
 */
export function rawText(msg) {
  const toks = msg.tokens ?? [];
  if (toks.length > 0 && tokensFit(msg)) return toks.map((t) => t.raw ?? t.text).join("");
  if (msg.thinking === undefined) return msg.content;
  const [start, end] = MARKERS[0];
  return msg.content === "" ? `${start}\n${msg.thinking}` : `${start}\n${msg.thinking}\n${end}\n\n${msg.content}`;
}

/**
 * Whether a reply's tokens spell its parts: the thinking tokens its thinking, the others its answer.
 * @param {Message} msg
 * @returns {boolean}
 */
export function tokensFit(msg) {
  const toks = msg.tokens ?? [];
  const text = (/** @type {boolean} */ thinking) => toks.filter((t) => (t.part === "thinking") === thinking)
    .map((t) => t.text).join("");
  return text(false) === msg.content && text(true) === (msg.thinking ?? "");
}

/**
 * Where a text opens with a thinking block: [thinking from, thinking to, end marker's end, answer from] (the
 * whitespace after each marker left out, as the server splits), or null.
 * @param {string} text
 * @returns {[number, number, number, number] | null}
 */
export function thinkingBlock(text) {
  const lead = text.length - text.trimStart().length;
  for (const [start, end] of MARKERS) {
    if (!text.startsWith(start, lead)) continue;
    const from = skipSpace(text, lead + start.length);
    const to = text.indexOf(end, from);
    if (to < 0) return [from, text.length, text.length, text.length];
    return [from, to, to + end.length, skipSpace(text, to + end.length)];
  }
  return null;
}

/** @param {string} text @param {number} i @returns {number} */
function skipSpace(text, i) {
  while (i < text.length && /\s/.test(text[i])) i++;
  return i;
}

/**
 * A stored or imported reply whose content opens with a thinking block (an older page, another tool's export): the
 * block moves to `thinking`, the tags leave the text, and its tokens are labelled (their written text kept as `raw`).
 * @param {Message} msg
 * @returns {boolean} whether it changed
 */
export function splitStored(msg) {
  if (msg.role !== "assistant" || msg.thinking !== undefined) return false;
  const block = thinkingBlock(msg.content);
  if (!block) return false;
  const [from, to, close, answer] = block;
  const content = msg.content;
  const toks = msg.tokens ?? [];
  if (toks.length > 0 && toks.map((t) => t.text).join("") === content) {
    let at = 0;
    for (const t of toks) {
      const a = at;
      at += t.text.length;
      const think = content.slice(Math.max(a, from), Math.min(at, to));
      const said = content.slice(Math.max(a, answer), at);
      const shown = said || think;
      if (shown !== t.text) t.raw = t.text;
      if (!said && a < close) t.part = "thinking";  // the markers' tokens too, as the server labels them
      t.text = shown;
    }
  }
  msg.thinking = content.slice(from, to);
  msg.content = content.slice(answer);
  if (toks.length > 0 && !tokensFit(msg)) delete msg.tokens;  // a token across a marker: the text stays, not them
  return true;
}

/**
 * "Thought for 4.2 s · 180 tokens" (the time when it was measured, tokens when they are known, else characters).
 * @param {Message} msg
 * @param {boolean} streaming
 * @returns {string}
 */
export function thoughtLine(msg, streaming) {
  const n = (msg.tokens ?? []).filter((t) => t.part === "thinking" && t.raw === undefined).length;  // no markers
  const size = n > 0 ? `${n} token${n === 1 ? "" : "s"}` : `${(msg.thinking ?? "").length} characters`;
  if (streaming) return `Thinking… · ${size}`;
  return msg.thoughtMs !== undefined ? `Thought for ${(msg.thoughtMs / 1000).toFixed(1)} s · ${size}`
    : `Thought · ${size}`;
}

/** The fold of one reply's thinking, inserted before its answer's body. */
export class ThinkingFold {
  /**
   * @param {HTMLElement} body the answer's body (the fold goes before it)
   * @param {MakeSpan} makeSpan
   */
  constructor(body, makeSpan) {
    this.el = document.createElement("details");
    this.el.className = "thinking";
    this.el.dataset.testid = "thinking";
    this.summary = document.createElement("summary");
    this.summary.dataset.testid = "thinking-summary";
    this.body = document.createElement("div");
    this.body.className = "msg-body thinking-body";
    this.body.dataset.testid = "thinking-body";
    this.el.append(this.summary, this.body);
    body.before(this.el);
    this.writer = new MarkdownWriter(this.body, makeSpan);
    /** @type {"new" | "open" | "folded"} opened once as the thinking streams, folded once as the answer begins */
    this.stage = "new";
  }

  /**
   * The summary line; the fold opened when the thinking starts streaming and folded when the answer begins, once
   * each (the reader may open or close it meanwhile). A reply cut inside its thinking stays open.
   * @param {Message} msg
   * @param {boolean} streaming the thinking is still coming
   */
  show(msg, streaming) {
    this.summary.textContent = thoughtLine(msg, streaming);
    this.el.dataset.state = streaming ? "streaming" : "done";
    if (this.stage !== "folded" && msg.content !== "") {
      this.el.open = false;
      this.stage = "folded";
    } else if (this.stage === "new") {
      this.el.open = true;
      this.stage = "open";
    }
  }
}

/**
 * The per-chat "Think" switch, shown for a model whose template takes `enable_thinking` (hello.thinking.switch, or
 * the picked model's card): a chat keeps its choice (`think`, on unless turned off) and sends it as the request's
 * chat_template_kwargs.
 */
export class ThinkSwitch {
  /**
   * @param {HTMLElement} wrap the switch's label (hidden for other models)
   * @param {HTMLInputElement} box
   * @param {(on: boolean) => void} onChange
   */
  constructor(wrap, box, onChange) {
    this.wrap = wrap;
    this.box = box;
    this.offered = false;
    box.addEventListener("change", () => onChange(box.checked));
  }

  /** @param {{switch: boolean} | null | undefined} thinking the model's (null: it does not think) */
  setModel(thinking) {
    this.offered = Boolean(thinking?.switch);
    this.wrap.hidden = !this.offered;
  }

  /** @param {import("./tree.js").Conversation} conv the chat shown */
  show(conv) {
    this.box.checked = conv.think !== false;
  }

  /**
   * @param {import("./tree.js").Conversation} conv
   * @returns {Record<string, unknown> | null} the chat's template variables, null where the model has no switch
   */
  kwargs(conv) {
    return this.offered ? { enable_thinking: conv.think !== false } : null;
  }
}
