// @ts-check
/**
 * Streams Markdown into the DOM while keeping every token its own span. Each source character is placed exactly once,
 * in source order: as visible text, or as hidden markup (`.md-mark`), so `root.textContent` is always the source.
 * Finished lines are rendered once; the unfinished last line is re-rendered on each flush (its nodes undone first).
 * A token whose characters fall into several elements gets a primary span (the first) and continuation spans; a span
 * that holds only markup is `.tok-hidden` (the heatmap draws it as a small coloured mark, so it can still be pointed at).
 */

import { parseInline } from "./markdown.js";
import { renderLine } from "./mdblocks.js";

/**
 * @typedef {{a: number, b: number, data: unknown, index: number}} Piece  source range [a, b) of one pushed piece
 * @typedef {(piece: Piece, primary: boolean) => HTMLElement} MakeSpan
 * @typedef {{indent: number, ordered: boolean, el: HTMLElement, li: HTMLElement}} ListLevel
 * @typedef {{para: HTMLElement | null, lists: ListLevel[], quote: HTMLElement | null, table: HTMLElement | null,
 *   aligns: string[], fence: {ch: string, len: number, wrap: HTMLElement, code: HTMLElement} | null,
 *   last: HTMLElement, header: {p: HTMLElement, a: number, b: number} | null, cut: boolean}} State
 *   `last`: where a line's hidden "\n" goes; `header`: a one-line paragraph with pipes (a table header if a
 *   separator line follows); `cut`: the current line was split (too long), its rest continues `last`.
 */

/** A partial line longer than this is finalised up to its last space, so one frame never re-renders a huge line. */
const MAX_PARTIAL = 800;

export class MarkdownWriter {
  /**
   * @param {HTMLElement} root
   * @param {MakeSpan | null} makeSpan builds a token's span (null: plain text nodes)
   */
  constructor(root, makeSpan) {
    this.root = root;
    this.makeSpan = makeSpan;
    this.src = "";
    /** @type {Piece[]} */
    this.pieces = [];
    this.done = 0;  // source offset up to which lines are final
    /** @type {State} */
    this.s = { para: null, lists: [], quote: null, table: null, aligns: [], fence: null, last: root, header: null,
      cut: false };
    /** @type {{node: Node}[] | null} nodes added by the provisional render (null: rendering is final) */
    this.added = null;
    /** @type {State | null} */
    this.saved = null;
    /** @type {WeakMap<Node, number>} piece index of each token span */
    this.owner = new WeakMap();
  }

  /**
   * Appends text to the source; `data` (a token) gives its characters one span, null plain text.
   * @param {string} text
   * @param {unknown} data
   */
  push(text, data) {
    if (text === "") return;
    this.pieces.push({ a: this.src.length, b: this.src.length + text.length, data, index: this.pieces.length });
    this.src += text;
  }

  /** Renders what arrived: whole lines for good, the last partial line provisionally. */
  flush() {
    this.undo();
    for (;;) {
      const nl = this.src.indexOf("\n", this.done);
      if (nl < 0) break;
      this.line(this.done, nl, 1);
      this.done = nl + 1;
    }
    if (this.src.length - this.done > MAX_PARTIAL) {
      const cut = this.src.lastIndexOf(" ", this.src.length - 1);
      if (cut > this.done) {
        this.line(this.done, cut + 1, 0);
        this.done = cut + 1;
        this.s.cut = true;
      }
    }
    if (this.done < this.src.length) {
      this.saved = snapshot(this.s);
      this.added = [];
      this.line(this.done, this.src.length, 0);
    }
  }

  /** Renders everything as final (the reply ended). */
  finish() {
    this.flush();
    if (this.added === null) return;
    this.undo();
    this.line(this.done, this.src.length, 0);
    this.done = this.src.length;
  }

  undo() {
    if (this.added === null) return;
    for (let i = this.added.length - 1; i >= 0; i--) this.added[i].node.parentNode?.removeChild(this.added[i].node);
    this.s = /** @type {State} */ (this.saved);
    this.added = null;
    this.saved = null;
  }

  /**
   * @param {Node} parent
   * @param {Node} node
   */
  add(parent, node) {
    parent.appendChild(node);
    this.added?.push({ node });
  }

  /**
   * @param {string} tag
   * @param {Node} parent
   * @param {string} [cls]
   * @returns {HTMLElement}
   */
  el(tag, parent, cls) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    this.add(parent, e);
    return e;
  }

  /**
   * Places source [a, b) into parent, split at piece boundaries; `mark`: hidden markup.
   * @param {HTMLElement} parent
   * @param {number} a
   * @param {number} b
   * @param {boolean} mark
   */
  emit(parent, a, b, mark) {
    for (let k = this.firstPieceAfter(a); k < this.pieces.length && a < b; k++) {
      const piece = this.pieces[k];
      const end = Math.min(b, piece.b);
      const text = document.createTextNode(this.src.slice(a, end));
      /** @type {Node} */
      let target = parent;
      if (this.makeSpan && piece.data !== null) {
        const lastChild = parent.lastChild;
        if (lastChild && this.owner.get(lastChild) === piece.index) {
          target = lastChild;
        } else {
          target = this.makeSpan(piece, a === piece.a);
          this.owner.set(target, piece.index);
          // nothing to see yet (markup, or only white space): the heatmap draws a small mark in its place
          /** @type {HTMLElement} */ (target).classList.add("tok-hidden");
          this.add(parent, target);
        }
        if (!mark && /\S/.test(text.data)) /** @type {HTMLElement} */ (target).classList.remove("tok-hidden");
      }
      if (mark) {
        const m = document.createElement("span");
        m.className = "md-mark";
        m.append(text);
        this.add(target, m);
      } else {
        this.add(target, text);
      }
      a = end;
    }
  }

  /**
   * Binary search: the first piece whose end is after offset a.
   * @param {number} a
   * @returns {number}
   */
  firstPieceAfter(a) {
    let lo = 0;
    let hi = this.pieces.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (this.pieces[mid].b <= a) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

  /**
   * Inline Markdown of [a, b) into parent.
   * @param {HTMLElement} parent
   * @param {number} a
   * @param {number} b
   */
  inline(parent, a, b) {
    this.nodes(parent, parseInline(this.src, a, b));
  }

  /**
   * @param {HTMLElement} parent
   * @param {import("./markdown.js").MdNode[]} nodes
   */
  nodes(parent, nodes) {
    for (const n of nodes) {
      if (n.kind !== "el") {
        this.emit(parent, n.a, n.b, n.kind === "mark");
        continue;
      }
      const e = this.el(n.tag, parent);
      if (n.href) {
        e.setAttribute("href", n.href);
        e.setAttribute("rel", "noopener noreferrer");
        e.setAttribute("target", "_blank");
      }
      this.nodes(e, n.children);
    }
  }

  /** Closes the open paragraph, lists, quote and table (the next line starts a new block). */
  close() {
    const s = this.s;
    s.para = null;
    s.lists = [];
    s.quote = null;
    s.table = null;
    s.header = null;
  }

  /**
   * Renders one line [a, b) and its `nl` (0 or 1) newline character (mdblocks.js renderLine).
   * @param {number} a
   * @param {number} b
   * @param {number} nl
   */
  line(a, b, nl) {
    renderLine(this, a, b, nl);
  }

}

/**
 * @param {State} s
 * @returns {State} a copy deep enough to undo a provisional line
 */
function snapshot(s) {
  return { ...s, lists: s.lists.map((l) => ({ ...l })), header: s.header && { ...s.header },
    fence: s.fence && { ...s.fence } };
}

/**
 * Renders plain text (a user message) as it is: one text node, whitespace kept by the stylesheet.
 * @param {HTMLElement} root
 * @param {string} text
 */
export function renderText(root, text) {
  root.classList.add("plain");
  root.append(document.createTextNode(text));
}

/**
 * Renders a whole Markdown text without token data (a reply stored without tokens).
 * @param {HTMLElement} root
 * @param {string} text
 */
export function renderMarkdown(root, text) {
  const w = new MarkdownWriter(root, null);
  w.push(text, null);
  w.finish();
}
