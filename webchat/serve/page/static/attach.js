// @ts-check
/**
 * The composer's images (issue 61): pasted, dropped on the composer or picked with its button, while the model the
 * next reply runs on reads images (hello.vision, a model card's `vision`). Each is read as base64 at once and waits
 * as a thumbnail with a remove button until the message is sent; a file that is not an image the server reads, or too
 * large for a message, is refused naming it.
 */

import { imageUrl, readImage, refusal } from "./images.js";

/**
 * @typedef {import("./images.js").StoredImage} StoredImage
 * @typedef {{composer: HTMLElement, input: HTMLTextAreaElement, button: HTMLButtonElement, picker: HTMLInputElement,
 *            list: HTMLElement, refuse: (text: string) => void}} Parts
 *   `list`: where the thumbnails go; `refuse`: shows why files were not attached.
 */

export class Attachments {
  /** @param {Parts} parts */
  constructor(parts) {
    this.p = parts;
    /** @type {StoredImage[]} */
    this.images = [];
    /** Why the next reply's model cannot take images ("": it can). */
    this.blocked = "no model is known yet";
    this.maxImages = 16;
    parts.button.addEventListener("click", () => parts.picker.click());
    parts.picker.addEventListener("change", () => {
      this.add([...parts.picker.files ?? []]).finally(() => { parts.picker.value = ""; });
    });
    parts.input.addEventListener("paste", (e) => {
      const files = [...e.clipboardData?.files ?? []];
      if (files.length === 0) return;  // text pastes as text
      e.preventDefault();
      this.add(files);
    });
    const c = parts.composer;
    c.addEventListener("dragover", (e) => {
      if (!e.dataTransfer?.types.includes("Files")) return;
      e.preventDefault();  // allows the drop
      c.classList.add("drop-target");
    });
    c.addEventListener("dragleave", (e) => {
      if (!c.contains(/** @type {Node | null} */ (e.relatedTarget))) c.classList.remove("drop-target");
    });
    c.addEventListener("drop", (e) => {
      c.classList.remove("drop-target");
      const files = [...e.dataTransfer?.files ?? []];
      if (files.length === 0) return;
      e.preventDefault();
      this.add(files);
    });
    // a file dropped beside the composer would open in the tab, leaving the page and what was typed in it
    for (const kind of ["dragover", "drop"]) {
      window.addEventListener(kind, (e) => {
        if (/** @type {DragEvent} */ (e).dataTransfer?.types.includes("Files")) e.preventDefault();
      });
    }
  }

  /**
   * The model the next reply runs on: its name, whether it reads images, whether any served model does (the button
   * shows only then), and hello.vision.max_images.
   * @param {string} name
   * @param {boolean} vision
   * @param {boolean} anyVision
   * @param {number} maxImages
   */
  setModel(name, vision, anyVision, maxImages) {
    this.blocked = vision ? "" : `${name} reads text only; pick a model that reads images (marked in the model list)`;
    this.maxImages = maxImages;
    const b = this.p.button;
    b.hidden = !anyVision;
    b.disabled = !vision;
    b.title = vision ? "Attach images (or paste them, or drop them here)" : this.blocked;
  }

  /**
   * Reads the files that can be attached; refuses the others naming each.
   * @param {File[]} files
   */
  async add(files) {
    if (this.blocked) {
      this.p.refuse(`${files.map((f) => f.name || "the pasted file").join(", ")}: ${this.blocked}`);
      return;
    }
    const problems = [];
    const room = this.maxImages - this.images.length;
    const ok = files.filter((f) => {
      const why = refusal(f);
      if (why) problems.push(why);
      return !why;
    });
    if (ok.length > room) {
      const left = ok.slice(Math.max(0, room)).map((f) => f.name || "a pasted image");
      problems.push(`at most ${this.maxImages} images a message: ${left.join(", ")} left out`);
    }
    for (const file of ok.slice(0, Math.max(0, room))) {
      try {
        this.images.push(await readImage(file));
      } catch (err) {
        problems.push(err instanceof Error ? err.message : String(err));
      }
    }
    this.render();
    if (problems.length) this.p.refuse(problems.join("; "));
  }

  /** @returns {StoredImage[]} the pending images, handed over (the composer is then empty of them) */
  take() {
    const out = this.images;
    this.images = [];
    this.render();
    return out;
  }

  /**
   * Images of a message that could not be sent, back in front of any added since.
   * @param {StoredImage[]} images
   */
  restore(images) {
    this.images = [...images, ...this.images];
    this.render();
  }

  render() {
    const list = this.p.list;
    list.hidden = this.images.length === 0;
    list.replaceChildren(...this.images.map((img, i) => {
      const item = document.createElement("figure");
      item.className = "pending-image";
      item.dataset.testid = "pending-image";
      const pic = document.createElement("img");
      pic.src = imageUrl(img);
      pic.alt = img.name ?? "image";
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "pending-remove";
      remove.dataset.testid = "remove-image";
      remove.textContent = "×";
      remove.setAttribute("aria-label", `Remove ${img.name ?? "image"}`);
      remove.title = `Remove ${img.name ?? "image"}`;
      remove.addEventListener("click", () => {
        this.images.splice(i, 1);
        this.render();
        this.p.input.focus();
      });
      item.append(pic, remove);
      return item;
    }));
  }
}
