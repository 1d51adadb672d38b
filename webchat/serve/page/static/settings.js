// @ts-check
/** The settings side panel: one spec per field, validation shown next to the field, kept in localStorage. */

import { loadSettings, saveSettings } from "./store.js";

/**
 * @typedef {{key: string, label: string, kind: "int" | "float" | "text" | "select" | "seed" | "bias" | "lines",
 *            def: string, min?: number, max?: number, minOpen?: boolean, hint: string}} FieldSpec
 *   `minOpen`: the minimum itself is not allowed (min < x).
 * @typedef {{system: string, settings: Record<string, number | null | Record<string, number>>,
 *            max_new_tokens: number, alternatives: number, speculative: string | null, stop: string[],
 *            image_max_tiles: number | null}} RequestSettings
 *   `speculative` null: the server's default mode; `image_max_tiles` null: the server's default tiles.
 */

/** @type {FieldSpec[]} */
export const FIELDS = [
  { key: "system", label: "System prompt", kind: "text", def: "", hint: "Empty: the model's own default." },
  { key: "temperature", label: "Temperature", kind: "float", def: "0.7", min: 0, max: 5, hint: "0 = greedy." },
  { key: "top_k", label: "Top-k", kind: "int", def: "40", min: 0, max: 100000, hint: "0 = off." },
  { key: "top_p", label: "Top-p", kind: "float", def: "0.95", min: 0, max: 1, minOpen: true, hint: "1 = off." },
  { key: "min_p", label: "Min-p", kind: "float", def: "0.05", min: 0, max: 1, hint: "0 = off." },
  { key: "typical_p", label: "Typical-p", kind: "float", def: "1.0", min: 0, max: 1, minOpen: true, hint: "1 = off." },
  { key: "repetition_penalty", label: "Repetition penalty", kind: "float", def: "1.0", min: 0, max: 10, minOpen: true,
    hint: "1 = off." },
  { key: "repetition_range", label: "Repetition range", kind: "int", def: "0", min: 0, max: 1000000,
    hint: "Tokens looked back for the penalties; 0 = the whole context." },
  { key: "frequency_penalty", label: "Frequency penalty", kind: "float", def: "0", min: -2, max: 2,
    hint: "Subtracted once per earlier use of a token; 0 = off." },
  { key: "presence_penalty", label: "Presence penalty", kind: "float", def: "0", min: -2, max: 2,
    hint: "Subtracted once from any token already used; 0 = off." },
  { key: "token_bias", label: "Token bias", kind: "bias", def: "",
    hint: "One \"token id: bias\" per line, bias in [-100, 100]; -100 bans the token." },
  { key: "stop", label: "Stop strings", kind: "lines", def: "",
    hint: "One per line (\\n for a line break); the reply ends before any of them. At most 16." },
  { key: "max_new_tokens", label: "Max new tokens", kind: "int", def: "512", min: 1, max: 1048576,
    hint: "Reply length limit." },
  { key: "alternatives", label: "Alternatives per token", kind: "int", def: "5", min: 1, max: 20,
    hint: "Top tokens shown in the heatmap popover." },
  { key: "speculative", label: "Speculative decoding", kind: "select", def: "",
    hint: "Modes the server offers; its default is its --speculative (auto: drafts only where they pay)." },
  { key: "seed", label: "Seed", kind: "seed", def: "", min: 0, max: 4294967295, hint: "Empty = random." },
  { key: "image_max_tiles", label: "Image tiles", kind: "int", def: "", min: 1, max: 36,
    hint: "The most tiles an image is read as, 1-36: more see finer detail and take longer to read. "
      + "Empty = the server's --image-max-tiles." },
  { key: "tool_rounds", label: "Tool rounds", kind: "int", def: "8", min: 1, max: 64,
    hint: "Times the model may call tools and read their results for one question; then it answers without tools." },
];

/**
 * Checks one raw field value; returns an error message naming the expected range and the actual value, or "".
 * @param {FieldSpec} spec
 * @param {string} raw
 * @param {{options: string[], contextLength: number, maxAlternatives: number}} limits
 * @returns {string}
 */
export function validate(spec, raw, limits) {
  const v = raw.trim();
  if (spec.kind === "text") return "";
  if (spec.kind === "bias") return checkBias(v);
  if (spec.kind === "lines") return checkStops(raw);
  if (spec.kind === "select") {
    return v === "" || limits.options.includes(v) ? "" : `expected one of ${limits.options.join(", ")}, got "${v}"`;
  }
  if (v === "" && spec.def === "") return "";  // empty: the server decides (a random seed, its tiles)
  if (spec.key === "max_new_tokens" && v === spec.def) return ""; // the default: request() fits it to the context
  const max = spec.key === "max_new_tokens" ? limits.contextLength
    : spec.key === "alternatives" ? limits.maxAlternatives : /** @type {number} */ (spec.max);
  const min = /** @type {number} */ (spec.min);
  const isInt = spec.kind !== "float";
  const ok = isInt ? /^[+-]?\d+$/.test(v) : /^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$/.test(v);
  const range = `${spec.minOpen ? "(" : "["}${min}, ${max}]`;
  if (!ok) return `expected ${isInt ? "an integer" : "a number"} in ${range}, got "${v}"`;
  const n = Number(v);
  if (n > max || n < min || (spec.minOpen && n === min)) return `expected a value in ${range}, got ${v}`;
  return "";
}

/** The panel: builds its fields, validates on input, saves every change. */
export class SettingsPanel {
  /** @param {HTMLElement} form */
  constructor(form) {
    this.form = form;
    /** @type {Record<string, string>} */
    this.values = {};
    const stored = loadSettings();
    for (const spec of FIELDS) {
      const s = stored[spec.key];
      this.values[spec.key] = typeof s === "string" ? s : spec.def;
    }
    this.limits = { options: ["none"], contextLength: 1048576, maxAlternatives: 20 };
    /** @type {Record<string, HTMLInputElement | HTMLTextAreaElement | HTMLSelectElement>} */
    this.inputs = {};
    /** @type {Record<string, HTMLElement>} */
    this.errors = {};
    /** @type {Record<string, HTMLElement>} */
    this.hints = {};
    this.build();
  }

  build() {
    this.form.replaceChildren();
    for (const spec of FIELDS) this.form.append(this.field(spec));
    const reset = document.createElement("button");
    reset.type = "button";
    reset.className = "secondary";
    reset.textContent = "Reset to defaults";
    reset.addEventListener("click", () => this.reset());
    this.form.append(reset);
    this.validateAll();
  }

  /**
   * @param {FieldSpec} spec
   * @returns {HTMLElement}
   */
  field(spec) {
    const wrap = document.createElement("div");
    wrap.className = "field";
    const label = document.createElement("label");
    label.htmlFor = `set-${spec.key}`;
    label.textContent = spec.label;
    /** @type {HTMLInputElement | HTMLTextAreaElement | HTMLSelectElement} */
    let input;
    if (spec.kind === "text" || spec.kind === "bias" || spec.kind === "lines") {
      input = document.createElement("textarea");
      input.rows = spec.kind === "text" ? 3 : 2;
    } else if (spec.kind === "select") {
      input = document.createElement("select");
      input.append(...modeOptions([this.values[spec.key]].filter((m) => m !== "")));  // hello's list replaces them
    } else {
      input = document.createElement("input");
      input.inputMode = spec.kind === "float" ? "decimal" : "numeric";
      input.autocomplete = "off";
    }
    input.id = `set-${spec.key}`;
    input.name = spec.key;
    input.dataset.testid = `setting-${spec.key}`;
    input.value = this.values[spec.key];
    input.addEventListener("input", () => this.onInput(spec, input.value));
    const hint = document.createElement("small");
    hint.className = "hint";
    hint.textContent = spec.hint;
    const err = document.createElement("small");
    err.className = "field-error";
    err.id = `err-${spec.key}`;
    err.dataset.testid = `setting-error-${spec.key}`;
    err.setAttribute("aria-live", "polite");
    input.setAttribute("aria-describedby", err.id);
    wrap.append(label, input, hint, err);
    this.inputs[spec.key] = input;
    this.errors[spec.key] = err;
    this.hints[spec.key] = hint;
    return wrap;
  }

  /**
   * @param {FieldSpec} spec
   * @param {string} raw
   */
  onInput(spec, raw) {
    this.values[spec.key] = raw;
    this.check(spec);
    saveSettings(this.values);
  }

  /**
   * Applies the server's `hello`: speculative modes, limits, and the tiles an image gets by default.
   * @param {{speculative: string[], context_length: number, max_alternatives: number,
   *          vision?: {max_tiles?: number} | null}} hello
   */
  setServerLimits(hello) {
    // context_length 0: a remote engine did not say (docs/scale-out.md)
    this.limits = { options: hello.speculative, contextLength: hello.context_length || 1048576,
      maxAlternatives: hello.max_alternatives };
    const sel = /** @type {HTMLSelectElement} */ (this.inputs.speculative);
    sel.replaceChildren(...modeOptions(hello.speculative));
    if (!hello.speculative.includes(this.values.speculative)) this.values.speculative = "";
    sel.value = this.values.speculative;
    const tiles = hello.vision?.max_tiles;
    const spec = /** @type {FieldSpec} */ (FIELDS.find((f) => f.key === "image_max_tiles"));
    this.hints.image_max_tiles.textContent = tiles ? spec.hint.replace("--image-max-tiles", `${tiles}`) : spec.hint;
    this.validateAll();
  }

  reset() {
    this.apply(Object.fromEntries(FIELDS.map((f) => [f.key, f.def])));
  }

  /**
   * Sets some fields (a preset), keeps the others, saves and validates.
   * @param {Record<string, string>} values
   */
  apply(values) {
    for (const spec of FIELDS) {
      if (typeof values[spec.key] !== "string") continue;
      this.values[spec.key] = values[spec.key];
      this.inputs[spec.key].value = this.values[spec.key];
    }
    saveSettings(this.values);
    this.validateAll();
  }

  /**
   * @param {FieldSpec} spec
   * @returns {boolean}
   */
  check(spec) {
    const msg = validate(spec, this.values[spec.key], this.limits);
    this.errors[spec.key].textContent = msg;
    this.inputs[spec.key].setAttribute("aria-invalid", msg ? "true" : "false");
    return msg === "";
  }

  /** @returns {string[]} labels of the invalid fields */
  validateAll() {
    return FIELDS.filter((spec) => !this.check(spec)).map((spec) => spec.label);
  }

  /** Max new tokens; left at its default, at most half the context the server told in `hello`. @returns {number} */
  maxNewTokens() {
    const raw = this.values.max_new_tokens.trim();
    const def = /** @type {FieldSpec} */ (FIELDS.find((f) => f.key === "max_new_tokens")).def;
    if (raw !== def) return Number(raw);
    return Math.min(Number(def), Math.max(1, Math.floor(this.limits.contextLength / 2)));
  }

  /** @returns {number} the most rounds of tool calls one question may take (the page's tool loop, tools.js) */
  toolRounds() {
    const n = Number(this.values.tool_rounds.trim());
    return Number.isInteger(n) && n >= 1 ? n : 8;
  }

  /** @returns {RequestSettings} the validated values; call validateAll() first */
  request() {
    const num = (/** @type {string} */ k) => Number(this.values[k].trim());
    const seed = this.values.seed.trim();
    const tiles = this.values.image_max_tiles.trim();
    return {
      system: this.values.system,
      settings: {
        temperature: num("temperature"), top_k: num("top_k"), top_p: num("top_p"), min_p: num("min_p"),
        typical_p: num("typical_p"), repetition_penalty: num("repetition_penalty"),
        repetition_range: num("repetition_range"), frequency_penalty: num("frequency_penalty"),
        presence_penalty: num("presence_penalty"), token_bias: parseBias(this.values.token_bias),
        seed: seed === "" ? null : Number(seed),
      },
      stop: parseStops(this.values.stop),
      max_new_tokens: this.maxNewTokens(),
      alternatives: num("alternatives"),
      speculative: this.values.speculative === "" ? null : this.values.speculative,
      image_max_tiles: tiles === "" ? null : Number(tiles),
    };
  }
}

/**
 * The speculative-mode choices: the server's default first, then each mode.
 * @param {string[]} modes
 * @returns {HTMLOptionElement[]}
 */
function modeOptions(modes) {
  return [new Option("server default", ""), ...modes.map((m) => new Option(m, m))];
}

/**
 * @param {string} v
 * @returns {string} an error naming the bad line, or ""
 */
function checkBias(v) {
  for (const line of v.split("\n").map((l) => l.trim()).filter((l) => l)) {
    const m = /^(\d+)\s*[:=]\s*([+-]?\d+(?:\.\d+)?)$/.exec(line);
    if (!m) return `expected "token id: bias" per line, got "${line}"`;
    if (Math.abs(Number(m[2])) > 100) return `expected a bias in [-100, 100], got ${m[2]}`;
  }
  return "";
}

/**
 * @param {string} v
 * @returns {Record<string, number>} token id (decimal string) → bias
 */
export function parseBias(v) {
  /** @type {Record<string, number>} */
  const out = {};
  for (const line of v.split("\n")) {
    const m = /^\s*(\d+)\s*[:=]\s*([+-]?\d+(?:\.\d+)?)\s*$/.exec(line);
    if (m) out[String(Number(m[1]))] = Number(m[2]);
  }
  return out;
}

/**
 * @param {string} raw
 * @returns {string}
 */
function checkStops(raw) {
  const stops = parseStops(raw);
  if (stops.length > 16) return `expected at most 16 stop strings, got ${stops.length}`;
  const long = stops.find((x) => x.length > 200);
  return long ? `expected stop strings of at most 200 characters, got one of ${long.length}` : "";
}

/**
 * One stop string per non-empty line; "\\n" and "\\t" stand for a line break and a tab.
 * @param {string} raw
 * @returns {string[]}
 */
export function parseStops(raw) {
  return raw.split("\n").filter((l) => l !== "").map((l) => l.replace(/\\n/g, "\n").replace(/\\t/g, "\t"));
}
