// @ts-check
/**
 * A conversation is a tree of versions: at each position a Thread holds the versions of that message (an edited
 * question, a regenerated or branched reply), each with the thread that follows it. The shown conversation is the
 * path through each thread's current version. Pure data: no DOM, no storage.
 */

/**
 * @typedef {import("./store.js").Message} Message
 * @typedef {{versions: Version[], current: number}} Thread
 * @typedef {{msg: Message, next: Thread | null}} Version
 * @typedef {{id: string, title: string, named?: boolean, created: number, updated: number, root: Thread | null,
 *            model?: string, format?: import("./replyformat.js").ReplyFormat, think?: boolean,
 *            scoredText?: {text: string, scores: import("./scoreview.js").Score[]}, tools?: string[],
 *            allowedTools?: string[], toolChoice?: string}} Conversation
 *   `model`: the model its latest request ran on (the picker follows it); `format`: its reply format (Settings);
 *   `think` false: its Think switch is off (thinking.js); `scoredText`: the text last pasted into "Score a text" in
 *   this chat, with its scores (score.js).
 *   `named`: the user renamed it (the title no longer follows the first question).
 *   `tools`: the MCP tools switched on in it; `allowedTools`: those whose calls run without asking; `toolChoice`:
 *   "auto" (the model decides), "required" or a tool's name, for its first reply to each question (tools.js).
 * @typedef {{msg: Message, thread: Thread, index: number}} Step  one message of the shown path and where it lives
 */

/**
 * The shown path: each thread's current version, from the root.
 * @param {Conversation} conv
 * @returns {Step[]}
 */
export function path(conv) {
  /** @type {Step[]} */
  const out = [];
  let thread = conv.root;
  while (thread && thread.versions.length > 0) {
    const v = thread.versions[thread.current];
    out.push({ msg: v.msg, thread, index: out.length });
    thread = v.next;
  }
  return out;
}

/**
 * The messages of the shown path.
 * @param {Conversation} conv
 * @returns {Message[]}
 */
export function messages(conv) {
  return path(conv).map((s) => s.msg);
}

/**
 * Appends a message after the shown path (a new thread at the end).
 * @param {Conversation} conv
 * @param {Message} msg
 * @returns {Step}
 */
export function append(conv, msg) {
  const steps = path(conv);
  /** @type {Thread} */
  const thread = { versions: [{ msg, next: null }], current: 0 };
  if (steps.length === 0) conv.root = thread;
  else {
    const last = steps[steps.length - 1];
    last.thread.versions[last.thread.current].next = thread;
  }
  return { msg, thread, index: steps.length };
}

/**
 * Adds a version to a thread and shows it; what followed the old version stays with it.
 * @param {Thread} thread
 * @param {Message} msg
 */
export function addVersion(thread, msg) {
  thread.versions.push({ msg, next: null });
  thread.current = thread.versions.length - 1;
}

/**
 * Removes a thread's current version (and what follows it); shows the neighbour, or empties the thread.
 * @param {Conversation} conv
 * @param {Thread} thread
 */
export function removeVersion(conv, thread) {
  thread.versions.splice(thread.current, 1);
  thread.current = Math.max(0, Math.min(thread.current, thread.versions.length - 1));
  if (thread.versions.length > 0) return;
  if (conv.root === thread) {
    conv.root = null;
    return;
  }
  for (const step of path(conv)) {
    const v = step.thread.versions[step.thread.current];
    if (v.next === thread) v.next = null;
  }
}

/**
 * Shows version `i` of a thread (clamped).
 * @param {Thread} thread
 * @param {number} i
 */
export function show(thread, i) {
  thread.current = Math.max(0, Math.min(thread.versions.length - 1, i));
}

/**
 * A conversation from a flat message list (storage before versions: webchat.conversations.v1).
 * @param {{id: string, title?: string, created?: number, updated?: number, messages: Message[]}} old
 * @returns {Conversation}
 */
export function fromFlat(old) {
  const now = Date.now();
  /** @type {Conversation} */
  const conv = { id: old.id, title: old.title ?? "New chat", created: old.created ?? now, updated: old.updated ?? now,
    root: null };
  for (const m of old.messages) append(conv, m);
  return conv;
}

/**
 * Every message of a conversation, all versions (for search).
 * @param {Thread | null} thread
 * @returns {Message[]}
 */
export function allMessages(thread) {
  if (!thread) return [];
  return thread.versions.flatMap((v) => [v.msg, ...allMessages(v.next)]);
}
