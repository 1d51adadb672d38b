// @ts-check
/** The conversations kept in this browser (IndexedDB) and which one is shown; rename, search, import. */

import * as store from "./store.js";
import { checkConversation, repairConversation } from "./schema.js";
import { splitStored } from "./thinking.js";
import { allMessages, path } from "./tree.js";

/** @typedef {import("./tree.js").Conversation} Conversation */

export class Library {
  /** @param {Conversation[]} all newest first */
  constructor(all) {
    // a stored conversation that does not check out (written by an older page, or by hand) is rendered as far as it
    // can be and marked; it never stops the others from loading
    this.all = all.map((c) => repairConversation(c, store.newId));
    // a reply that was streaming when the page went away ended without a `done`
    for (const c of this.all) for (const m of allMessages(c.root)) if (m.role === "assistant" && !m.reason) m.reason = "interrupted";
    /** @type {Conversation} */
    this.current = this.all.find((c) => c.id === store.loadCurrentId()) ?? this.all[0] ?? this.add();
    /** @type {Map<string, number>} */
    this.lastSave = new Map();
    // a reply kept with its thinking in its text (an older page): the thinking moves to its fold, saved so once
    for (const c of this.all) if (allMessages(c.root).filter(splitStored).length > 0) this.save(c);
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
    this.current = this.all.find((c) => c.root === null && !c.scoredText) ?? this.add();
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
    if (conv.root === null && !conv.named && !conv.scoredText) return;  // an empty chat is not worth keeping
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
   * Adds imported conversations, all or none: the first one that does not check out field by field rejects the
   * whole file, naming the conversation and the field, and nothing is kept. One whose id is taken gets a new id
   * (nothing here is overwritten).
   * @param {unknown[]} list
   * @returns {number} how many were added
   */
  importMany(list) {
    for (const [i, raw] of list.entries()) {
      const err = checkConversation(raw);
      if (err) throw new Error(`conversation ${i + 1} of ${list.length}: ${err}; nothing was imported`);
    }
    const convs = /** @type {Conversation[]} */ (structuredClone(list));
    for (const conv of convs) {
      if (this.all.some((c) => c.id === conv.id)) conv.id = store.newId();
      conv.updated = typeof conv.updated === "number" ? conv.updated : Date.now();
      conv.created = typeof conv.created === "number" ? conv.created : conv.updated;
      conv.title = typeof conv.title === "string" ? conv.title : "Imported chat";
      allMessages(conv.root).forEach(splitStored);  // `<think>…</think>` in a reply's text: folded, without the tags
      this.all.push(conv);
      this.save(conv);
    }
    this.all.sort((a, b) => b.updated - a.updated);
    return convs.length;
  }

  /**
   * @param {Conversation} conv
   * @returns {number} messages on the shown path
   */
  static length(conv) {
    return path(conv).length;
  }
}
