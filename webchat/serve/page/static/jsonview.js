// @ts-check
/**
 * A reply made under a JSON reply format, shown as highlighted JSON while it streams: every token stays its own span
 * (the heatmap's), and inside it each character is coloured by what it is in JSON: a key, a string, a number, a
 * literal (true, false, null) or punctuation. The lexer runs left to right across tokens, so a token that holds the
 * end of a key and the colon after it is split between the two colours. Same interface as blocks.js' MarkdownWriter.
 */

/**
 * @typedef {import("./blocks.js").Piece} Piece
 * @typedef {import("./blocks.js").MakeSpan} MakeSpan
 * @typedef {"key" | "str" | "num" | "lit" | "punct" | "ws"} Kind
 */

/** JSON's lexical state across tokens: inside a string (a key or a value), after a backslash, and the containers. */
export class JsonLexer {
  constructor() {
    this.inString = false;
    this.escape = false;
    this.isKey = false;
    /** @type {("{" | "[")[]} */
    this.stack = [];
    this.expectKey = false;  // inside an object, before a key (after `{` or `,`)
  }

  /**
   * The kind of each character of text, in order, the state carried on.
   * @param {string} text
   * @returns {Kind[]}
   */
  kinds(text) {
    /** @type {Kind[]} */
    const out = [];
    for (const ch of text) {
      const kind = this.step(ch);
      for (let i = 0; i < ch.length; i++) out.push(kind);  // a character beyond the BMP is two UTF-16 units
    }
    return out;
  }

  /**
   * @param {string} ch
   * @returns {Kind}
   */
  step(ch) {
    if (this.inString) {
      const kind = this.isKey ? "key" : "str";
      if (this.escape) this.escape = false;
      else if (ch === "\\") this.escape = true;
      else if (ch === "\"") this.inString = false;
      return kind;
    }
    if (ch === "\"") {
      this.inString = true;
      this.isKey = this.expectKey;
      this.expectKey = false;
      return this.isKey ? "key" : "str";
    }
    if (ch === "{" || ch === "[") {
      this.stack.push(ch);
      this.expectKey = ch === "{";
      return "punct";
    }
    if (ch === "}" || ch === "]") {
      this.stack.pop();
      this.expectKey = false;
      return "punct";
    }
    if (ch === ",") {
      this.expectKey = this.stack[this.stack.length - 1] === "{";
      return "punct";
    }
    if (ch === ":") return "punct";
    if (/\s/.test(ch)) return "ws";
    return /[-0-9.eE+]/.test(ch) ? "num" : "lit";
  }
}

export class JsonWriter {
  /**
   * @param {HTMLElement} root
   * @param {MakeSpan | null} makeSpan builds a token's span (null: plain text)
   */
  constructor(root, makeSpan) {
    this.root = root;
    this.makeSpan = makeSpan;
    this.pre = document.createElement("pre");
    this.pre.className = "json-reply";
    this.pre.dataset.testid = "json-reply";
    this.code = document.createElement("code");
    this.pre.append(this.code);
    root.append(this.pre);
    this.lexer = new JsonLexer();
    /** @type {Piece[]} */
    this.pieces = [];
    this.src = "";
    this.shown = 0;  // pieces placed in the DOM
  }

  /**
   * @param {string} text
   * @param {unknown} data a token (its own span), or null for plain text
   */
  push(text, data) {
    if (text === "") return;
    this.pieces.push({ a: this.src.length, b: this.src.length + text.length, data, index: this.pieces.length });
    this.src += text;
  }

  /** Places the pieces that arrived (each character's colour is final once lexed: nothing is re-rendered). */
  flush() {
    for (; this.shown < this.pieces.length; this.shown++) {
      const piece = this.pieces[this.shown];
      const text = this.src.slice(piece.a, piece.b);
      const parent = piece.data !== null && this.makeSpan ? this.makeSpan(piece, true) : this.code;
      if (parent !== this.code) this.code.append(parent);
      colour(parent, text, this.lexer.kinds(text));
    }
  }

  finish() {
    this.flush();
  }
}

/**
 * Appends text to parent in runs of one kind: a span per run (class `j-<kind>`), whitespace as plain text.
 * @param {HTMLElement} parent
 * @param {string} text
 * @param {Kind[]} kinds
 */
function colour(parent, text, kinds) {
  let start = 0;
  for (let i = 1; i <= text.length; i++) {
    if (i < text.length && kinds[i] === kinds[start]) continue;
    const run = text.slice(start, i);
    if (kinds[start] === "ws") parent.append(document.createTextNode(run));
    else {
      const span = document.createElement("span");
      span.className = `j-${kinds[start]}`;
      span.textContent = run;
      parent.append(span);
    }
    start = i;
  }
}
