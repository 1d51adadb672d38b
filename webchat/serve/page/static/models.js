// @ts-check
/**
 * The model picker in the header, on a server with several models (hello.models, docs/protocol.md): each option
 * names a model with its size, architecture, weights and whether it is loaded; the next request runs on the picked
 * one (generate `model`), and a chat remembers the model of its latest request.
 */

/**
 * @typedef {{name: string, size_bytes: number, architecture: string, weights: string, context_length: number | null,
 *            default: boolean, loaded: boolean, thinking?: {start: string, end: string, switch: boolean} | null,
 *            vision?: boolean}} ModelCard
 *   `thinking`: a loaded model's (hello.thinking's shape); `vision`: it reads images (its projector beside it).
 */

/** @param {number} n */
export function sizeText(n) {
  return n >= 1 << 30 ? `${(n / (1 << 30)).toFixed(1)} GB` : `${Math.max(0.1, n / (1 << 20)).toFixed(1)} MB`;
}

/**
 * One option: name · architecture · weights · size, "reads images" where it does, and "not loaded" where it is not.
 * @param {ModelCard} card
 */
export function optionText(card) {
  return [card.name, card.architecture.replace(/ForCausalLM$/, ""), card.weights, sizeText(card.size_bytes),
    card.vision ? "reads images" : "", card.loaded ? "" : "not loaded"].filter(Boolean).join(" · ");
}

/**
 * The header line beside the picker.
 * @param {ModelCard} card
 */
export function describe(card) {
  return [card.context_length ? `context ${card.context_length}` : "", card.vision ? "reads images" : "",
    card.loaded ? "loaded" : "not loaded: loads with the next reply"].filter(Boolean).join(" · ");
}

export class ModelPicker {
  /**
   * @param {HTMLSelectElement} select
   * @param {(card: ModelCard | null) => void} onPick  the picked card (null: one model, no picker)
   */
  constructor(select, onPick) {
    this.select = select;
    this.onPick = onPick;
    /** @type {ModelCard[]} */
    this.cards = [];
    select.addEventListener("change", () => this.onPick(this.card()));
  }

  /**
   * The server's models (shown when there is more than one); keeps the picked one where it is still served.
   * @param {ModelCard[] | null | undefined} cards
   * @param {string | null} want  the model to show (the current chat's), else the default
   */
  set(cards, want) {
    const before = this.select.value;
    this.cards = cards ?? [];
    this.select.hidden = this.cards.length < 2;
    this.select.replaceChildren(...this.cards.map((c) => {
      const opt = document.createElement("option");
      opt.value = c.name;
      opt.textContent = optionText(c);
      opt.dataset.loaded = String(c.loaded);
      return opt;
    }));
    this.pick(want ?? before);
  }

  /** @param {string | null | undefined} name  a served model, else the default */
  pick(name) {
    const card = this.cards.find((c) => c.name === name) ?? this.cards.find((c) => c.default) ?? this.cards[0];
    if (card) this.select.value = card.name;
    this.onPick(this.card());
  }

  /** @returns {ModelCard | null} */
  card() {
    return this.cards.length < 2 ? null : this.cards.find((c) => c.name === this.select.value) ?? null;
  }

  /** The model the next request names: null with one model (the server's default). */
  get value() {
    return this.card()?.name ?? null;
  }

  /**
   * After a `loading` … `loaded`: which models are loaded now.
   * @param {string[]} names
   */
  markLoaded(names) {
    for (const c of this.cards) c.loaded = names.includes(c.name);
    for (const opt of this.select.options) {
      const c = this.cards.find((x) => x.name === opt.value);
      if (c) {
        opt.textContent = optionText(c);
        opt.dataset.loaded = String(c.loaded);
      }
    }
    this.onPick(this.card());
  }
}
