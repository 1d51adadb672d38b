// @ts-check
/** The conversation list in the sidebar: switch, rename, export, delete; the current one and a streaming one marked. */

import { titleOf } from "./store.js";
import { path } from "./tree.js";

/**
 * @typedef {import("./tree.js").Conversation} Conversation
 * @typedef {{onSelect: (id: string) => void, onDelete: (id: string) => void, onRename: (id: string, title: string) => void,
 *            onExport: (id: string) => void}} SidebarActions
 */

/**
 * Renders the list, newest first.
 * @param {HTMLElement} ul
 * @param {Conversation[]} convs the ones matching the search
 * @param {string} currentId
 * @param {string | null} streamingId the conversation whose reply is streaming (it cannot be deleted)
 * @param {SidebarActions} actions
 */
export function renderSidebar(ul, convs, currentId, streamingId, actions) {
  ul.replaceChildren();
  const sorted = [...convs].sort((a, b) => b.updated - a.updated);
  for (const conv of sorted) {
    const li = document.createElement("li");
    li.className = conv.id === currentId ? "conv current" : "conv";
    li.dataset.testid = "conversation";
    li.dataset.id = conv.id;
    const title = titleOf(conv);
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conv-open";
    open.textContent = title;
    open.title = `${title}\n${new Date(conv.updated).toLocaleString()} · ${path(conv).length} messages`;
    const damaged = /** @type {{damaged?: string}} */ (conv).damaged;
    if (damaged) {
      li.classList.add("damaged");
      open.textContent = `⚠ ${title}`;
      open.title += `\nDamaged in storage, shown as far as it could be: ${damaged}`;
    }
    if (conv.id === currentId) open.setAttribute("aria-current", "true");
    if (conv.id === streamingId) {
      li.classList.add("streaming");
      open.title += " · replying…";
    }
    open.addEventListener("click", () => actions.onSelect(conv.id));
    const rename = iconButton("✎", `Rename "${title}"`, "conversation-rename", () => startRename(li, open, conv, actions));
    const exp = iconButton("⤓", `Export "${title}"`, "conversation-export", () => actions.onExport(conv.id));
    const del = iconButton("×", `Delete "${title}"`, "conversation-delete", () => actions.onDelete(conv.id));
    del.disabled = conv.id === streamingId;
    li.append(open, rename, exp, del);
    ul.append(li);
  }
}

/**
 * @param {string} text
 * @param {string} label
 * @param {string} testid
 * @param {() => void} onClick
 * @returns {HTMLButtonElement}
 */
function iconButton(text, label, testid, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "icon conv-act";
  b.textContent = text;
  b.setAttribute("aria-label", label);
  b.title = label;
  b.dataset.testid = testid;
  b.addEventListener("click", onClick);
  return b;
}

/**
 * Swaps the title for a text field: Enter saves, Escape or leaving the field cancels.
 * @param {HTMLElement} li
 * @param {HTMLButtonElement} open
 * @param {Conversation} conv
 * @param {SidebarActions} actions
 */
function startRename(li, open, conv, actions) {
  const input = document.createElement("input");
  input.type = "text";
  input.className = "conv-rename";
  input.value = titleOf(conv);
  input.dataset.testid = "rename-input";
  input.setAttribute("aria-label", "New name for the conversation");
  let done = false;
  const finish = (/** @type {boolean} */ save) => {
    if (done) return;
    done = true;
    if (save) actions.onRename(conv.id, input.value);
    else input.replaceWith(open);
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    else if (e.key === "Escape") {
      e.stopPropagation();
      finish(false);
    }
  });
  input.addEventListener("blur", () => finish(false));
  open.replaceWith(input);
  li.classList.add("renaming");
  input.focus();
  input.select();
}
