// @ts-check
/** The conversations kept in this browser and which one is shown; every change is saved to localStorage. */

import * as store from "./store.js";

/** @typedef {import("./store.js").Conversation} Conversation */

export class Library {
  constructor() {
    /** @type {Conversation[]} */
    this.all = store.loadConversations();
    // a reply that was streaming when the page went away ended without a `done`
    for (const c of this.all) for (const m of c.messages) if (m.role === "assistant" && !m.reason) m.reason = "interrupted";
    /** @type {Conversation} */
    this.current = this.all.find((c) => c.id === store.loadCurrentId()) ?? this.all[0] ?? this.add();
    this.lastSave = 0;
  }

  /** @returns {Conversation} a new empty conversation, first in the list */
  add() {
    const c = store.newConversation();
    this.all.unshift(c);
    return c;
  }

  /** Shows an empty conversation: the existing empty one if there is one. */
  startNew() {
    this.current = this.all.find((c) => c.messages.length === 0) ?? this.add();
    this.save();
  }

  /** @param {string} id */
  select(id) {
    this.current = this.all.find((c) => c.id === id) ?? this.current;
    store.saveCurrentId(this.current.id);
  }

  /** @param {string} id */
  remove(id) {
    this.all = this.all.filter((c) => c.id !== id);
    if (this.current.id === id) this.current = this.all[0] ?? this.add();
    this.save();
  }

  save() {
    this.current.title = store.titleOf(this.current);
    store.saveConversations(this.all);
    store.saveCurrentId(this.current.id);
    this.lastSave = performance.now();
  }

  /** Saves at most once a second (while a reply streams). */
  saveSoon() {
    if (performance.now() - this.lastSave > 1000) this.save();
  }
}
