// @ts-check
/**
 * The block constructs of the Markdown writer (blocks.js): headings, fenced code with its language and Copy button,
 * pipe tables, nested lists. Each places its source characters through the writer (w.emit, w.inline, w.el), so the
 * writer's guarantees hold: every character once, in order, every token its own span.
 */

import { classifyLine, closesFence, pipePositions } from "./markdown.js";

/**
 * Renders one line [a, b) and its `nl` (0 or 1) newline character.
 * @param {import("./blocks.js").MarkdownWriter} w
 * @param {number} a
 * @param {number} b
 * @param {number} nl
 */
export function renderLine(w, a, b, nl) {
  const s = w.s;
  if (s.cut) {  // the rest of a line that was split: more of the same container
    s.cut = false;
    if (s.fence) w.emit(s.fence.code, a, b + nl, false);
    else w.inline(s.last, a, b);
    if (!s.fence) w.emit(s.last, b, b + nl, s.last.tagName !== "P" && s.last.tagName !== "BLOCKQUOTE");
    return;
  }
  const text = w.src.slice(a, b);
  if (s.fence) {
    if (closesFence(text, s.fence)) {
      w.emit(s.fence.wrap, a, b + nl, true);
      s.last = s.fence.wrap;
      s.fence = null;
    } else {
      w.emit(s.fence.code, a, b + nl, false);
    }
    return;
  }
  const kind = classifyLine(text);
  if (kind.type === "blank") {
    w.close();
    w.emit(s.last, a, b + nl, true);
  } else if (kind.type === "fence") {
    w.close();
    fence(w, a, b, nl, kind);
  } else if (kind.type === "tablesep" && s.header && w.added === null) {
    table(w, kind.aligns, a, b, nl);
  } else if (s.table && text.includes("|")) {
    row(w, /** @type {HTMLElement} */ (s.table.lastElementChild), "td", a, b, nl);
  } else if (kind.type === "heading") {
    w.close();
    block(w, `h${Math.min(6, kind.level + 2)}`, a, a + kind.mark, b, nl);
  } else if (kind.type === "hr") {
    w.close();
    const wrap = w.el("div", w.root, "md-hr");
    w.el("hr", wrap);
    w.emit(wrap, a, b + nl, true);
    s.last = wrap;
  } else if (kind.type === "item") {
    item(w, kind, a, b, nl);
  } else if (kind.type === "quote") {
    if (!s.quote) {
      w.close();
      s.quote = w.el("p", w.el("blockquote", w.root));
    }
    w.emit(s.quote, a, a + kind.mark, true);
    w.inline(s.quote, a + kind.mark, b);
    w.emit(s.quote, b, b + nl, false);
    s.last = s.quote;
  } else if (s.lists.length > 0 && !s.para) {  // lazy continuation of a list item
    const li = s.lists[s.lists.length - 1].li;
    w.inline(w.el("span", li, "md-soft"), a, b);
    w.emit(li, b, b + nl, true);
  } else {
    const fresh = !s.para;
    if (!s.para) {
      w.close();
      s.para = w.el("p", w.root);
    }
    w.inline(s.para, a, b);
    w.emit(s.para, b, b + nl, false);
    s.last = s.para;
    s.header = fresh && text.includes("|") ? { p: s.para, a, b } : null;
  }
}

/**
 * A block element holding one line: markup [a, m), inline [m, b), hidden newline.
 * @param {import("./blocks.js").MarkdownWriter} w
 * @param {string} tag
 * @param {number} a
 * @param {number} m
 * @param {number} b
 * @param {number} nl
 */
export function block(w, tag, a, m, b, nl) {
  const e = w.el(tag, w.root);
  w.emit(e, a, m, true);
  w.inline(e, m, b);
  w.emit(e, b, b + nl, true);
  w.s.last = e;
}

/**
 * @param {import("./blocks.js").MarkdownWriter} w
 * @param {number} a
 * @param {number} b
 * @param {number} nl
 * @param {{ch: string, len: number, mark: number}} kind
 */
export function fence(w, a, b, nl, kind) {
  const wrap = w.el("div", w.root, "code-block");
  const head = w.el("div", wrap, "code-head");
  w.emit(head, a, a + kind.mark, true);
  w.emit(w.el("span", head, "code-lang"), a + kind.mark, b, false);
  w.emit(head, b, b + nl, true);
  const copy = /** @type {HTMLButtonElement} */ (w.el("button", head, "code-copy"));
  copy.type = "button";
  copy.setAttribute("aria-label", "Copy code");
  copy.dataset.testid = "code-copy";
  copy.dataset.label = "Copy";
  const code = w.el("code", w.el("pre", wrap));
  copy.addEventListener("click", () => copyText(code.textContent ?? "", copy));
  w.s.fence = { ch: kind.ch, len: kind.len, wrap, code };
  w.s.last = code;
}

/**
 * The paragraph `header` was a table's header row: rebuild it as a table and add the hidden separator row.
 * @param {import("./blocks.js").MarkdownWriter} w
 * @param {string[]} aligns
 * @param {number} a
 * @param {number} b
 * @param {number} nl
 */
export function table(w, aligns, a, b, nl) {
  const s = w.s;
  const header = /** @type {{p: HTMLElement, a: number, b: number}} */ (s.header);
  const table = document.createElement("table");
  header.p.replaceWith(table);
  s.para = null;
  s.aligns = aligns;
  row(w, w.el("thead", table), "th", header.a, header.b, 1);
  const sep = w.el("tr", w.el("tbody", table), "md-sep");
  w.emit(w.el("td", sep), a, b + nl, true);
  s.table = table;
  s.header = null;
}

/**
 * One table row [a, b) into `group` (thead or tbody): pipes hidden, each cell's text inline.
 * @param {import("./blocks.js").MarkdownWriter} w
 * @param {HTMLElement} group
 * @param {"th" | "td"} tag
 * @param {number} a
 * @param {number} b
 * @param {number} nl
 */
export function row(w, group, tag, a, b, nl) {
  const tr = w.el("tr", group);
  const pipes = pipePositions(w.src, a, b);
  const text = w.src.slice(a, b);
  const lead = text.trimStart().startsWith("|") ? pipes.shift() ?? a : null;
  const trail = text.trimEnd().endsWith("|") && pipes.length > 0 ? pipes.pop() ?? b : null;
  const bounds = [lead === null ? a : lead + 1, ...pipes.flatMap((p) => [p, p + 1]), trail ?? b];
  for (let i = 0; i < bounds.length; i += 2) {
    const cell = w.el(tag, tr);
    const align = w.s.aligns[i / 2];
    if (align) cell.classList.add(`align-${align}`);
    if (i === 0) w.emit(cell, a, bounds[0], true);
    w.inline(cell, bounds[i], bounds[i + 1]);
    const next = i + 2 < bounds.length ? bounds[i + 2] : b + nl;
    w.emit(cell, bounds[i + 1], next, true);
    w.s.last = cell;
  }
}

/**
 * A list item: nesting by indentation; the marker is hidden, the list draws its own.
 * @param {import("./blocks.js").MarkdownWriter} w
 * @param {{indent: number, ordered: boolean, start: number, mark: number}} kind
 * @param {number} a
 * @param {number} b
 * @param {number} nl
 */
export function item(w, kind, a, b, nl) {
  const s = w.s;
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
    const parent = top ? top.li : w.root;
    const list = w.el(kind.ordered ? "ol" : "ul", parent);
    if (kind.ordered && kind.start !== 1) list.setAttribute("start", String(kind.start));
    top = { indent: kind.indent, ordered: kind.ordered, el: list, li: list };
    s.lists.push(top);
  }
  top.li = w.el("li", top.el);
  w.emit(top.li, a, a + kind.mark, true);
  w.inline(top.li, a + kind.mark, b);
  w.emit(top.li, b, b + nl, true);
  s.last = top.li;
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
