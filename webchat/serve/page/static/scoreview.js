// @ts-check
/**
 * A score panel: one model's view of a text as coloured token spans, or two models side by side, with the colour
 * mode (probability, GLTR's rank bins, surprise, the difference between the two), a legend and each view's summary.
 * Token spans are `.tok` with the reply spans' data (reply.js tokenData), so the popover works on them as on replies.
 */

import { probColor, textColorOn } from "./heatmap.js";
import { tokenData } from "./reply.js";
import { BIN_LABELS, DIFF_MAX, SURPRISE_MAX_BITS, diffColor, differences, scoreColors, summaryLine } from "./scorecolor.js";

/**
 * @typedef {import("./heatmap.js").Tok} Tok
 * @typedef {import("./scorecolor.js").ScoreMode} ScoreMode
 * @typedef {{model: string, tokens: Tok[], at: number}} Score  one model's view of a text, kept with the chat
 * @typedef {{mode: ScoreMode, others: string[], onMode: (m: ScoreMode) => void, onWith: ((model: string) => void) | null,
 *            onHide: (() => void) | null}} PanelOptions
 *   `others`: the models "Score with…" offers; `onWith` null: no such choice (one model on the server).
 */

const MODE_NAMES = /** @type {Record<ScoreMode, string>} */ ({
  prob: "probability", rank: "rank bins (GLTR)", surprise: "surprise (bits)", diff: "difference (Δ logprob)",
});
const KEY = "webchat.score.v1";

/** @returns {ScoreMode} the colour mode last chosen */
export function savedMode() {
  const v = localStorage.getItem(KEY);
  return v === "rank" || v === "surprise" || v === "diff" ? v : "prob";
}

/** @param {ScoreMode} mode */
export function saveMode(mode) {
  try {
    localStorage.setItem(KEY, mode);
  } catch { /* the quota: the mode is not kept */ }
}

/**
 * @param {string} tag
 * @param {string} cls
 * @param {string} [text]
 * @returns {HTMLElement}
 */
function el(tag, cls, text) {
  const e = document.createElement(tag);
  e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

/**
 * The score panel of one text: `scores` holds one view, or two shown side by side.
 * @param {Score[]} scores
 * @param {PanelOptions} opts
 * @returns {HTMLElement}
 */
export function scorePanel(scores, opts) {
  const panel = el("section", "score");
  panel.dataset.testid = "score-panel";
  panel.setAttribute("aria-label", `How ${scores.map((s) => s.model).join(" and ")} read this text`);
  const mode = scores.length < 2 && opts.mode === "diff" ? "prob" : opts.mode;
  panel.dataset.mode = mode;
  const bar = el("div", "score-bar");
  const select = /** @type {HTMLSelectElement} */ (el("select", "score-mode"));
  select.dataset.testid = "score-mode";
  select.setAttribute("aria-label", "Colour the scored tokens by");
  for (const m of /** @type {ScoreMode[]} */ (["prob", "rank", "surprise", "diff"])) {
    if (m === "diff" && scores.length < 2) continue;
    const opt = document.createElement("option");
    opt.value = m;
    opt.textContent = `by ${MODE_NAMES[m]}`;
    select.append(opt);
  }
  select.value = mode;
  select.addEventListener("change", () => opts.onMode(/** @type {ScoreMode} */ (select.value)));
  bar.append(select);
  if (opts.onWith && opts.others.length) bar.append(withSelect(opts.others, opts.onWith));
  if (opts.onHide) {
    const hide = /** @type {HTMLButtonElement} */ (el("button", "link", "Hide"));
    hide.type = "button";
    hide.dataset.testid = "score-hide";
    hide.addEventListener("click", opts.onHide);
    bar.append(hide);
  }
  const legend = el("div", "score-legend");
  legend.dataset.testid = "score-legend";
  fillLegend(legend, mode);
  const cols = el("div", scores.length > 1 ? "score-cols two" : "score-cols");
  const diffs = scores.length > 1 ? differences(scores[0].tokens, scores[1].tokens) : null;
  scores.slice(0, 2).forEach((s, i) => cols.append(column(s, diffs ? (i === 0 ? diffs.a : diffs.b) : null)));
  panel.append(bar, legend, cols);
  return panel;
}

/**
 * "Score with…": the other models; picking one scores the text with it too.
 * @param {string[]} others
 * @param {(model: string) => void} onWith
 * @returns {HTMLSelectElement}
 */
function withSelect(others, onWith) {
  const sel = /** @type {HTMLSelectElement} */ (el("select", "score-with"));
  sel.dataset.testid = "score-with";
  sel.setAttribute("aria-label", "Score the same text with another model, side by side");
  const head = document.createElement("option");
  head.value = "";
  head.textContent = "Score with…";
  sel.append(head, ...others.map((m) => {
    const opt = document.createElement("option");
    opt.value = m;
    opt.textContent = m;
    return opt;
  }));
  sel.addEventListener("change", () => { if (sel.value) onWith(sel.value); });
  return sel;
}

/**
 * One model's view: its name and summary, then the text as token spans.
 * @param {Score} score
 * @param {{delta: number | null, exact: boolean}[] | null} diffs
 * @returns {HTMLElement}
 */
function column(score, diffs) {
  const col = el("div", "score-col");
  col.dataset.testid = "score-col";
  col.dataset.model = score.model;
  const head = el("div", "score-head");
  head.append(el("strong", "score-model", score.model));
  const line = el("span", "score-summary", summaryLine(score.tokens));
  line.dataset.testid = "score-summary";
  head.append(line);
  const text = el("div", "score-text");
  text.dataset.testid = "score-text";
  score.tokens.forEach((tok, i) => text.append(scoreSpan(tok, diffs ? diffs[i] : null, i === 0)));
  col.append(head, text);
  return col;
}

/**
 * @param {Tok} tok
 * @param {{delta: number | null, exact: boolean} | null} diff
 * @param {boolean} first
 * @returns {HTMLSpanElement}
 */
function scoreSpan(tok, diff, first) {
  const span = document.createElement("span");
  span.className = "tok";
  span.dataset.testid = "score-token";
  span.textContent = tok.text;
  span.dataset.p = String(tok.p);
  span.dataset.rank = String(tok.rank);
  span.tabIndex = first ? 0 : -1;
  const colors = scoreColors(tok, diff ? diff.delta : null);
  for (const [mode, c] of Object.entries(colors)) {
    span.style.setProperty(`--bg-s${mode}`, c.bg);
    span.style.setProperty(`--fg-s${mode}`, c.fg);
  }
  if (diff) {
    span.dataset.delta = String(diff.delta);
    if (!diff.exact) span.dataset.merged = "true";  // the two tokenizers split this stretch differently
  }
  tokenData.set(span, tok);
  return span;
}

/**
 * The legend of a mode: bins with their colours, or a gradient with its two ends.
 * @param {HTMLElement} legend
 * @param {ScoreMode} mode
 */
export function fillLegend(legend, mode) {
  legend.replaceChildren();
  if (mode === "rank") {
    BIN_LABELS.forEach((label, i) => {
      const chip = el("span", "score-chip", label);
      const t = [1, 0.75, 0.5, 0.25, 0][i];
      chip.style.background = probColor(t);
      chip.style.color = textColorOn(t);
      legend.append(chip);
    });
    legend.title = "Rank of each token among all the model's candidates (GLTR's bins)";
    return;
  }
  const [low, high, stops, note] = mode === "diff"
    ? [`−${DIFF_MAX} (less likely here)`, `+${DIFF_MAX} (likelier here)`,
      [-1, -0.5, 0, 0.5, 1].map((t) => diffColor(t * DIFF_MAX).bg), "ln p here − ln p in the other view, per token where "
      + "the tokenizers agree (dotted: a stretch the two split differently)"]
    : mode === "surprise" ? [`≥ ${SURPRISE_MAX_BITS} bits`, "0 bits", [0, 0.25, 0.5, 0.75, 1].map(probColor),
      "surprise, −log2 p"]
      : ["0%", "100%", [0, 0.25, 0.5, 0.75, 1].map(probColor), "the model's probability of each token"];
  const bar = el("span", "legend-bar");
  bar.style.backgroundImage = `linear-gradient(to right, ${stops.join(", ")})`;
  legend.append(el("span", "", low), bar, el("span", "", high));
  legend.title = `Colour: ${note}.`;
}
