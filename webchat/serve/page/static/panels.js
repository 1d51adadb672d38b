// @ts-check
/** The heatmap controls (toggle, mode, legend) and the settings drawer's opening and closing. */

import { renderLegend } from "./heatmap.js";
import { loadView, saveView } from "./store.js";

/** The heatmap toggle and mode select: classes on the message list pick the colours; the choice is kept. */
export class HeatmapControls {
  /**
   * @param {HTMLInputElement} toggle
   * @param {HTMLSelectElement} mode
   * @param {HTMLElement} legend
   * @param {HTMLElement} messages
   * @param {(on: boolean) => void} onChange
   */
  constructor(toggle, mode, legend, messages, onChange) {
    this.toggle = toggle;
    this.mode = mode;
    this.legend = legend;
    this.messages = messages;
    this.onChange = onChange;
    const saved = loadView();
    toggle.checked = saved.heatmap;
    mode.value = saved.mode;
    toggle.addEventListener("change", () => this.apply());
    mode.addEventListener("change", () => this.apply());
  }

  /** @returns {boolean} */
  get on() {
    return this.toggle.checked;
  }

  apply() {
    const on = this.toggle.checked;
    const mode = /** @type {import("./heatmap.js").HeatMode} */ (this.mode.value);
    this.messages.classList.toggle("heat", on);
    this.messages.dataset.heat = mode;
    this.mode.disabled = !on;
    (this.legend.parentElement ?? this.legend).hidden = !on;
    renderLegend(this.legend, mode);
    saveView({ heatmap: on, mode });
    this.onChange(on);
  }
}

/** A side panel with an opening button (aria-expanded kept in step) and a close button. */
export class Drawer {
  /**
   * @param {HTMLElement} panel
   * @param {HTMLElement} opener
   * @param {HTMLElement} closer
   */
  constructor(panel, opener, closer) {
    this.panel = panel;
    this.opener = opener;
    opener.addEventListener("click", () => this.open(!this.isOpen));
    closer.addEventListener("click", () => this.close());
  }

  /** @returns {boolean} */
  get isOpen() {
    return !this.panel.hidden;
  }

  /** @param {boolean} open */
  open(open) {
    this.panel.hidden = !open;
    this.opener.setAttribute("aria-expanded", String(open));
    if (open) /** @type {HTMLElement | null} */ (this.panel.querySelector("[aria-invalid=true], input, textarea"))?.focus();
  }

  /** Closes it and gives the focus back to the opening button. */
  close() {
    this.open(false);
    this.opener.focus();
  }
}
