// @ts-check
/**
 * A user message's images as thumbnails (buttons that enlarge them), and the viewer: a modal `<dialog>` (the browser
 * keeps the focus inside it and closes it on Escape), closed too by its button or a click beside the image.
 */

import { imageUrl } from "./images.js";

/** @typedef {import("./images.js").StoredImage} StoredImage */

/**
 * The row of thumbnails for a message's images.
 * @param {StoredImage[]} images
 * @param {(img: StoredImage) => void} onOpen
 * @returns {HTMLElement}
 */
export function thumbnails(images, onOpen) {
  const row = document.createElement("div");
  row.className = "msg-images";
  row.dataset.testid = "message-images";
  for (const img of images) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "thumb";
    b.dataset.testid = "message-image";
    const label = describe(img);
    b.setAttribute("aria-label", `Enlarge ${label}`);
    b.title = label;
    const pic = document.createElement("img");
    pic.src = imageUrl(img);
    pic.alt = img.name ?? "image";
    b.append(pic);
    b.addEventListener("click", () => onOpen(img));
    row.append(b);
  }
  return row;
}

/**
 * @param {StoredImage} img
 * @returns {string} its name and size in pixels
 */
function describe(img) {
  const size = img.width && img.height ? ` (${img.width} × ${img.height})` : "";
  return `${img.name ?? "image"}${size}`;
}

/** The enlarged image. */
export class ImageViewer {
  /** @param {HTMLDialogElement} dialog holding an img, a caption and a close button */
  constructor(dialog) {
    this.dialog = dialog;
    this.img = /** @type {HTMLImageElement} */ (dialog.querySelector("img"));
    this.caption = /** @type {HTMLElement} */ (dialog.querySelector(".image-view-caption"));
    dialog.querySelector("button")?.addEventListener("click", () => dialog.close());
    dialog.addEventListener("click", (e) => { if (e.target === dialog) dialog.close(); });  // the backdrop
    dialog.addEventListener("close", () => { this.img.removeAttribute("src"); });
  }

  /** @param {StoredImage} img */
  open(img) {
    this.img.src = imageUrl(img);
    this.img.alt = img.name ?? "image";
    this.caption.textContent = describe(img);
    this.dialog.showModal();
  }

  /** @returns {boolean} */
  get isOpen() {
    return this.dialog.open;
  }
}
