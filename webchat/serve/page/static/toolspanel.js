// @ts-check
/**
 * The Tools panel (issue 66): the MCP servers this server was started with (`--mcp-config`, the `tools` message),
 * each one's state and tools; which tools the shown chat offers the model, which of them run without asking, and
 * whether its first reply to each question must call one; what the tools switched on take of the model's context.
 * Server and tool texts enter the DOM as text only.
 */

import { splitName } from "./toolcards.js";

/**
 * @typedef {import("./tree.js").Conversation} Conversation
 * @typedef {import("./connection.js").ToolServer} ToolServer
 * @typedef {{servers: ToolServer[], max_result_chars: number}} ToolsMessage
 */

const MAX_DESCRIPTION = 300;

export class ToolsPanel {
  /**
   * @param {HTMLElement} view the panel
   * @param {HTMLButtonElement} opener the header's Tools button
   * @param {(conv: Conversation) => void} onChange the chat's tools changed (save it)
   * @param {() => number} contextLength the model's context, in tokens
   */
  constructor(view, opener, onChange, contextLength) {
    this.view = view;
    this.opener = opener;
    this.onChange = onChange;
    this.contextLength = contextLength;
    /** @type {ToolsMessage | null} */
    this.state = null;
    /** @type {Conversation | null} */
    this.conv = null;
    opener.addEventListener("click", () => {
      const open = view.hidden;
      view.hidden = !open;
      opener.setAttribute("aria-expanded", String(open));
      if (open) /** @type {HTMLElement | null} */ (view.querySelector("input, select"))?.focus();
    });
  }

  /**
   * A `tools` message: the servers as they are now.
   * @param {ToolsMessage} msg
   */
  set(msg) {
    this.state = msg;
    this.opener.hidden = false;
    if (this.conv) this.show(this.conv);
  }

  /** @returns {Set<string>} the names of the tools ready servers list */
  ready() {
    const ready = (this.state?.servers ?? []).filter((s) => s.state === "ready");
    return new Set(ready.flatMap((s) => s.tools.map((t) => t.name)));
  }

  /**
   * Renders the panel for a chat (its switches), and the opener's count.
   * @param {Conversation} conv
   */
  show(conv) {
    this.conv = conv;
    const on = new Set(conv.tools ?? []);
    this.opener.textContent = on.size ? `Tools · ${on.size}` : "Tools";
    if (!this.state) return;
    const intro = document.createElement("p");
    intro.className = "tools-intro";
    intro.textContent = "The tools of this server's MCP servers (webchat serve --mcp-config). The model is offered the "
      + "ones switched on in this chat; each call it makes shows its arguments and waits for your Allow.";
    const servers = this.state.servers.map((s) => this.server(s, conv, on));
    if (servers.length === 0) intro.textContent += " The file names no server.";
    this.view.replaceChildren(intro, ...servers, this.choice(conv, on), this.summary(on));
  }

  /**
   * @param {ToolServer} s
   * @param {Conversation} conv
   * @param {Set<string>} on
   * @returns {HTMLElement}
   */
  server(s, conv, on) {
    const box = document.createElement("fieldset");
    box.className = "tools-server";
    box.dataset.testid = "tools-server";
    box.dataset.server = s.name;
    box.dataset.state = s.state;
    const legend = document.createElement("legend");
    const name = document.createElement("strong");
    name.textContent = s.name;
    const state = document.createElement("span");
    state.className = "tools-state";
    state.dataset.testid = "tools-server-state";
    state.textContent = s.state;
    legend.append(name, " ", state, ` · ${s.transport} · ${s.tools.length} tool${s.tools.length === 1 ? "" : "s"}`);
    box.append(legend);
    const retry = s.retry_in_s !== null ? `next try in ${s.retry_in_s} s` : "";
    const notes = [s.message, ...s.notes, retry].filter((n) => n);
    for (const note of notes) {
      const p = document.createElement("p");
      p.className = "tools-note";
      p.textContent = note;
      box.append(p);
    }
    const list = document.createElement("ul");
    list.className = "tools-list";
    for (const tool of s.tools) {
      const li = document.createElement("li");
      const label = document.createElement("label");
      const input = document.createElement("input");
      input.type = "checkbox";
      input.value = tool.name;
      input.checked = on.has(tool.name);
      input.dataset.testid = "tool-toggle";
      input.addEventListener("change", () => this.toggle(conv, tool.name, input.checked));
      const code = document.createElement("code");
      code.textContent = splitName(tool.name)[1];
      label.append(input, " ", code);
      const about = document.createElement("small");
      const text = tool.title && tool.title !== tool.tool ? `${tool.title}: ${tool.description}` : tool.description;
      about.textContent = `${text.length > MAX_DESCRIPTION ? `${text.slice(0, MAX_DESCRIPTION - 1)}…` : text} `
        + `(about ${tool.tokens} tokens)`;
      li.append(label, about);
      if (conv.allowedTools?.includes(tool.name)) li.append(this.askAgain(conv, tool.name));
      list.append(li);
    }
    box.append(list);
    return box;
  }

  /**
   * "runs without asking · Ask again": takes a tool off the chat's allowed list.
   * @param {Conversation} conv
   * @param {string} name
   * @returns {HTMLElement}
   */
  askAgain(conv, name) {
    const wrap = document.createElement("span");
    wrap.className = "tools-allowed";
    const b = document.createElement("button");
    b.type = "button";
    b.className = "link";
    b.dataset.testid = "tool-ask-again";
    b.textContent = "Ask again";
    b.addEventListener("click", () => {
      conv.allowedTools = (conv.allowedTools ?? []).filter((n) => n !== name);
      this.changed(conv);
    });
    wrap.append("runs without asking in this chat · ", b);
    return wrap;
  }

  /**
   * @param {Conversation} conv
   * @param {Set<string>} on
   * @returns {HTMLElement}
   */
  choice(conv, on) {
    const row = document.createElement("div");
    row.className = "tools-choice";
    const label = document.createElement("label");
    label.htmlFor = "tool-choice";
    label.textContent = "First reply to each question";
    const select = document.createElement("select");
    select.id = "tool-choice";
    select.dataset.testid = "tool-choice";
    select.append(new Option("the model decides", "auto"), new Option("must call a tool", "required"),
      ...[...on].map((n) => new Option(`must call ${n}`, n)));
    const current = conv.toolChoice ?? "auto";
    select.value = current === "auto" || current === "required" || on.has(current) ? current : "auto";
    select.disabled = on.size === 0;
    select.addEventListener("change", () => {
      conv.toolChoice = select.value;
      this.changed(conv);
    });
    row.append(label, select);
    return row;
  }

  /**
   * How many tools are on and what they take of the context.
   * @param {Set<string>} on
   * @returns {HTMLElement}
   */
  summary(on) {
    const p = document.createElement("p");
    p.className = "tools-summary";
    p.dataset.testid = "tools-summary";
    const tools = (this.state?.servers ?? []).flatMap((s) => s.tools).filter((t) => on.has(t.name));
    const tokens = tools.reduce((n, t) => n + t.tokens, 0);
    const context = this.contextLength();
    p.textContent = on.size === 0 ? "No tool is switched on in this chat: the model is offered none."
      : `${on.size} tool${on.size === 1 ? "" : "s"} on · about ${tokens} tokens of the model's ${context}-token `
        + "context go to describing them in every prompt";
    if (context && tokens > context / 2) {
      p.dataset.warn = "true";
      p.textContent += ": more than half of it. Switch some off, or the chat will have little room.";
    }
    const missing = [...on].filter((n) => !tools.some((t) => t.name === n));
    if (missing.length) p.textContent += ` (not offered now, their server is not ready: ${missing.join(", ")})`;
    return p;
  }

  /**
   * @param {Conversation} conv
   * @param {string} name
   * @param {boolean} checked
   */
  toggle(conv, name, checked) {
    const on = new Set(conv.tools ?? []);
    if (checked) on.add(name);
    else on.delete(name);
    conv.tools = [...on];
    this.changed(conv);
  }

  /**
   * Saves the chat and renders the panel again, the focus kept on the control that changed.
   * @param {Conversation} conv
   */
  changed(conv) {
    const focused = document.activeElement;
    const key = focused instanceof HTMLInputElement ? `input[value="${CSS.escape(focused.value)}"]`
      : focused instanceof HTMLSelectElement ? "select" : null;
    this.onChange(conv);
    this.show(conv);
    if (key) /** @type {HTMLElement | null} */ (this.view.querySelector(key))?.focus();
  }
}
