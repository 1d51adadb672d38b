// @ts-check
/**
 * Markdown-ish blocks for streamed text: prose, and code fenced with ``` rendered as <pre>. Text enters the DOM only as
 * text nodes or as token spans built with textContent; a node is never split, so one token stays one span.
 */

const FENCE = /^\s{0,3}```/;
/** Nodes in a prose block before a line end starts the next one: a frame then relays out only the last block. */
const BLOCK_NODES = 64;

/** Appends nodes to the right block as text streams in; a line starting with ``` opens or closes a code block. */
export class BlockWriter {
  /** @param {HTMLElement} root */
  constructor(root) {
    this.root = root;
    /** @type {"prose" | "code"} */
    this.mode = "prose";
    /** @type {HTMLElement} */
    this.current = this.openBlock();
    /** @type {Node[]} nodes holding the current line (moved into a fence bar once the line proves to be a fence) */
    this.lineNodes = [];
    this.lineText = "";
    this.lineIsFence = false;
  }

  /** @returns {HTMLElement} a new block for the current mode, appended to the root */
  openBlock() {
    if (this.mode === "code") {
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      pre.append(code);
      this.root.append(pre);
      return code;
    }
    const div = document.createElement("div");
    div.className = "prose";
    this.root.append(div);
    return div;
  }

  /**
   * Appends a node whose text content is `text`.
   * @param {Node} node
   * @param {string} text
   */
  append(node, text) {
    this.current.append(node);
    this.lineNodes.push(node);
    let rest = text;
    for (;;) {
      const nl = rest.indexOf("\n");
      this.lineText += nl < 0 ? rest : rest.slice(0, nl);
      if (!this.lineIsFence && FENCE.test(this.lineText)) this.makeFence();
      if (nl < 0) break;
      this.endLine();
      rest = rest.slice(nl + 1);
      if (rest !== "") this.lineNodes.push(node);
    }
    const ended = text.endsWith("\n") && !this.lineIsFence;
    if (ended && this.mode === "prose" && this.current.childNodes.length >= BLOCK_NODES) this.current = this.openBlock();
  }

  /**
   * The current line is a fence: move its nodes into a fence bar (the code block's header or footer).
   */
  makeFence() {
    const bar = document.createElement("div");
    bar.className = this.mode === "prose" ? "fence fence-open" : "fence fence-close";
    const owner = this.current.tagName === "CODE" ? /** @type {HTMLElement} */ (this.current.parentElement) : this.current;
    owner.after(bar);
    bar.append(...this.lineNodes);
    if (owner.textContent === "" && owner !== bar) owner.remove();
    this.current = bar;
    this.lineIsFence = true;
  }

  endLine() {
    if (this.lineIsFence) {
      this.mode = this.mode === "prose" ? "code" : "prose";
      this.current = this.openBlock();
    }
    this.lineNodes = [];
    this.lineText = "";
    this.lineIsFence = false;
  }
}

/**
 * Renders plain text (a user message, or a reply without token data) into blocks.
 * @param {HTMLElement} root
 * @param {string} text
 */
export function renderText(root, text) {
  const writer = new BlockWriter(root);
  for (const line of text.split(/(?<=\n)/)) writer.append(document.createTextNode(line), line);
}
