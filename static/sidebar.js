// @ts-check
/** The conversation list in the sidebar: switch, delete, and the current one marked. */

import { titleOf } from "./store.js";

/**
 * @typedef {import("./store.js").Conversation} Conversation
 * @typedef {{onSelect: (id: string) => void, onDelete: (id: string) => void}} SidebarActions
 */

/**
 * Renders the list, newest first.
 * @param {HTMLElement} ul
 * @param {Conversation[]} convs
 * @param {string} currentId
 * @param {boolean} locked while a reply streams: switching is disabled
 * @param {SidebarActions} actions
 */
export function renderSidebar(ul, convs, currentId, locked, actions) {
  ul.replaceChildren();
  const sorted = [...convs].sort((a, b) => b.updated - a.updated);
  for (const conv of sorted) {
    const li = document.createElement("li");
    li.className = conv.id === currentId ? "conv current" : "conv";
    li.dataset.testid = "conversation";
    li.dataset.id = conv.id;
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conv-open";
    open.textContent = titleOf(conv);
    open.title = `${titleOf(conv)}\n${new Date(conv.updated).toLocaleString()} · ${conv.messages.length} messages`;
    open.disabled = locked && conv.id !== currentId;
    if (conv.id === currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => actions.onSelect(conv.id));
    const del = document.createElement("button");
    del.type = "button";
    del.className = "icon conv-delete";
    del.textContent = "×";
    del.setAttribute("aria-label", `Delete "${titleOf(conv)}"`);
    del.dataset.testid = "conversation-delete";
    del.disabled = locked && conv.id === currentId;
    del.addEventListener("click", () => actions.onDelete(conv.id));
    li.append(open, del);
    ul.append(li);
  }
}
