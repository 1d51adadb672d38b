// @ts-check
/**
 * Opens the token popover on hover, keyboard focus or tap; the focused token is described by it (aria-describedby).
 * Arrow keys move between a reply's tokens, Enter moves into the alternatives (each branches the reply), Escape back,
 * N jumps to the next low-confidence token.
 */

import { tokenData } from "./reply.js";
import { fillPopover, placePopover } from "./heatmap.js";
import { postSampling } from "./postsample.js";

/** A token below this probability counts as low-confidence for "next low-confidence token". */
export const LOW_P = 0.3;

/**
 * @typedef {{enabled: (span: HTMLElement) => boolean, onPick: (span: HTMLElement, alt: import("./heatmap.js").Alt) => void,
 *            settingsOf: (span: HTMLElement) => Record<string, unknown> | undefined,
 *            canPick: (span: HTMLElement) => boolean}} PopoverHooks
 */

/** Wires the popover to the token spans inside `list` (event delegation, so streamed tokens need nothing more). */
export class TokenPopover {
  /**
   * @param {HTMLElement} list the messages container
   * @param {HTMLElement} pop the popover element
   * @param {PopoverHooks} hooks
   */
  constructor(list, pop, hooks) {
    this.list = list;
    this.pop = pop;
    this.hooks = hooks;
    /** @type {HTMLElement | null} */
    this.anchor = null;
    // hover is for mice only: a touch pointer "leaves" right after the tap that opened the popover
    list.addEventListener("pointerover", (e) => { if (e.pointerType === "mouse") this.onPoint(e); });
    /** @type {number | undefined} */
    this.hideTimer = undefined;
    // leaving the list hides it after a moment, so the pointer can travel to the alternatives
    const later = (/** @type {PointerEvent} */ e) => {
      if (e.pointerType !== "mouse") return;
      window.clearTimeout(this.hideTimer);
      this.hideTimer = window.setTimeout(() => {
        if (!this.pop.contains(document.activeElement) && document.activeElement !== this.anchor) this.hide();
      }, 300);
    };
    list.addEventListener("pointerleave", later);
    pop.addEventListener("pointerleave", later);
    pop.addEventListener("pointerenter", () => window.clearTimeout(this.hideTimer));
    list.addEventListener("pointerenter", () => window.clearTimeout(this.hideTimer));
    list.addEventListener("focusin", (e) => this.onPoint(e));
    list.addEventListener("focusout", (e) => {
      const to = e.relatedTarget;
      if (!(to instanceof Node && (pop.contains(to) || (to instanceof HTMLElement && to.classList.contains("tok"))))) this.hide();
    });
    pop.addEventListener("focusout", (e) => {
      const to = e.relatedTarget;
      if (!(to instanceof Node && (pop.contains(to) || to === this.anchor))) this.hide();
    });
    list.addEventListener("click", (e) => this.onPoint(e));
    list.addEventListener("keydown", (e) => this.onKey(e));
    pop.addEventListener("keydown", (e) => {
      if (e.key === "Escape" && this.anchor) {
        e.stopPropagation();
        this.anchor.focus();
      }
    });
    document.addEventListener("click", (e) => {
      if (!(e.target instanceof Node && (list.contains(e.target) || pop.contains(e.target)))) this.hide();
    });
    list.addEventListener("scroll", () => this.follow(), { passive: true });
    window.addEventListener("resize", () => this.hide());
  }

  /** @param {Event} e */
  onPoint(e) {
    const t = e.target instanceof Element ? e.target.closest(".tok") : null;
    if (!(t instanceof HTMLElement) || !this.hooks.enabled(t)) {
      if (e.type === "pointerover" && this.anchor && !this.pop.contains(document.activeElement)
          && document.activeElement !== this.anchor && !(e.target instanceof Node && this.pop.contains(e.target))) {
        this.hide();
      }
      return;
    }
    this.show(t);
  }

  /** @param {HTMLElement} span */
  show(span) {
    const tok = tokenData.get(span);
    if (!tok) return;
    if (this.anchor !== span) this.release();
    this.anchor = span;
    span.classList.add("tok-active");
    span.setAttribute("aria-describedby", this.pop.id);
    const pick = this.hooks.canPick(span) ? (/** @type {import("./heatmap.js").Alt} */ alt) => {
      this.hide();
      this.hooks.onPick(span, alt);
    } : null;
    const post = tok.sp !== undefined ? { q: tok.sp, exact: true } : postSampling(tok, this.hooks.settingsOf(span));
    fillPopover(this.pop, tok, post, pick);
    this.pop.hidden = false;
    placePopover(this.pop, span);
  }

  release() {
    this.anchor?.classList.remove("tok-active");
    this.anchor?.removeAttribute("aria-describedby");
  }

  /** Keeps the popover beside its token while the list scrolls; hides it once the token leaves the list's view. */
  follow() {
    if (!this.anchor) return;
    const r = this.anchor.getBoundingClientRect();
    const box = this.list.getBoundingClientRect();
    if (r.bottom < box.top || r.top > box.bottom || !this.anchor.isConnected) this.hide();
    else placePopover(this.pop, this.anchor);
  }

  hide() {
    this.release();
    this.anchor = null;
    this.pop.hidden = true;
  }

  /** @param {KeyboardEvent} e */
  onKey(e) {
    const t = e.target instanceof HTMLElement && e.target.classList.contains("tok") ? e.target : null;
    if (!t) return;
    if (e.key === "Enter" || e.key === " ") {
      const first = /** @type {HTMLElement | null} */ (this.pop.querySelector("button"));
      if (!this.pop.hidden && first) {
        e.preventDefault();
        first.focus();
      }
      return;
    }
    if (e.key === "n" || e.key === "N") {
      e.preventDefault();
      nextLowConfidence(this.list, t, e.key === "N" ? -1 : 1);
      return;
    }
    const body = t.closest(".msg-body, .score-text");
    if (!body) return;
    const toks = /** @type {HTMLElement[]} */ ([...body.querySelectorAll(".tok:not(.tok-cont)")]);
    const i = toks.indexOf(t);
    const step = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 }[e.key];
    let j = -1;
    if (step !== undefined) j = Math.min(toks.length - 1, Math.max(0, i + step));
    else if (e.key === "Home") j = 0;
    else if (e.key === "End") j = toks.length - 1;
    if (j < 0) return;
    e.preventDefault();
    moveFocus(t, toks[j]);
  }
}

/**
 * @param {HTMLElement | null} from
 * @param {HTMLElement} to
 */
function moveFocus(from, to) {
  if (from) from.tabIndex = -1;
  to.tabIndex = 0;
  to.focus();
  to.scrollIntoView({ block: "nearest" });
}

/**
 * Focuses the next (dir 1) or previous (dir -1) token with p < LOW_P after `from` (or from the start), wrapping.
 * @param {HTMLElement} list
 * @param {HTMLElement | null} from
 * @param {number} dir
 * @returns {HTMLElement | null} the token focused, or null when there is none
 */
export function nextLowConfidence(list, from, dir) {
  const toks = /** @type {HTMLElement[]} */ ([...list.querySelectorAll(".tok:not(.tok-cont)")]);
  const low = toks.filter((t) => Number(t.dataset.p) < LOW_P);
  if (low.length === 0) return null;
  const at = from ? toks.indexOf(from) : -1;
  const pick = dir > 0 ? low.find((t) => toks.indexOf(t) > at) ?? low[0]
    : [...low].reverse().find((t) => toks.indexOf(t) < at) ?? low[low.length - 1];
  const current = /** @type {HTMLElement | null} */ (pick.closest(".msg-body")?.querySelector(".tok[tabindex='0']") ?? null);
  moveFocus(current, pick);
  return pick;
}
