// @ts-check
/** Per-token heatmap: colour scales (pure functions), the legend and the alternatives popover. */

/**
 * @typedef {{id?: number, text: string, p: number}} Alt
 * @typedef {{id?: number, text: string, p: number | null, rank: number | null, top: Alt[], parts?: number,
 *            picked?: boolean, sp?: number, forbidden?: number[], part?: "thinking", raw?: string}} Tok
 *   `p` null: the engine gave no probability; `rank` null: outside the top-k the engine returned, or unknown
 *   (a remote engine, docs/scale-out.md). Such a token is painted grey, not as a zero.
 *   One displayed token. `parts` > 1 when a character split over several byte tokens was merged into this one span:
 *   then `p` is the joint probability (product of the parts), `rank` the worst rank and `top` the first part's.
 *   `picked`: the user chose this token from the alternatives (a branch), the model did not draw it.
 *   `forbidden`: the ids of `top` the reply's format did not allow here (their p is still the model's).
 *   `sp`: its probability after the sampling settings, as the server reported it (wire `sampled_p`).
 *   `part`: "thinking" for a token of the reply's thinking (absent: the answer); `raw`: the text it wrote where the
 *   split took a marker out (`<think>`, whitespace after one): its `text` is then what shows (thinking.js).
 * @typedef {"prob" | "rank" | "entropy"} HeatMode
 */

/** Viridis (matplotlib), 10 stops at i/9: dark purple (0) → yellow (1). Colour-blind safe, monotone in lightness. */
const VIRIDIS = [
  [68, 1, 84], [72, 40, 120], [62, 73, 137], [49, 104, 142], [38, 130, 142],
  [31, 158, 137], [53, 183, 121], [110, 206, 88], [181, 222, 43], [253, 231, 37],
];

/** A token whose value is unknown on this engine (p or rank not returned): light grey, never a colour of the scale. */
export const UNKNOWN_BG = "rgb(204, 204, 204)";
/** Entropy (bits) at which the entropy scale saturates. */
export const ENTROPY_MAX_BITS = 4;
/** Rank at which the rank scale saturates (log scale: 1 → best, RANK_MAX → worst). */
export const RANK_MAX = 1000;

/**
 * Viridis colour of t in [0, 1] (clamped), linear interpolation between the stops.
 * @param {number} t
 * @returns {number[]} [r, g, b]
 */
export function viridis(t) {
  const x = Math.min(1, Math.max(0, Number.isFinite(t) ? t : 0)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const f = x - i;
  return VIRIDIS[i].map((c, k) => Math.round(c + (VIRIDIS[i + 1][k] - c) * f));
}

/** @param {number[]} rgb @returns {string} */
const css = (rgb) => `rgb(${rgb[0]}, ${rgb[1]}, ${rgb[2]})`;

/**
 * Background colour for a token of probability p: viridis(p), low = dark purple, high = yellow.
 * @param {number} p
 * @returns {string}
 */
export function probColor(p) {
  return css(viridis(p));
}

/**
 * Readable text colour on top of viridis(t): relative luminance Y = 0.2126 R + 0.7152 G + 0.0722 B (sRGB, linearised);
 * black while (Y + 0.05) / 0.05 ≥ 1.05 / (Y + 0.05), i.e. Y > 0.179, else white.
 * @param {number} t
 * @returns {string}
 */
export function textColorOn(t) {
  const lin = viridis(t).map((c) => {
    const s = c / 255;
    return s <= 0.04045 ? s / 12.92 : ((s + 0.055) / 1.055) ** 2.4;
  });
  const y = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2];
  return y > 0.179 ? "#000" : "#fff";  // the crossing point of the two contrasts: both ≥ 4.58:1 (WCAG AA)
}

/**
 * Rank on the colour scale: t = 1 - log10(rank) / log10(RANK_MAX); rank 1 → 1 (yellow), ≥ RANK_MAX → 0.
 * @param {number} rank
 * @returns {number}
 */
export function rankScale(rank) {
  if (!(rank >= 1)) return 0;
  return Math.max(0, 1 - Math.log10(rank) / Math.log10(RANK_MAX));
}

/**
 * A lower bound on the entropy H = -Σ p log2 p (bits) of the distribution, known only through its top alternatives.
 * Every unseen token has p_j ≤ p_min (the smallest listed), so Σ_unseen -p_j log2 p_j ≥ r · -log2 p_min
 * with r = 1 - Σ_listed p the unseen mass.
 * @param {Alt[]} top
 * @returns {number}
 */
export function entropyLowerBound(top) {
  let h = 0;
  let mass = 0;
  let pMin = 1;
  for (const a of top) {
    if (a.p > 0) {
      h -= a.p * Math.log2(a.p);
      mass += a.p;
      pMin = Math.min(pMin, a.p);
    }
  }
  const rest = Math.max(0, 1 - mass);
  if (rest > 1e-9 && pMin < 1) h += rest * -Math.log2(pMin);
  return h;
}

/**
 * Position on the colour scale of a token in a mode; 1 = confident (yellow), 0 = surprising (purple).
 * @param {Tok} tok
 * @param {HeatMode} mode
 * @returns {number | null} null: unknown on this engine
 */
export function heatValue(tok, mode) {
  if (mode === "rank") return tok.rank === null && tok.top.length === 0 ? null : rankScale(tok.rank ?? 0);
  if (mode === "entropy") return tok.top.length ? 1 - Math.min(1, entropyLowerBound(tok.top) / ENTROPY_MAX_BITS) : null;
  return tok.p;
}

/**
 * Index in `sorted` (the token's alternatives by p, descending) of the one the model drew, or -1: by id; without ids
 * (a remote engine's -1) by its rank, which the server matched by bytes; else by text.
 * @param {Tok} tok
 * @param {Alt[]} sorted
 * @returns {number}
 */
export function chosenIndex(tok, sorted) {
  if (tok.id !== undefined && tok.id >= 0) return sorted.findIndex((a) => a.id === tok.id);
  if (tok.rank !== null && !(tok.parts && tok.parts > 1) && tok.rank <= sorted.length) return tok.rank - 1;
  return sorted.findIndex((a) => a.text === tok.text);
}

/**
 * Sets a token span's colours for every mode as CSS custom properties; the stylesheet picks the active one.
 * @param {HTMLElement} span
 * @param {Tok} tok
 */
export function paintToken(span, tok) {
  for (const mode of /** @type {HeatMode[]} */ (["prob", "rank", "entropy"])) {
    const t = heatValue(tok, mode);
    span.style.setProperty(`--bg-${mode}`, t === null ? UNKNOWN_BG : probColor(t));
    span.style.setProperty(`--fg-${mode}`, t === null ? "#000" : textColorOn(t));
    if (t === null) span.dataset[`unknown${mode[0].toUpperCase()}${mode.slice(1)}`] = "true";
  }
}

/** @type {Record<HeatMode, {label: string, low: string, high: string, note: string}>} */
const LEGENDS = {
  prob: { label: "Probability", low: "0%", high: "100%", note: "the model's probability of each token" },
  rank: { label: "Rank", low: `≥ ${RANK_MAX}`, high: "1", note: "rank of each token among all candidates (log scale)" },
  entropy: {
    label: "Entropy", low: `≥ ${ENTROPY_MAX_BITS} bits`, high: "0 bits",
    note: "entropy of the next-token distribution; a lower-bound estimate from the top alternatives",
  },
};

/**
 * Fills the legend element: a gradient bar with the scale's two ends.
 * @param {HTMLElement} el
 * @param {HeatMode} mode
 */
export function renderLegend(el, mode) {
  const spec = LEGENDS[mode];
  el.replaceChildren();
  const name = document.createElement("span");
  name.className = "legend-name";
  name.textContent = spec.label;
  const low = document.createElement("span");
  low.textContent = spec.low;
  const bar = document.createElement("span");
  bar.className = "legend-bar";
  const stops = [0, 0.25, 0.5, 0.75, 1].map((t) => probColor(t)).join(", ");
  bar.style.backgroundImage = `linear-gradient(to right, ${stops})`;
  const high = document.createElement("span");
  high.textContent = spec.high;
  el.append(name, low, bar, high);
  el.title = `Colour: ${spec.note}. Hover, focus or tap a token for its alternatives.`;
}

/**
 * Shows whitespace in a token: space → ␣, newline → ↵, tab → ⇥; the empty string → ∅.
 * @param {string} text
 * @returns {string}
 */
export function visibleToken(text) {
  if (text === "") return "∅";
  return text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥");
}

/**
 * Percentage with one decimal, or "<0.1" for tiny values.
 * @param {number | null} p
 * @returns {string}
 */
export function percent(p) {
  if (p === null) return "p unknown";
  const v = Math.max(0, Math.min(100, p * 100));
  return v > 0 && v < 0.1 ? "<0.1%" : `${v.toFixed(1)}%`;
}

/**
 * Fills the popover with one token's probability (the model's, and after the sampling settings when known), rank,
 * entropy bound and its alternatives sorted by p descending; with `onPick`, each alternative is a button that
 * branches the reply from this token with that alternative.
 * @param {HTMLElement} pop
 * @param {Tok} tok
 * @param {{q: number, exact: boolean} | null} post
 * @param {((alt: Alt) => void) | null} onPick
 */
export function fillPopover(pop, tok, post, onPick) {
  pop.replaceChildren();
  const head = document.createElement("div");
  head.className = "pop-head";
  const code = document.createElement("code");
  code.dataset.testid = "popover-token";
  code.textContent = visibleToken(tok.text);
  const prob = document.createElement("span");
  prob.dataset.testid = "popover-p";
  prob.textContent = percent(tok.p);
  prob.title = "the model's probability (softmax of its raw logits)";
  head.append(code, prob);
  const meta = document.createElement("div");
  meta.className = "pop-meta";
  const bits = entropyLowerBound(tok.top).toFixed(2);
  const sampled = post ? ` · after sampling ${post.exact ? "" : "≈ "}${percent(post.q)}` : "";
  const picked = tok.picked ? " · picked by you" : "";
  const rank = tok.rank !== null ? `rank ${tok.rank}`
    : tok.top.length ? `rank > ${tok.top.length} (outside the engine's top ${tok.top.length})` : "rank unknown";
  meta.textContent = `${rank} · entropy ≥ ${bits} bits${sampled}${picked}`
    + (tok.parts && tok.parts > 1 ? ` · ${tok.parts} byte tokens` : "");
  meta.dataset.testid = "popover-meta";
  const list = document.createElement("ol");
  list.className = "pop-alts";
  list.setAttribute("aria-label", onPick ? "Alternatives: choose one to branch the reply here" : "Alternatives");
  const alts = [...tok.top].sort((a, b) => b.p - a.p);
  const drawn = chosenIndex(tok, alts);
  const forbidden = new Set(tok.forbidden ?? []);
  for (const [index, alt] of alts.entries()) {
    const li = document.createElement("li");
    li.dataset.testid = "alt";
    li.dataset.p = String(alt.p);
    const chosen = index === drawn;
    const barred = alt.id !== undefined && forbidden.has(alt.id);  // the reply format refused it: no branch from it
    if (chosen) li.className = "chosen";
    if (barred) {
      li.className = "forbidden";
      li.dataset.forbidden = "true";
      li.title = "forbidden by the reply format (the model's probability)";
    }
    const t = document.createElement(onPick && !chosen && !barred && !isByteToken(alt.text) ? "button" : "code");
    t.textContent = visibleToken(alt.text);
    if (t instanceof HTMLButtonElement) {
      t.type = "button";
      t.className = "alt-pick";
      t.dataset.testid = "alt-pick";
      t.setAttribute("aria-label", `Branch with ${visibleToken(alt.text)} (${percent(alt.p)})`);
      t.addEventListener("click", () => onPick?.(alt));
    }
    const bar = document.createElement("span");
    bar.className = "alt-bar";
    bar.style.width = `${Math.max(1, alt.p * 100)}%`;
    const pct = document.createElement("span");
    pct.className = "alt-pct";
    pct.dataset.testid = "alt-pct";
    pct.textContent = percent(alt.p);
    li.append(t, bar, pct);
    if (barred) {
      const note = document.createElement("span");
      note.className = "alt-forbidden";
      note.dataset.testid = "alt-forbidden";
      note.textContent = "forbidden";
      li.append(note);
    }
    list.append(li);
  }
  pop.append(head, meta, list);
}

/**
 * A piece of a character split over byte tokens (shown as <0xNN>): it cannot start a branch on its own.
 * @param {string} text
 * @returns {boolean}
 */
export function isByteToken(text) {
  return /<0x[0-9A-Fa-f]{2}>/.test(text) || text.includes("\uFFFD") || text === "";  // any byte of a split character
}

/**
 * Places the popover under (or, without room, above) the anchor, kept inside the viewport.
 * @param {HTMLElement} pop
 * @param {HTMLElement} anchor
 */
export function placePopover(pop, anchor) {
  const r = anchor.getBoundingClientRect();
  const w = pop.offsetWidth;
  const h = pop.offsetHeight;
  const left = Math.min(Math.max(8, r.left), window.innerWidth - w - 8);
  const below = r.bottom + 6;
  const top = below + h > window.innerHeight - 8 ? Math.max(8, r.top - h - 6) : below;
  pop.style.left = `${left}px`;
  pop.style.top = `${top}px`;
}
