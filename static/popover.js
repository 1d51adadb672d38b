// @ts-check
/** Opens the token popover on hover, keyboard focus or tap; arrow keys move between the tokens of a reply. */

import { tokenData } from "./reply.js";
import { fillPopover, placePopover } from "./heatmap.js";

/** Wires the popover to the token spans inside `list` (event delegation, so streamed tokens need nothing more). */
export class TokenPopover {
  /**
   * @param {HTMLElement} list the messages container
   * @param {HTMLElement} pop the popover element
   * @param {() => boolean} enabled whether the heatmap is on
   */
  constructor(list, pop, enabled) {
    this.list = list;
    this.pop = pop;
    this.enabled = enabled;
    /** @type {HTMLElement | null} */
    this.anchor = null;
    // hover is for mice only: a touch pointer "leaves" right after the tap that opened the popover
    list.addEventListener("pointerover", (e) => { if (e.pointerType === "mouse") this.onPoint(e); });
    list.addEventListener("pointerleave", (e) => { if (e.pointerType === "mouse") this.hide(); });
    list.addEventListener("focusin", (e) => this.onPoint(e));
    list.addEventListener("focusout", (e) => {
      if (!(e.relatedTarget instanceof HTMLElement && e.relatedTarget.classList.contains("tok"))) this.hide();
    });
    list.addEventListener("click", (e) => this.onPoint(e));
    list.addEventListener("keydown", (e) => this.onKey(e));
    document.addEventListener("click", (e) => {
      if (!(e.target instanceof Node && (list.contains(e.target) || pop.contains(e.target)))) this.hide();
    });
    list.addEventListener("scroll", () => this.follow(), { passive: true });
    window.addEventListener("resize", () => this.hide());
  }

  /** @param {Event} e */
  onPoint(e) {
    const t = e.target instanceof Element ? e.target.closest(".tok") : null;
    if (!(t instanceof HTMLElement) || !this.enabled()) {
      if (e.type === "pointerover" && this.anchor && document.activeElement !== this.anchor) this.hide();
      return;
    }
    this.show(t);
  }

  /** @param {HTMLElement} span */
  show(span) {
    const tok = tokenData.get(span);
    if (!tok) return;
    this.anchor?.classList.remove("tok-active");
    this.anchor = span;
    span.classList.add("tok-active");
    fillPopover(this.pop, tok);
    this.pop.hidden = false;
    placePopover(this.pop, span);
  }

  /** Keeps the popover beside its token while the list scrolls; hides it once the token leaves the list's view. */
  follow() {
    if (!this.anchor) return;
    const r = this.anchor.getBoundingClientRect();
    const box = this.list.getBoundingClientRect();
    if (r.bottom < box.top || r.top > box.bottom) this.hide();
    else placePopover(this.pop, this.anchor);
  }

  hide() {
    this.anchor?.classList.remove("tok-active");
    this.anchor = null;
    this.pop.hidden = true;
  }

  /** @param {KeyboardEvent} e */
  onKey(e) {
    const t = e.target instanceof HTMLElement && e.target.classList.contains("tok") ? e.target : null;
    if (!t) return;
    const body = t.closest(".msg-body");
    if (!body) return;
    const toks = /** @type {HTMLElement[]} */ ([...body.querySelectorAll(".tok")]);
    const i = toks.indexOf(t);
    const step = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 }[e.key];
    let j = -1;
    if (step !== undefined) j = Math.min(toks.length - 1, Math.max(0, i + step));
    else if (e.key === "Home") j = 0;
    else if (e.key === "End") j = toks.length - 1;
    if (j < 0) return;
    e.preventDefault();
    t.tabIndex = -1;
    toks[j].tabIndex = 0;
    toks[j].focus();
  }
}
