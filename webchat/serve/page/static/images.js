// @ts-check
/**
 * A user message's images (issue 61; docs/protocol.md, "Messages and their parts"): the shape the page keeps, the
 * `image_url` parts a `generate` sends, the check of a stored or imported image, and a file read into one. No DOM
 * beyond FileReader and Image.
 */

/**
 * @typedef {{mime: string, data: string, width?: number, height?: number, name?: string}} StoredImage
 *   `data`: the file's bytes as base64; `width` / `height` in pixels, as the browser decoded it.
 */

/** The formats the server decodes (hello.vision.formats), as MIME types. */
export const MIMES = ["image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp"];
/** A frame where a model reads images (docs/protocol.md, "error"): every image of a chat travels in it as base64. */
export const FRAME_BYTES = 16 << 20;
/** An image's base64 at most: the frame's limit (nothing larger could ever be sent). */
export const MAX_DATA_CHARS = FRAME_BYTES;
/** Images a message at most: the wire's 64 parts less its text. */
export const MAX_IMAGES = 63;
const BASE64 = /^[A-Za-z0-9+/]*={0,2}$/;

/** @param {unknown} v */
const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
/** @param {unknown} v */
const shown = (v) => {
  const s = JSON.stringify(v);
  return s === undefined ? String(v) : s.length > 60 ? `${s.slice(0, 60)}…` : s;
};

/**
 * @param {StoredImage} img
 * @returns {string} the image as a `data:` URL (what an `<img>` shows and the server reads)
 */
export function imageUrl(img) {
  return `data:${img.mime};base64,${img.data}`;
}

/**
 * A message's content on the wire: its text alone, or its text then its images as OpenAI's parts.
 * @param {string} text
 * @param {StoredImage[] | undefined} images
 * @returns {string | Record<string, unknown>[]}
 */
export function wireContent(text, images) {
  if (!images?.length) return text;
  const parts = images.map((img) => ({ type: "image_url", image_url: { url: imageUrl(img) } }));
  return text === "" ? parts : [{ type: "text", text }, ...parts];
}

/**
 * The first problem of a message's `images`, as "field: expected …, got …", or "".
 * @param {Record<string, unknown>} msg a message whose role checked out
 * @param {string} at
 * @returns {string}
 */
export function checkImages(msg, at) {
  const list = msg.images;
  if (list === undefined) return "";
  if (msg.role !== "user") {
    return `${at}.images: only the user's messages hold images, got them on a ${msg.role} message`;
  }
  if (!Array.isArray(list) || list.length > MAX_IMAGES) {
    return `${at}.images: expected a list of at most ${MAX_IMAGES} images, got ${shown(list)}`;
  }
  for (const [i, v] of list.entries()) {
    const here = `${at}.images[${i}]`;
    if (!isObject(v)) return `${here}: expected {mime, data, width, height, name}, got ${shown(v)}`;
    const img = /** @type {Record<string, unknown>} */ (v);
    if (!MIMES.includes(/** @type {string} */ (img.mime))) {
      return `${here}.mime: expected one of ${MIMES.join(", ")}, got ${shown(img.mime)}`;
    }
    const data = img.data;
    if (typeof data !== "string" || data.length === 0 || data.length > MAX_DATA_CHARS || data.length % 4 !== 0
        || !BASE64.test(data)) {
      const got = typeof data === "string" ? `${data.length} characters` : shown(data);
      return `${here}.data: expected base64 of at most ${MAX_DATA_CHARS} characters, got ${got}`;
    }
    for (const key of ["width", "height"]) {
      const n = img[key];
      if (n !== undefined && !(Number.isInteger(n) && /** @type {number} */ (n) >= 1)) {
        return `${here}.${key}: expected a size in pixels, got ${shown(n)}`;
      }
    }
    if (img.name !== undefined && !(typeof img.name === "string" && img.name.length <= 255)) {
      return `${here}.name: expected a file name of at most 255 characters, got ${shown(img.name)}`;
    }
  }
  return "";
}

/**
 * Why a file cannot be attached, naming it, or "".
 * @param {File} file
 * @returns {string}
 */
export function refusal(file) {
  const name = file.name || "the pasted file";
  if (!file.type.startsWith("image/")) return `${name} is not an image (${file.type || "unknown type"})`;
  if (!MIMES.includes(file.type)) return `${name} is ${file.type}; the server reads ${MIMES.join(", ")}`;
  const chars = Math.ceil(file.size / 3) * 4;
  if (chars > MAX_DATA_CHARS) {
    return `${name} is ${mib(file.size)}; as base64 it would pass the server's ${mib(FRAME_BYTES)} a message`;
  }
  return "";
}

/** @param {number} n bytes @returns {string} */
export function mib(n) {
  return `${(n / (1 << 20)).toFixed(1)} MiB`;
}

/**
 * Reads an image file (checked by `refusal` first) into the stored shape; rejects naming the file when the browser
 * cannot decode it.
 * @param {File} file
 * @returns {Promise<StoredImage>}
 */
export async function readImage(file) {
  const url = await new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result));
    reader.onerror = () => reject(new Error(`${file.name || "the file"} could not be read: ${reader.error}`));
    reader.readAsDataURL(file);
  });
  const size = await new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => resolve({ width: img.naturalWidth, height: img.naturalHeight });
    img.onerror = () => reject(new Error(`${file.name || "the file"} is not an image this browser can decode`));
    img.src = url;
  });
  const data = url.slice(url.indexOf(",") + 1);
  return { mime: file.type, data, ...size, name: file.name || "pasted image" };
}
