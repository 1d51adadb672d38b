// @ts-check
/**
 * A scored text's colours and numbers, pure functions: rank bins (GLTR's), surprise in bits, the difference in
 * logprob between two models (token by token where their tokenizers agree), and the summary line.
 */

import { UNKNOWN_BG, probColor, textColorOn } from "./heatmap.js";

/**
 * @typedef {import("./heatmap.js").Tok} Tok
 * @typedef {"prob" | "rank" | "surprise" | "diff"} ScoreMode
 * @typedef {{a: [number, number], b: [number, number]}} Segment  tokens a[0]..a[1]-1 of one view, b[..] of the other
 */

/** GLTR's rank bins: top 1 / 10 / 100 / 1000 / beyond; each its viridis colour, yellow (top 1) → purple (beyond). */
export const RANK_BINS = [1, 10, 100, 1000];
export const BIN_LABELS = ["top 1", "top 10", "top 100", "top 1000", "beyond"];
const BIN_T = [1, 0.75, 0.5, 0.25, 0];
/** Surprise (−log2 p) at which the scale saturates. */
export const SURPRISE_MAX_BITS = 12;
/** |Δ logprob| (nats) at which the difference scale saturates. */
export const DIFF_MAX = 4;
/** PuOr, colour-blind safe: orange (this model finds the token less likely) → near white → purple (more likely). */
const ORANGE = [179, 88, 6];
const MIDDLE = [247, 247, 247];
const PURPLE = [84, 39, 136];

/**
 * Index of a rank's bin: 0 for rank 1, 1 for 2–10, 2 for 11–100, 3 for 101–1000, 4 beyond; -1 unknown.
 * @param {number | null} rank
 * @returns {number}
 */
export function rankBin(rank) {
  if (rank === null || !(rank >= 1)) return -1;
  const i = RANK_BINS.findIndex((top) => rank <= top);
  return i < 0 ? RANK_BINS.length : i;
}

/**
 * Surprise in bits, −log2 p; null where p is unknown, Infinity where p is 0.
 * @param {number | null} p
 * @returns {number | null}
 */
export function surpriseBits(p) {
  return p === null ? null : p > 0 ? -Math.log2(p) : Infinity;
}

/**
 * The colour of Δ = ln p(this model) − ln p(other model) on the diverging scale, and a readable text colour on it.
 * @param {number} delta
 * @returns {{bg: string, fg: string}}
 */
export function diffColor(delta) {
  const t = Math.max(-1, Math.min(1, delta / DIFF_MAX));
  const end = t < 0 ? ORANGE : PURPLE;
  const rgb = MIDDLE.map((c, k) => Math.round(c + (end[k] - c) * Math.abs(t)));
  return { bg: `rgb(${rgb[0]}, ${rgb[1]}, ${rgb[2]})`, fg: luminance(rgb) > 0.179 ? "#000" : "#fff" };
}

/**
 * Relative luminance of an sRGB colour (WCAG): black text on it while it is over 0.179, white under (heatmap.js's
 * rule for the viridis scale).
 * @param {number[]} rgb
 * @returns {number}
 */
function luminance(rgb) {
  const lin = rgb.map((c) => (c / 255 <= 0.04045 ? c / 255 / 12.92 : ((c / 255 + 0.055) / 1.055) ** 2.4));
  return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2];
}

/**
 * One token's colours in each mode (background, text); `delta` its Δ logprob against the other model, if any.
 * @param {Tok} tok
 * @param {number | null} delta
 * @returns {Record<ScoreMode, {bg: string, fg: string}>}
 */
export function scoreColors(tok, delta) {
  const grey = { bg: UNKNOWN_BG, fg: "#000" };
  const on = (/** @type {number} */ t) => ({ bg: probColor(t), fg: textColorOn(t) });
  const bin = rankBin(tok.rank);
  const bits = surpriseBits(tok.p);
  return {
    prob: tok.p === null ? grey : on(tok.p),
    rank: bin < 0 ? grey : on(BIN_T[bin]),
    surprise: bits === null ? grey : on(1 - Math.min(bits, SURPRISE_MAX_BITS) / SURPRISE_MAX_BITS),
    diff: delta === null ? grey : diffColor(delta),
  };
}

/**
 * The tokens of two views of one text grouped where both have a token boundary (by characters): a segment of one
 * token on each side is a token-by-token match; a longer one is where the tokenizers disagree.
 * @param {Tok[]} a
 * @param {Tok[]} b
 * @returns {Segment[]}
 */
export function align(a, b) {
  /** @type {Segment[]} */
  const out = [];
  let i = 0, j = 0, ea = 0, eb = 0, sa = 0, sb = 0;
  while (i < a.length || j < b.length) {
    if (j >= b.length || (i < a.length && ea <= eb)) ea += a[i++].text.length;
    else eb += b[j++].text.length;
    if (ea === eb && (i > sa || j > sb) && (i === a.length || a[i].text !== "") && (j === b.length || b[j].text !== "")) {
      out.push({ a: [sa, i], b: [sb, j] });
      sa = i;
      sb = j;
    }
  }
  if (sa < a.length || sb < b.length) out.push({ a: [sa, a.length], b: [sb, b.length] });
  return out;
}

/**
 * Σ ln p over tokens from..to-1; null when one of them has no p (the segment has no difference then).
 * @param {Tok[]} toks
 * @param {[number, number]} range
 * @returns {number | null}
 */
function segmentLogprob(toks, [from, to]) {
  let sum = 0;
  for (let k = from; k < to; k++) {
    const p = toks[k].p;
    if (p === null) return null;
    sum += p > 0 ? Math.log(p) : -Infinity;
  }
  return sum;
}

/**
 * Per token of each view, Δ = its segment's Σ ln p here − there (null where either side has no p), and whether the
 * segment is one token on each side.
 * @param {Tok[]} a
 * @param {Tok[]} b
 * @returns {{a: {delta: number | null, exact: boolean}[], b: {delta: number | null, exact: boolean}[]}}
 */
export function differences(a, b) {
  const da = a.map(() => ({ delta: /** @type {number | null} */ (null), exact: false }));
  const db = b.map(() => ({ delta: /** @type {number | null} */ (null), exact: false }));
  for (const seg of align(a, b)) {
    const la = segmentLogprob(a, seg.a);
    const lb = segmentLogprob(b, seg.b);
    const delta = la === null || lb === null || !Number.isFinite(la - lb) ? null : la - lb;
    const exact = seg.a[1] - seg.a[0] === 1 && seg.b[1] - seg.b[0] === 1;
    for (let k = seg.a[0]; k < seg.a[1]; k++) da[k] = { delta, exact };
    for (let k = seg.b[0]; k < seg.b[1]; k++) db[k] = { delta: delta === null ? null : -delta, exact };
  }
  return { a: da, b: db };
}

/**
 * The summary of a scored text: tokens, mean natural logprob and perplexity exp(−mean) over the tokens with a
 * probability, and the share of tokens ranked in the top 10 (of those with a rank).
 * @param {Tok[]} toks
 * @returns {{tokens: number, mean: number | null, ppl: number | null, top10: number | null}}
 */
export function summary(toks) {
  const lps = /** @type {number[]} */ (toks.map((t) => t.p).filter((p) => p !== null && p > 0)).map(Math.log);
  const ranked = toks.filter((t) => t.rank !== null);
  const mean = lps.length ? lps.reduce((x, y) => x + y, 0) / lps.length : null;
  return {
    tokens: toks.length, mean, ppl: mean === null ? null : Math.exp(-mean),
    top10: ranked.length ? ranked.filter((t) => /** @type {number} */ (t.rank) <= 10).length / ranked.length : null,
  };
}

/**
 * The summary as one line: "19 tokens · mean logprob −2.31 · perplexity 10.1 · top-10 62%".
 * @param {Tok[]} toks
 * @returns {string}
 */
export function summaryLine(toks) {
  const s = summary(toks);
  return [`${s.tokens} token${s.tokens === 1 ? "" : "s"}`,
    s.mean === null ? "" : `mean logprob ${s.mean.toFixed(2)}`,
    s.ppl === null ? "" : `perplexity ${s.ppl < 1000 ? s.ppl.toFixed(2) : s.ppl.toExponential(2)}`,
    s.top10 === null ? "" : `top-10 ${Math.round(100 * s.top10)}%`].filter(Boolean).join(" · ");
}
