// @ts-check
/** Named presets of the sampling settings: a few built in, the user's own saved in localStorage. */

import { loadPresets, savePresets } from "./store.js";

/** Fields a preset sets (the sampling ones; the system prompt, length and seed stay as they are). */
export const PRESET_KEYS = ["temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
  "repetition_range", "frequency_penalty", "presence_penalty"];

/** @type {Record<string, Record<string, string>>} */
export const BUILT_IN = {
  Balanced: { temperature: "0.7", top_k: "40", top_p: "0.95", min_p: "0.05", typical_p: "1.0",
    repetition_penalty: "1.0", repetition_range: "0", frequency_penalty: "0", presence_penalty: "0" },
  Precise: { temperature: "0", top_k: "40", top_p: "0.95", min_p: "0.05", typical_p: "1.0",
    repetition_penalty: "1.0", repetition_range: "0", frequency_penalty: "0", presence_penalty: "0" },
  Creative: { temperature: "1.1", top_k: "0", top_p: "0.98", min_p: "0.02", typical_p: "1.0",
    repetition_penalty: "1.05", repetition_range: "256", frequency_penalty: "0.2", presence_penalty: "0.2" },
};

/** The preset row at the top of the settings form. */
export class Presets {
  /**
   * @param {HTMLElement} form
   * @param {import("./settings.js").SettingsPanel} panel
   */
  constructor(form, panel) {
    this.panel = panel;
    this.user = loadPresets();
    const wrap = document.createElement("div");
    wrap.className = "field presets";
    const label = document.createElement("label");
    label.htmlFor = "set-preset";
    label.textContent = "Preset";
    this.select = document.createElement("select");
    this.select.id = "set-preset";
    this.select.dataset.testid = "preset";
    this.select.addEventListener("change", () => this.choose(this.select.value));
    const row = document.createElement("div");
    row.className = "preset-row";
    this.name = document.createElement("input");
    this.name.type = "text";
    this.name.placeholder = "name";
    this.name.dataset.testid = "preset-name";
    this.name.setAttribute("aria-label", "Name for a new preset");
    const save = button("Save", "preset-save", () => this.save());
    this.del = button("Delete", "preset-delete", () => this.remove());
    row.append(this.name, save, this.del);
    const hint = document.createElement("small");
    hint.className = "hint";
    hint.textContent = "Sets the sampling fields below; save the current ones under a name of your own.";
    wrap.append(label, this.select, row, hint);
    form.prepend(wrap);
    this.fill("");
  }

  /** @param {string} chosen */
  fill(chosen) {
    const opts = [new Option("choose…", "")];
    for (const n of Object.keys(BUILT_IN)) opts.push(new Option(n, `b:${n}`));
    for (const n of Object.keys(this.user).sort()) opts.push(new Option(`${n} (yours)`, `u:${n}`));
    this.select.replaceChildren(...opts);
    this.select.value = chosen;
    this.del.disabled = !chosen.startsWith("u:");
  }

  /** @param {string} value */
  choose(value) {
    const preset = value.startsWith("b:") ? BUILT_IN[value.slice(2)] : this.user[value.slice(2)];
    if (preset) this.panel.apply(preset);
    this.del.disabled = !value.startsWith("u:");
  }

  save() {
    const name = this.name.value.trim();
    if (name === "") {
      this.name.focus();
      return;
    }
    this.user[name] = Object.fromEntries(PRESET_KEYS.map((k) => [k, this.panel.values[k]]));
    savePresets(this.user);
    this.name.value = "";
    this.fill(`u:${name}`);
  }

  remove() {
    const v = this.select.value;
    if (!v.startsWith("u:")) return;
    delete this.user[v.slice(2)];
    savePresets(this.user);
    this.fill("");
  }
}

/**
 * @param {string} label
 * @param {string} testid
 * @param {() => void} onClick
 * @returns {HTMLButtonElement}
 */
function button(label, testid, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "secondary";
  b.textContent = label;
  b.dataset.testid = testid;
  b.addEventListener("click", onClick);
  return b;
}
