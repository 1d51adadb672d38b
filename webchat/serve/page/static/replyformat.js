// @ts-check
/**
 * The chat's reply format (Settings → "Reply format"): text, any JSON object, or a JSON schema, pasted or picked from
 * the schemas of the chat's earlier replies. It belongs to the conversation (`conv.format`, so export and import carry
 * it) and goes out as `generate.response_format` (docs/protocol.md); the server's grammar makes every reply valid.
 */

/**
 * @typedef {{type: "json_object"} | {type: "json_schema", json_schema: {name: string, schema: Record<string, unknown>}}}
 *   ReplyFormat
 * @typedef {import("./tree.js").Conversation} Conversation
 * @typedef {import("./tree.js").Thread} Thread
 */

/**
 * The first problem of a stored reply format, as "field: expected …, got …", or "".
 * @param {unknown} f
 * @param {string} at
 * @returns {string}
 */
export function checkFormat(f, at) {
  const shown = (/** @type {unknown} */ v) => JSON.stringify(v)?.slice(0, 60) ?? String(v);
  if (typeof f !== "object" || f === null) return `${at}: expected a reply format object, got ${shown(f)}`;
  const fmt = /** @type {Record<string, unknown>} */ (f);
  if (fmt.type === "json_object") return "";
  if (fmt.type !== "json_schema") return `${at}.type: expected "json_object" or "json_schema", got ${shown(fmt.type)}`;
  const js = /** @type {Record<string, unknown> | null} */ (typeof fmt.json_schema === "object" ? fmt.json_schema : null);
  if (!js || typeof js.name !== "string" || typeof js.schema !== "object" || js.schema === null
      || Array.isArray(js.schema)) {
    return `${at}.json_schema: expected {name: string, schema: object}, got ${shown(fmt.json_schema)}`;
  }
  return "";
}

/**
 * The distinct JSON schemas a conversation's replies were made under (every version), newest last.
 * @param {Conversation} conv
 * @returns {ReplyFormat[]}
 */
export function earlierSchemas(conv) {
  /** @type {Map<string, ReplyFormat>} */
  const seen = new Map();
  /** @param {Thread | null} t */
  const walk = (t) => {
    for (const v of t?.versions ?? []) {
      const f = v.msg.format;
      if (f && f.type === "json_schema") seen.set(JSON.stringify(f.json_schema.schema), f);
      walk(v.next);
    }
  };
  walk(conv.root);
  return [...seen.values()];
}

export class ReplyFormatField {
  /**
   * @param {HTMLElement} form the settings form (the field goes at its end)
   * @param {(conv: Conversation) => void} onChange the conversation's format changed (save it)
   */
  constructor(form, onChange) {
    this.onChange = onChange;
    /** @type {Conversation | null} */
    this.conv = null;
    this.wrap = document.createElement("fieldset");
    this.wrap.className = "field reply-format";
    const legend = document.createElement("legend");
    legend.textContent = "Reply format";
    this.kind = document.createElement("select");
    this.kind.id = "set-reply_format";
    this.kind.dataset.testid = "setting-reply_format";
    this.kind.setAttribute("aria-label", "Reply format");
    for (const [value, text] of [["text", "Text"], ["json_object", "JSON (any object)"], ["json_schema", "JSON schema"]]) {
      this.kind.append(new Option(text, value));
    }
    this.pick = document.createElement("select");
    this.pick.dataset.testid = "reply-schema-pick";
    this.pick.setAttribute("aria-label", "A schema of this chat's earlier replies");
    this.schema = document.createElement("textarea");
    this.schema.id = "set-reply_schema";
    this.schema.rows = 6;
    this.schema.spellcheck = false;
    this.schema.dataset.testid = "setting-reply_schema";
    this.schema.setAttribute("aria-label", "JSON schema of the reply");
    this.schema.placeholder = '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}';
    const hint = document.createElement("small");
    hint.className = "hint";
    hint.textContent = "Kept with this chat. The reply is valid JSON (of the schema) by construction.";
    this.err = document.createElement("small");
    this.err.className = "field-error";
    this.err.id = "err-reply_format";
    this.err.dataset.testid = "setting-error-reply_format";
    this.err.setAttribute("aria-live", "polite");
    this.schema.setAttribute("aria-describedby", this.err.id);
    this.wrap.append(legend, this.kind, this.pick, this.schema, hint, this.err);
    form.append(this.wrap);
    this.kind.addEventListener("change", () => this.changed());
    this.schema.addEventListener("input", () => this.changed());
    this.pick.addEventListener("change", () => {
      const f = earlierSchemas(/** @type {Conversation} */ (this.conv))[Number(this.pick.value)];
      if (f && f.type === "json_schema") this.schema.value = JSON.stringify(f.json_schema.schema, null, 2);
      this.pick.value = "";
      this.changed();
    });
  }

  /**
   * Shows a conversation's format (on switching chats, and after a reply: its schema joins the earlier ones).
   * @param {Conversation} conv
   */
  show(conv) {
    const other = this.conv !== conv;  // the same chat again: what is being typed stays
    this.conv = conv;
    const f = conv.format;
    if (other) {
      this.kind.value = f?.type ?? "text";
      this.schema.value = f?.type === "json_schema" ? JSON.stringify(f.json_schema.schema, null, 2) : "";
      this.err.textContent = "";
    }
    const earlier = earlierSchemas(conv);
    this.pick.replaceChildren(new Option(`Earlier schemas in this chat (${earlier.length})`, ""),
      ...earlier.map((e, i) => new Option(e.type === "json_schema" ? e.json_schema.name : "JSON", String(i))));
    this.pick.hidden = earlier.length === 0;
    this.sync();
  }

  /** The format to send with this chat's next request, or null for text. @returns {ReplyFormat | null} */
  value() {
    return this.conv?.format ?? null;
  }

  /** What is wrong with the format being typed ("" when nothing). @returns {string} */
  error() {
    return this.err.textContent ?? "";
  }

  changed() {
    const conv = this.conv;
    if (!conv) return;
    const kind = this.kind.value;
    let problem = "";
    if (kind === "text") delete conv.format;
    else if (kind === "json_object") conv.format = { type: "json_object" };
    else {
      problem = this.parse();
      if (!problem) {
        const schema = JSON.parse(this.schema.value);
        const name = typeof schema.title === "string" && /^[\w.-]{1,64}$/.test(schema.title) ? schema.title : "reply";
        conv.format = { type: "json_schema", json_schema: { name, schema } };
      }
    }
    this.err.textContent = problem;
    this.schema.setAttribute("aria-invalid", problem ? "true" : "false");
    this.sync();
    if (!problem) this.onChange(conv);
  }

  /** @returns {string} */
  parse() {
    const raw = this.schema.value.trim();
    if (raw === "") return "expected a JSON schema (an object), got nothing";
    try {
      const v = JSON.parse(raw);
      if (typeof v !== "object" || v === null || Array.isArray(v)) {
        return `expected a JSON schema (an object), got ${Array.isArray(v) ? "a list" : typeof v}`;
      }
    } catch (err) {
      return `expected a JSON schema (an object), got text that is not JSON (${String(err).replace(/^SyntaxError: /, "")})`;
    }
    return "";
  }

  sync() {
    this.schema.hidden = this.kind.value !== "json_schema";
    if (this.kind.value !== "json_schema") {
      this.err.textContent = "";
      this.pick.hidden = true;
    } else {
      this.pick.hidden = this.pick.options.length <= 1;
    }
  }
}
