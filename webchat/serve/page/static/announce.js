// @ts-check
/**
 * Announces a streaming reply to screen readers through a polite live region, a sentence or a line at a time (never
 * per token), at most once every ANNOUNCE_MS; the rest when the reply ends.
 */

export const ANNOUNCE_MS = 1500;

export class Announcer {
  /** @param {HTMLElement} region an element with aria-live="polite" */
  constructor(region) {
    this.region = region;
    this.buffer = "";
    this.last = 0;
    this.count = 0;
  }

  /**
   * @param {string} text new reply text
   * @param {boolean} final the reply ended: say what is left, then that it ended
   */
  add(text, final) {
    this.buffer += text;
    if (final) {
      this.say(`${this.buffer.trim()} (reply finished)`.trim());
      this.buffer = "";
      return;
    }
    const now = performance.now();
    if (now - this.last < ANNOUNCE_MS) return;
    const end = lastSentenceEnd(this.buffer);
    if (end <= 0) return;
    this.say(this.buffer.slice(0, end).trim());
    this.buffer = this.buffer.slice(end);
  }

  /** @param {string} text */
  say(text) {
    if (text === "") return;
    this.region.textContent = text;
    this.last = performance.now();
    this.count += 1;
    this.region.dataset.count = String(this.count);
  }
}

/**
 * Offset just after the last sentence end (. ! ? followed by space) or line break, or 0.
 * @param {string} s
 * @returns {number}
 */
export function lastSentenceEnd(s) {
  let best = 0;
  for (const m of s.matchAll(/[.!?](\s)|\n/g)) best = (m.index ?? 0) + m[0].length;
  return best;
}
