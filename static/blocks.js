// @ts-check
/**
 * Streams Markdown into the DOM while keeping every token its own span. Each source character is placed exactly once,
 * in source order: as visible text, or as hidden markup (`.md-mark`), so `root.textContent` is always the source.
 * Finished lines are rendered once; the unfinished last line is re-rendered on each flush (its nodes undone first).
 * A token whose characters fall into several elements gets a primary span (the first) and continuation spans; a span
 * that holds only markup is `.tok-hidden` (the heatmap draws it as a small coloured mark, so it can still be pointed at).
 */

import { classifyLine, closesFence, parseInline, pipePositions } from "./markdown.js";

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
   * Renders one line [a, b) and its `nl` (0 or 1) newline character.
   * @param {number} a
   * @param {number} b
   * @param {number} nl
   */
  line(a, b, nl) {
    const s = this.s;
    if (s.cut) {  // the rest of a line that was split: more of the same container
      s.cut = false;
      if (s.fence) this.emit(s.fence.code, a, b + nl, false);
      else this.inline(s.last, a, b);
      if (!s.fence) this.emit(s.last, b, b + nl, s.last.tagName !== "P" && s.last.tagName !== "BLOCKQUOTE");
      return;
    }
    const text = this.src.slice(a, b);
    if (s.fence) {
      if (closesFence(text, s.fence)) {
        this.emit(s.fence.wrap, a, b + nl, true);
        s.last = s.fence.wrap;
        s.fence = null;
      } else {
        this.emit(s.fence.code, a, b + nl, false);
      }
      return;
    }
    const kind = classifyLine(text);
    if (kind.type === "blank") {
      this.close();
      this.emit(s.last, a, b + nl, true);
    } else if (kind.type === "fence") {
      this.close();
      this.fence(a, b, nl, kind);
    } else if (kind.type === "tablesep" && s.header && this.added === null) {
      this.table(kind.aligns, a, b, nl);
    } else if (s.table && text.includes("|")) {
      this.row(/** @type {HTMLElement} */ (s.table.lastElementChild), "td", a, b, nl);
    } else if (kind.type === "heading") {
      this.close();
      this.block(`h${Math.min(6, kind.level + 2)}`, a, a + kind.mark, b, nl);
    } else if (kind.type === "hr") {
      this.close();
      const wrap = this.el("div", this.root, "md-hr");
      this.el("hr", wrap);
      this.emit(wrap, a, b + nl, true);
      s.last = wrap;
    } else if (kind.type === "item") {
      this.item(kind, a, b, nl);
    } else if (kind.type === "quote") {
      if (!s.quote) {
        this.close();
        s.quote = this.el("p", this.el("blockquote", this.root));
      }
      this.emit(s.quote, a, a + kind.mark, true);
      this.inline(s.quote, a + kind.mark, b);
      this.emit(s.quote, b, b + nl, false);
      s.last = s.quote;
    } else if (s.lists.length > 0 && !s.para) {  // lazy continuation of a list item
      const li = s.lists[s.lists.length - 1].li;
      this.inline(this.el("span", li, "md-soft"), a, b);
      this.emit(li, b, b + nl, true);
    } else {
      const fresh = !s.para;
      if (!s.para) {
        this.close();
        s.para = this.el("p", this.root);
      }
      this.inline(s.para, a, b);
      this.emit(s.para, b, b + nl, false);
      s.last = s.para;
      s.header = fresh && text.includes("|") ? { p: s.para, a, b } : null;
    }
  }

  /**
   * A block element holding one line: markup [a, m), inline [m, b), hidden newline.
   * @param {string} tag
   * @param {number} a
   * @param {number} m
   * @param {number} b
   * @param {number} nl
   */
  block(tag, a, m, b, nl) {
    const e = this.el(tag, this.root);
    this.emit(e, a, m, true);
    this.inline(e, m, b);
    this.emit(e, b, b + nl, true);
    this.s.last = e;
  }

  /**
   * @param {number} a
   * @param {number} b
   * @param {number} nl
   * @param {{ch: string, len: number, mark: number}} kind
   */
  fence(a, b, nl, kind) {
    const wrap = this.el("div", this.root, "code-block");
    const head = this.el("div", wrap, "code-head");
    this.emit(head, a, a + kind.mark, true);
    this.emit(this.el("span", head, "code-lang"), a + kind.mark, b, false);
    this.emit(head, b, b + nl, true);
    const copy = /** @type {HTMLButtonElement} */ (this.el("button", head, "code-copy"));
    copy.type = "button";
    copy.setAttribute("aria-label", "Copy code");
    copy.dataset.testid = "code-copy";
    copy.dataset.label = "Copy";
    const code = this.el("code", this.el("pre", wrap));
    copy.addEventListener("click", () => copyText(code.textContent ?? "", copy));
    this.s.fence = { ch: kind.ch, len: kind.len, wrap, code };
    this.s.last = code;
  }

  /**
   * The paragraph `header` was a table's header row: rebuild it as a table and add the hidden separator row.
   * @param {string[]} aligns
   * @param {number} a
   * @param {number} b
   * @param {number} nl
   */
  table(aligns, a, b, nl) {
    const s = this.s;
    const header = /** @type {{p: HTMLElement, a: number, b: number}} */ (s.header);
    const table = document.createElement("table");
    header.p.replaceWith(table);
    s.para = null;
    s.aligns = aligns;
    this.row(this.el("thead", table), "th", header.a, header.b, 1);
    const sep = this.el("tr", this.el("tbody", table), "md-sep");
    this.emit(this.el("td", sep), a, b + nl, true);
    s.table = table;
    s.header = null;
  }

  /**
   * One table row [a, b) into `group` (thead or tbody): pipes hidden, each cell's text inline.
   * @param {HTMLElement} group
   * @param {"th" | "td"} tag
   * @param {number} a
   * @param {number} b
   * @param {number} nl
   */
  row(group, tag, a, b, nl) {
    const tr = this.el("tr", group);
    const pipes = pipePositions(this.src, a, b);
    const text = this.src.slice(a, b);
    const lead = text.trimStart().startsWith("|") ? pipes.shift() ?? a : null;
    const trail = text.trimEnd().endsWith("|") && pipes.length > 0 ? pipes.pop() ?? b : null;
    const bounds = [lead === null ? a : lead + 1, ...pipes.flatMap((p) => [p, p + 1]), trail ?? b];
    for (let i = 0; i < bounds.length; i += 2) {
      const cell = this.el(tag, tr);
      const align = this.s.aligns[i / 2];
      if (align) cell.classList.add(`align-${align}`);
      if (i === 0) this.emit(cell, a, bounds[0], true);
      this.inline(cell, bounds[i], bounds[i + 1]);
      const next = i + 2 < bounds.length ? bounds[i + 2] : b + nl;
      this.emit(cell, bounds[i + 1], next, true);
      this.s.last = cell;
    }
  }

  /**
   * A list item: nesting by indentation; the marker is hidden, the list draws its own.
   * @param {{indent: number, ordered: boolean, start: number, mark: number}} kind
   * @param {number} a
   * @param {number} b
   * @param {number} nl
   */
  item(kind, a, b, nl) {
    const s = this.s;
    s.para = null;
    s.quote = null;
    s.table = null;
    s.header = null;
    while (s.lists.length > 0 && s.lists[s.lists.length - 1].indent > kind.indent) s.lists.pop();
    let top = s.lists[s.lists.length - 1];
    if (top && top.indent === kind.indent && top.ordered !== kind.ordered) {
      s.lists.pop();
      top = s.lists[s.lists.length - 1];
    }
    if (!top || top.indent < kind.indent) {
      const parent = top ? top.li : this.root;
      const list = this.el(kind.ordered ? "ol" : "ul", parent);
      if (kind.ordered && kind.start !== 1) list.setAttribute("start", String(kind.start));
      top = { indent: kind.indent, ordered: kind.ordered, el: list, li: list };
      s.lists.push(top);
    }
    top.li = this.el("li", top.el);
    this.emit(top.li, a, a + kind.mark, true);
    this.inline(top.li, a + kind.mark, b);
    this.emit(top.li, b, b + nl, true);
    s.last = top.li;
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
 * Copies text; the button's label (drawn from data-label by CSS) says whether it worked.
 * @param {string} text
 * @param {HTMLButtonElement} button
 */
async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.dataset.label = "Copied";
  } catch {
    button.dataset.label = "Copy failed";
  }
  window.setTimeout(() => { button.dataset.label = "Copy"; }, 1500);
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
