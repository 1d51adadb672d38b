// @ts-check
/**
 * For replies whose tokens lack the server's `sampled_p` (stored before it was sent, or null on the wire):
 * the probability a token had after the sampling settings (temperature, top-k, top-p, min-p), estimated from the
 * model's top alternatives as webchat/engine/sampling.py draws: q_i ∝ p_i^(1/T) over the kept candidates, where top-k keeps
 * the k most likely, top-p those with mass strictly above them < top_p · Σ, min-p those with q ≥ min_p · q_max.
 * Exact (penalties and token bias aside) when the kept set and its mass are known from the listed alternatives (top-k
 * within the list, or min-p cutting inside it without top-p); otherwise an estimate that leaves the unseen out.
 */

import { chosenIndex } from "./heatmap.js";

/**
 * @param {import("./heatmap.js").Tok} tok
 * @param {Record<string, unknown> | undefined} s the settings the reply was generated with
 * @returns {{q: number, exact: boolean} | null} null when unknown (no settings or no alternatives)
 */
export function postSampling(tok, s) {
  if (!s || tok.top.length === 0 || tok.picked) return null;
  const t = Number(s.temperature ?? 0.7);
  const topK = Number(s.top_k ?? 40);
  const topP = Number(s.top_p ?? 0.95);
  const minP = Number(s.min_p ?? 0.05);
  const typical = Number(s.typical_p ?? 1);
  const sorted = [...tok.top].sort((a, b) => b.p - a.p);
  const i = chosenIndex(tok, sorted);
  if (t === 0) return { q: i === 0 ? 1 : 0, exact: true };
  const w = sorted.map((a) => a.p ** (1 / t));
  let kept = w.length;
  let exact = false;
  if (topK > 0 && topK <= w.length) {
    kept = topK;
    exact = true;
  }
  const total = w.slice(0, kept).reduce((x, y) => x + y, 0);
  if (topP < 1) {
    let before = 0;
    for (let i = 0; i < kept; i++) {
      if (before >= topP * total) {
        kept = i;
        break;
      }
      before += w[i];
    }
  }
  if (minP > 0) {
    const below = w.findIndex((x, i) => i < kept && x < minP * w[0]);
    if (below >= 0) {
      kept = below;
      exact = exact || topP >= 1;  // top-p needs the whole mass, which only a top-k inside the list gives
    }
  }
  if (typical < 1) exact = false;
  if (i < 0 || i >= kept) return { q: 0, exact };
  const z = w.slice(0, kept).reduce((x, y) => x + y, 0);
  return { q: w[i] / z, exact };
}
