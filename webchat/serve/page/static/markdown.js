// @ts-check
/**
 * Markdown as pure functions over a source string: what kind of block a line starts, and the inline structure of a
 * span of text as a tree over source offsets. Nothing here touches the DOM; blocks.js places every source character
 * exactly once (visible text, or hidden markup) so that the rendered element's textContent is the source.
 *
 * Supported: ATX headings, ``` and ~~~ fences with a language, nested - * + and 1. lists, > quotes, pipe tables,
 * thematic breaks; inline code, ** __ strong, * _ emphasis, ~~ strike, [links](http…), backslash escapes.
 * Inline constructs stay within one line (a deliberate simplification: a finished line never re-renders).
 */

/**
 * @typedef {{type: "blank"} | {type: "text"} | {type: "hr"}
 *   | {type: "fence", ch: string, len: number, mark: number}
 *   | {type: "heading", level: number, mark: number}
 *   | {type: "item", indent: number, ordered: boolean, start: number, mark: number}
 *   | {type: "quote", mark: number}
 *   | {type: "tablesep", aligns: string[]}} LineKind
 *   `mark`: how many leading characters of the line are markup (hidden).
 * @typedef {{kind: "text" | "mark", a: number, b: number}
 *   | {kind: "el", tag: string, href?: string, children: MdNode[]}} MdNode
 *   One inline node: source range [a, b) shown as text or hidden as markup, or an element around children.
 */

const FENCE = /^( {0,3})(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+|$)/;
const ITEM = /^([ \t]*)([-*+]|(\d{1,9})[.)])[ \t]+/;
const QUOTE = /^ {0,3}> ?/;
const HR = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const TABLESEP = /^[ \t]*\|?[ \t]*:?-+:?[ \t]*(\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$/;

/**
 * The kind of block a line (without its "\n") starts.
 * @param {string} line
 * @returns {LineKind}
 */
export function classifyLine(line) {
  if (line.trim() === "") return { type: "blank" };
  let m = FENCE.exec(line);
  if (m) return { type: "fence", ch: m[2][0], len: m[2].length, mark: m[1].length + m[2].length };
  if ((m = HEADING.exec(line))) return { type: "heading", level: m[1].length, mark: m[0].length };
  if (HR.test(line)) return { type: "hr" };
  if (line.includes("|") && line.includes("-") && TABLESEP.test(line)) {
    const cells = line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
    const aligns = cells.map((c) => (c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : ""));
    return { type: "tablesep", aligns };
  }
  if ((m = ITEM.exec(line))) {
    const indent = m[1].replace(/\t/g, "    ").length;
    return { type: "item", indent, ordered: m[3] !== undefined, start: Number(m[3] ?? 1), mark: m[0].length };
  }
  if ((m = QUOTE.exec(line))) return { type: "quote", mark: m[0].length };
  return { type: "text" };
}

/**
 * Whether a line closes the open fence (same character, at least as long, nothing after it).
 * @param {string} line
 * @param {{ch: string, len: number}} fence
 * @returns {boolean}
 */
export function closesFence(line, fence) {
  const m = /^ {0,3}(`{3,}|~{3,})[ \t]*$/.exec(line);
  return m !== null && m[1][0] === fence.ch && m[1].length >= fence.len;
}

/**
 * Source offsets of the cell-separating pipes of a table row [a, b) (escaped pipes and pipes in code spans skipped).
 * @param {string} src
 * @param {number} a
 * @param {number} b
 * @returns {number[]}
 */
export function pipePositions(src, a, b) {
  const out = [];
  let code = false;
  for (let i = a; i < b; i++) {
    const c = src[i];
    if (c === "\\") i++;
    else if (c === "`") code = !code;
    else if (c === "|" && !code) out.push(i);
  }
  return out;
}

/** Delimiters of paired inline markup, longest first, and the element each makes. */
const PAIRS = [["**", "strong"], ["__", "strong"], ["~~", "del"], ["*", "em"], ["_", "em"]];

/**
 * Parses [a, b) of src into inline nodes.
 * @param {string} src
 * @param {number} a
 * @param {number} b
 * @returns {MdNode[]}
 */
export function parseInline(src, a, b) {
  /** @type {MdNode[]} */
  const out = [];
  let textStart = a;
  const flush = (/** @type {number} */ end) => {
    if (end > textStart) out.push({ kind: "text", a: textStart, b: end });
  };
  let i = a;
  while (i < b) {
    const c = src[i];
    /** @type {{nodes: MdNode[], end: number} | null} */
    let hit = null;
    if (c === "\\" && i + 1 < b && /[!-/:-@[-`{-~]/.test(src[i + 1])) {
      hit = { nodes: [{ kind: "mark", a: i, b: i + 1 }, { kind: "text", a: i + 1, b: i + 2 }], end: i + 2 };
    } else if (c === "`") {
      hit = codeSpan(src, i, b);
    } else if (c === "[") {
      hit = link(src, i, b);
    } else if (c === "*" || c === "_" || c === "~") {
      hit = emphasis(src, i, b);
    }
    if (hit) {
      flush(i);
      out.push(...hit.nodes);
      i = hit.end;
      textStart = i;
    } else {
      i++;
    }
  }
  flush(b);
  return out;
}

/**
 * @param {string} src
 * @param {number} i at a backtick
 * @param {number} b
 * @returns {{nodes: MdNode[], end: number} | null}
 */
function codeSpan(src, i, b) {
  let n = 0;
  while (src[i + n] === "`") n++;
  const fence = "`".repeat(n);
  const close = src.indexOf(fence, i + n);
  if (close < 0 || close + n > b || src[close + n] === "`") return null;
  /** @type {MdNode} */
  const el = { kind: "el", tag: "code", children: [
    { kind: "mark", a: i, b: i + n }, { kind: "text", a: i + n, b: close }, { kind: "mark", a: close, b: close + n },
  ] };
  return { nodes: [el], end: close + n };
}

/**
 * @param {string} src
 * @param {number} i at a delimiter character
 * @param {number} b
 * @returns {{nodes: MdNode[], end: number} | null}
 */
function emphasis(src, i, b) {
  for (const [d, tag] of PAIRS) {
    if (!src.startsWith(d, i)) continue;
    const inner = i + d.length;
    if (inner >= b || /\s/.test(src[inner])) continue;
    if (d[0] === "_" && i > 0 && /\w/.test(src[i - 1])) continue;  // snake_case stays text
    let close = src.indexOf(d, inner + 1);
    while (close >= 0 && close + d.length <= b && /\s/.test(src[close - 1])) close = src.indexOf(d, close + 1);
    if (close < 0 || close + d.length > b) continue;
    if (d.length === 1 && src[close + 1] === d) continue;  // "*a**": not a single-star pair
    /** @type {MdNode} */
    const el = { kind: "el", tag, children: [
      { kind: "mark", a: i, b: inner }, ...parseInline(src, inner, close), { kind: "mark", a: close, b: close + d.length },
    ] };
    return { nodes: [el], end: close + d.length };
  }
  return null;
}

/**
 * [text](http://… or https://…): a link; any other scheme stays text.
 * @param {string} src
 * @param {number} i at "["
 * @param {number} b
 * @returns {{nodes: MdNode[], end: number} | null}
 */
function link(src, i, b) {
  const mid = src.indexOf("](", i + 1);
  if (mid < 0 || mid >= b) return null;
  const end = src.indexOf(")", mid + 2);
  if (end < 0 || end >= b) return null;
  const href = src.slice(mid + 2, end).trim();
  if (!safeUrl(href)) return null;
  /** @type {MdNode} */
  const el = { kind: "el", tag: "a", href, children: [
    { kind: "mark", a: i, b: i + 1 }, ...parseInline(src, i + 1, mid), { kind: "mark", a: mid, b: end + 1 },
  ] };
  return { nodes: [el], end: end + 1 };
}

/**
 * Whether a link target is an absolute http(s) URL.
 * @param {string} href
 * @returns {boolean}
 */
export function safeUrl(href) {
  if (/\s/.test(href)) return false;
  try {
    const u = new URL(href);
    return u.protocol === "http:" || u.protocol === "https:";
  } catch {
    return false;
  }
}
