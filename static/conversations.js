// @ts-check
/** The conversations kept in this browser (IndexedDB) and which one is shown; rename, search, import. */

import * as store from "./store.js";
import { allMessages, checkConversation, path } from "./tree.js";

/** @typedef {import("./tree.js").Conversation} Conversation */

export class Library {
  /** @param {Conversation[]} all newest first */
  constructor(all) {
    this.all = all;
    // a reply that was streaming when the page went away ended without a `done`
    for (const c of all) for (const m of allMessages(c.root)) if (m.role === "assistant" && !m.reason) m.reason = "interrupted";
    /** @type {Conversation} */
    this.current = all.find((c) => c.id === store.loadCurrentId()) ?? all[0] ?? this.add();
    /** @type {Map<string, number>} */
    this.lastSave = new Map();
  }

  /** @returns {Promise<Library>} */
  static async load() {
    try {
      return new Library(await store.loadConversations());
    } catch (err) {
      console.warn("webchat: IndexedDB is not available; conversations last only as long as this tab", err);
      return new Library([]);
    }
  }

  /** @returns {Conversation} a new empty conversation, first in the list */
  add() {
    const c = store.newConversation();
    this.all.unshift(c);
    return c;
  }

  /** Shows an empty conversation: the existing empty one if there is one. */
  startNew() {
    this.current = this.all.find((c) => c.root === null) ?? this.add();
    store.saveCurrentId(this.current.id);
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
    store.saveCurrentId(this.current.id);
    store.deleteConversation(id).catch((err) => console.warn("webchat: delete failed", err));
  }

  /**
   * Renames a conversation (an empty name gives the automatic title back).
   * @param {string} id
   * @param {string} title
   */
  rename(id, title) {
    const conv = this.all.find((c) => c.id === id);
    if (!conv) return;
    conv.named = title.trim() !== "";
    conv.title = conv.named ? title.trim() : "New chat";
    this.save(conv);
  }

  /** @param {Conversation} [conv] */
  save(conv = this.current) {
    conv.title = store.titleOf(conv);
    this.lastSave.set(conv.id, performance.now());
    if (conv.root === null && !conv.named) return;  // an empty chat is not worth keeping
    store.putConversation(conv).catch((err) => console.warn("webchat: saving failed", err));
  }

  /**
   * Saves at most once a second (while a reply streams).
   * @param {Conversation} conv
   */
  saveSoon(conv) {
    if (performance.now() - (this.lastSave.get(conv.id) ?? 0) > 1000) this.save(conv);
  }

  /**
   * Conversations whose title or any message (every version) contains the query, case-insensitively.
   * @param {string} query
   * @returns {Conversation[]}
   */
  search(query) {
    const q = query.trim().toLowerCase();
    if (q === "") return this.all;
    return this.all.filter((c) => store.titleOf(c).toLowerCase().includes(q)
      || allMessages(c.root).some((m) => m.content.toLowerCase().includes(q)));
  }

  /**
   * Adds imported conversations; one whose id is taken gets a new id (nothing here is overwritten).
   * @param {unknown[]} list
   * @returns {{added: number, errors: string[]}}
   */
  importMany(list) {
    const errors = [];
    let added = 0;
    for (const [i, raw] of list.entries()) {
      const err = checkConversation(raw);
      if (err) {
        errors.push(`conversation ${i + 1}: ${err}`);
        continue;
      }
      const conv = /** @type {Conversation} */ (raw);
      if (this.all.some((c) => c.id === conv.id)) conv.id = store.newId();
      conv.updated = typeof conv.updated === "number" ? conv.updated : Date.now();
      conv.created = typeof conv.created === "number" ? conv.created : conv.updated;
      conv.title = typeof conv.title === "string" ? conv.title : "Imported chat";
      this.all.push(conv);
      this.save(conv);
      added += 1;
    }
    this.all.sort((a, b) => b.updated - a.updated);
    return { added, errors };
  }

  /**
   * @param {Conversation} conv
   * @returns {number} messages on the shown path
   */
  static length(conv) {
    return path(conv).length;
  }
}
