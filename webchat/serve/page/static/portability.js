// @ts-check
/**
 * Export and import of conversations as JSON: every version, every token with its probability and alternatives.
 * Format: {"format": "webchat-conversations", "version": 4, "exported": ISO date, "conversations": [...]}.
 * Version 3 adds messages' parts (docs/protocol.md, "Messages and their parts"): a reply's `toolCalls`, `tool`
 * messages, a chat's tools; version 4 a user message's `images` (base64, checked on import: images.js); versions 1-3
 * (no such fields) import as they are.
 */

export const FORMAT = "webchat-conversations";
export const VERSION = 4;

/**
 * Starts a download of the conversations as one JSON file.
 * @param {import("./tree.js").Conversation[]} convs
 * @param {string} name file name
 */
export function download(convs, name) {
  const doc = { format: FORMAT, version: VERSION, exported: new Date().toISOString(), conversations: convs };
  const blob = new Blob([JSON.stringify(doc)], { type: "application/json" });
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  window.setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

/**
 * A file name for an export: webchat-<what>-<date>.json, the title reduced to safe characters.
 * @param {string} what
 * @returns {string}
 */
export function fileName(what) {
  const safe = what.toLowerCase().replace(/[^a-z0-9]+/g, "-").replace(/^-|-$/g, "").slice(0, 40) || "chat";
  return `webchat-${safe}-${new Date().toISOString().slice(0, 10)}.json`;
}

/**
 * Reads an export file; throws an Error naming what was expected and what was found.
 * @param {File} file
 * @returns {Promise<unknown[]>} the conversations (checked one by one by the library)
 */
export async function readExport(file) {
  const text = await file.text();
  let doc;
  try {
    doc = JSON.parse(text);
  } catch (err) {
    throw new Error(`expected a JSON file exported by webchat, got text that is not JSON (${String(err)})`);
  }
  if (!doc || doc.format !== FORMAT || !Array.isArray(doc.conversations)) {
    const got = doc && typeof doc === "object" ? `format ${JSON.stringify(doc.format)}` : typeof doc;
    throw new Error(`expected {"format": "${FORMAT}", "conversations": [...]}, got ${got}`);
  }
  if (typeof doc.version !== "number" || doc.version > VERSION) {
    throw new Error(`expected export version ≤ ${VERSION}, got ${JSON.stringify(doc.version)}`);
  }
  return doc.conversations;
}
