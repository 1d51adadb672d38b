// @ts-check
/**
 * Requests: a new question, a regenerated or edited turn, Continue, and a reply branched from one of its tokens with
 * another alternative. One request at a time (one socket); it goes on streaming when another chat is shown.
 */

import { FRAME_BYTES, mib } from "./images.js";
import { sizeText } from "./models.js";
import { ReplyData } from "./reply.js";
import { newId } from "./store.js";
import { MARKERS, rawText, tokensFit } from "./thinking.js";
import { toWire } from "./toolwire.js";
import { addVersion, append, path, removeVersion, show } from "./tree.js";

/**
 * @typedef {import("./store.js").Message} Message
 * @typedef {import("./tree.js").Conversation} Conversation
 * @typedef {import("./tree.js").Step} Step
 * @typedef {import("./heatmap.js").Tok} Tok
 * @typedef {import("./heatmap.js").Alt} Alt
 * @typedef {import("./reply.js").ReplyView} ReplyView
 * @typedef {import("./connection.js").ServerMessage} ServerMessage
 * @typedef {import("./images.js").StoredImage} StoredImage
 * @typedef {{text: string, images: StoredImage[]}} Typed
 * @typedef {{id: string, conv: Conversation, msg: Message, data: ReplyData, view: ReplyView | null,
 *            undo: () => void, typed: Typed | null, stopping: boolean, before: number, trimmed: number}} Active
 *   `undo`: takes the turn back when the request fails before any new text (`before`: the reply's length at start);
 *   `typed`: the text and images of a fresh question, given back to the composer then; `trimmed`: how many of the
 *   oldest messages the server left out to fit the context (`start.trimmed_messages`).
 * @typedef {{connection: import("./connection.js").Connection, lib: import("./conversations.js").Library,
 *   settings: import("./settings.js").SettingsPanel, refresh: () => void, error: (text: string, code: string) => void,
 *   progress: (text: string) => void, announce: (text: string, final: boolean) => void,
 *   restoreInput: (typed: Typed) => void, model: () => string | null, loaded: (names: string[]) => void,
 *   imagesBlocked: () => string,
 *   format: () => import("./replyformat.js").ReplyFormat | null, formatError: () => string,
 *   templateKwargs: (conv: Conversation) => Record<string, unknown> | null,
 *   toolFields: (conv: Conversation, history: Message[], cont: boolean) => Record<string, unknown>,
 *   afterReply: (conv: Conversation, msg: Message, reason: string,
 *                calls: import("./toolwire.js").WireCall[] | undefined) => void}} Deps
 *   `model`: the picked model the next request names (null: the server's one); `loaded`: the models loaded now;
 *   `imagesBlocked`: why that model cannot read the chat's images ("": it can);
 *   `format`: the chat's reply format (Settings), `formatError` what is wrong with the one being typed;
 *   `templateKwargs`: the chat's template variables (its Think switch: `enable_thinking`), null for none.
 *   `toolFields`: a generate's `tools` and `tool_choice` (tools.js); `afterReply`: a reply ended (`done`), with the
 *   calls it made: the tool loop goes on from there.
 */

const STOP_TIMEOUT_MS = 15000;

/**
 * The reply's token ids when they spell its content exactly (protocol `prefix_ids`): a branch or Continue then runs
 * on the model's own tokens, never re-tokenised. null (continue by text) when any token lacks an id (an engine that
 * returns none), holds a character merged from several byte tokens, or the text no longer matches.
 * @param {Message} msg
 * @returns {number[] | null}
 */
export function prefixIds(msg) {
  const toks = msg.tokens ?? [];
  if (toks.length === 0 || toks.some((t) => !Number.isInteger(t.id) || /** @type {number} */ (t.id) < 0
      || (t.parts ?? 1) > 1)) return null;
  return tokensFit(msg) ? toks.map((t) => /** @type {number} */ (t.id)) : null;
}

/**
 * What of a reply shows (its thinking and its answer), to tell whether a request added any.
 * @param {Message} msg
 * @returns {number}
 */
const shownLength = (msg) => msg.content.length + (msg.thinking?.length ?? 0);

/**
 * @param {number} n
 * @returns {string}
 */
function trimmedNote(n) {
  return `the ${n} oldest message${n === 1 ? " was" : "s were"} left out to fit the model's context`;
}

export class Turns {
  /** @param {Deps} deps */
  constructor(deps) {
    this.d = deps;
    /** @type {Active | null} */
    this.active = null;
    this.counter = 0;
  }

  /**
   * A new question at the end of the current conversation: words, images, or both.
   * @param {string} text
   * @param {StoredImage[]} [images]
   * @returns {boolean} whether it was sent
   */
  ask(text, images = []) {
    if (this.active || (text.trim() === "" && images.length === 0)) return false;
    const conv = this.d.lib.current;
    const step = append(conv, { role: "user", content: text, ...(images.length ? { images } : {}) });
    const reply = /** @type {Message} */ ({ role: "assistant", content: "" });
    const undo = () => removeVersion(conv, step.thread);
    const ok = this.start(conv, [...path(conv).map((s) => s.msg), reply], reply, false, undo, { text, images });
    if (!ok) undo();
    else append(conv, reply);
    return ok;
  }

  /**
   * A new version of a user message (its images kept), then a reply to it.
   * @param {Step} step
   * @param {string} text
   */
  edit(step, text) {
    const images = step.msg.images;
    if (this.active || (text.trim() === "" && !images?.length)) return;
    const conv = this.d.lib.current;
    const old = step.thread.current;
    addVersion(step.thread, { role: "user", content: text, ...(images ? { images } : {}) });
    const undo = () => { removeVersion(conv, step.thread); show(step.thread, old); };
    const reply = /** @type {Message} */ ({ role: "assistant", content: "" });
    const history = path(conv).slice(0, step.index + 1).map((s) => s.msg);
    if (this.start(conv, [...history, reply], reply, false, undo, null)) append(conv, reply);
    else undo();
  }

  /**
   * A new version of a reply, from scratch (`prefix` empty) or from the given start (a branch from a token).
   * @param {Step} step
   * @param {Message} [prefix]
   */
  regenerate(step, prefix) {
    if (this.active) return;
    const conv = this.d.lib.current;
    const old = step.thread.current;
    const reply = prefix ?? /** @type {Message} */ ({ role: "assistant", content: "" });
    addVersion(step.thread, reply);
    const undo = () => { removeVersion(conv, step.thread); show(step.thread, old); };
    const history = path(conv).slice(0, step.index).map((s) => s.msg);
    if (!this.start(conv, [...history, reply], reply, rawText(reply) !== "", undo, null)) undo();
  }

  /**
   * Branches a reply at token k: the tokens before it, then `alt` instead of the token the model drew; the server
   * continues from there (protocol `continue`). The old reply stays as the previous version.
   * @param {Step} step
   * @param {number} k
   * @param {Alt} alt
   */
  branch(step, k, alt) {
    const toks = step.msg.tokens ?? [];
    const tok = toks[k];
    if (!tok || this.active) return;
    const before = toks.slice(0, k).map((t) => ({ ...t }));
    const rank = [...tok.top].sort((a, b) => b.p - a.p).findIndex((a) => a === alt) + 1;
    /** @type {Tok} */
    const chosen = { id: alt.id, text: alt.text, p: alt.p, rank: rank || tok.rank, top: tok.top, picked: true };
    if (tok.part) chosen.part = tok.part;
    if (alt.text.trim() && MARKERS.some((m) => m.includes(alt.text.trim()))) {  // a marker picked: no text shows
      chosen.raw = alt.text;
      chosen.text = "";
    }
    const tokens = [...before, chosen];
    const text = (/** @type {boolean} */ thinking) => tokens.filter((t) => (t.part === "thinking") === thinking)
      .map((t) => t.text).join("");
    /** @type {Message} */
    const reply = { role: "assistant", content: text(false), tokens };
    if (step.msg.thinking !== undefined) reply.thinking = text(true);
    if (step.msg.format) reply.format = step.msg.format;  // a branch keeps the reply's format (its grammar)
    this.regenerate(step, reply);
  }

  /**
   * The model goes on after the results of its tool calls (the last messages are `tool` messages): a new reply.
   * @param {Conversation} conv
   * @returns {boolean} whether it was sent
   */
  resume(conv) {
    if (this.active) return false;
    const reply = /** @type {Message} */ ({ role: "assistant", content: "" });
    const step = append(conv, reply);
    const undo = () => removeVersion(conv, step.thread);
    const ok = this.start(conv, path(conv).map((s) => s.msg), reply, false, undo, null);
    if (!ok) undo();
    return ok;
  }

  /**
   * Continue the last reply from where it ended.
   * @param {Step} step
   */
  continueReply(step) {
    if (this.active || rawText(step.msg).trim() === "") return;
    const conv = this.d.lib.current;
    const reason = step.msg.reason;
    const undo = () => { step.msg.reason = reason; };
    const history = path(conv).slice(0, step.index + 1).map((s) => s.msg);
    this.start(conv, history, step.msg, true, undo, null);
  }

  /**
   * Sends a generate for `messages` (the last is `reply`, maybe with a start to continue) and makes it active.
   * @param {Conversation} conv
   * @param {Message[]} messages
   * @param {Message} reply
   * @param {boolean} cont
   * @param {() => void} undo
   * @param {Typed | null} typed
   * @returns {boolean}
   */
  start(conv, messages, reply, cont, undo, typed) {
    const d = this.d;
    const invalid = d.settings.validateAll();
    if (invalid.length > 0) {
      d.error(`fix the settings first: ${invalid.join(", ")}`, "invalid_settings");
      return false;
    }
    if (!d.connection.isOpen) {
      d.error("not connected to the server; your message is kept, send it again once reconnected", "offline");
      return false;
    }
    const withImages = messages.some((m) => m.images?.length);
    if (withImages && d.imagesBlocked()) {
      d.error(`the chat holds images: ${d.imagesBlocked()}`, "no_vision");
      return false;
    }
    const formatError = cont ? "" : d.formatError();
    if (formatError) {
      d.error(`fix the reply format first: ${formatError}`, "invalid_settings");
      return false;
    }
    const req = d.settings.request();
    // a reply's text as the model wrote it: the server moves its thinking where the template reads it
    const wire = toWire(messages.slice(0, cont ? messages.length : -1));
    const all = req.system.trim() ? [{ role: "system", content: req.system }, ...wire] : wire;
    const id = `r${++this.counter}-${newId()}`;
    /** @type {Record<string, unknown>} */
    const frame = { type: "generate", id, messages: all, settings: req.settings, max_new_tokens: req.max_new_tokens,
      stop: req.stop, alternatives: Math.max(1, req.alternatives), speculative: req.speculative };
    const model = d.model();
    if (model) {
      frame.model = model;
      conv.model = model;
    }
    const kwargs = d.templateKwargs(conv);
    if (kwargs) frame.chat_template_kwargs = kwargs;
    Object.assign(frame, d.toolFields(conv, messages.slice(0, -1), cont));
    if (cont) {
      frame.continue = true;
      const ids = prefixIds(reply);
      if (ids) frame.prefix_ids = ids;
    }
    // Continue and a branch go on under the reply's own format; a new reply takes the chat's (replyformat.js)
    const format = cont ? reply.format : d.format() ?? undefined;
    if (format) frame.response_format = format;
    if (withImages && req.image_max_tiles !== null) frame.image_max_tiles = req.image_max_tiles;
    const bytes = withImages ? new Blob([JSON.stringify(frame)]).size : 0;  // images travel as base64, every turn
    if (bytes > FRAME_BYTES) {
      d.error(`the chat's messages and images come to ${mib(bytes)}; a message to the server is at most `
        + `${mib(FRAME_BYTES)}: remove an image, or start a new chat`, "too_large");
      return false;
    }
    if (!d.connection.send(frame)) {
      d.error("the message could not be sent; it is kept in the input", "offline");
      return false;
    }
    delete reply.reason;
    delete reply.toolCalls;  // a continued reply's calls come again with its done
    reply.settings = req.settings;
    if (format) reply.format = format;
    if (model) reply.model = model;
    this.active = { id, conv, msg: reply, data: new ReplyData(reply), view: null, undo, typed, stopping: false,
      before: shownLength(reply), trimmed: 0 };
    conv.updated = Date.now();
    queueMicrotask(() => d.refresh());
    return true;
  }

  stop() {
    const a = this.active;
    if (!a || a.stopping) return;
    a.stopping = true;
    if (!this.d.connection.send({ type: "stop", id: a.id })) this.lost();
    this.d.refresh();
    window.setTimeout(() => {  // a stop the server never answers must not leave the page stuck
      if (this.active === a && a.stopping) this.fail("the server did not answer the stop", "stop_timeout");
    }, STOP_TIMEOUT_MS);
  }

  /** @param {ServerMessage} msg */
  onServer(msg) {
    const a = this.active;
    if (msg.type === "error" && a && msg.id === null) {
      this.fail(msg.message, msg.code);  // an error the server could not tie to a request: never leave the page stuck
      return;
    }
    if (msg.type === "error" && (msg.id === null || !a || msg.id !== a.id)) {
      this.d.error(msg.message, msg.code);
      return;
    }
    if (!a || !("id" in msg) || msg.id !== a.id) return;
    if (msg.type === "loading") {
      if (msg.state === "loading") {
        this.d.progress(`Loading ${msg.model} (${sizeText(msg.size_bytes ?? 0)})…`);
      } else {
        this.d.progress(`Loaded ${msg.model} in ${(msg.seconds ?? 0).toFixed(1)} s`);
        this.d.loaded(msg.loaded ?? []);
      }
    } else if (msg.type === "queued") {
      a.view?.queued(msg.position);
      this.d.progress(`Waiting in queue: position ${msg.position}`);
    } else if (msg.type === "start") {
      a.view?.started();
      a.trimmed = msg.trimmed_messages ?? 0;
      this.d.progress(`Reading the prompt: ${msg.prompt_tokens} tokens (${msg.reused_tokens} reused)`
        + (a.trimmed ? ` · ${trimmedNote(a.trimmed)}` : ""));
    } else if (msg.type === "chunk") {
      const pieces = a.data.apply(msg);
      a.view?.chunk(pieces);
      this.d.progress("");
      this.d.announce(msg.text, false);
      this.d.lib.saveSoon(a.conv);
    } else if (msg.type === "done") {
      this.finish(msg.reason, msg.stats, msg.tool_calls);
    } else if (msg.type === "error") {
      this.fail(msg.message, msg.code);
    }
  }

  /** The socket closed: the active request is lost. */
  lost() {
    if (this.active) this.fail("the connection to the server was lost", "disconnected");
  }

  /**
   * @param {string} reason
   * @param {import("./store.js").Stats | undefined} stats
   * @param {import("./toolwire.js").WireCall[] | undefined} calls the tool calls the reply made
   */
  finish(reason, stats, calls) {
    const a = /** @type {Active} */ (this.active);
    if (a.view) a.view.finish(reason, stats);
    else {
      a.msg.reason = reason;
      if (stats) a.msg.stats = stats;
    }
    this.d.announce("", true);
    this.end();
    this.d.afterReply(a.conv, a.msg, reason, calls);
  }

  /**
   * Ends the active request with an error: a reply with new text keeps it; otherwise the turn is taken back.
   * @param {string} text
   * @param {string} code
   */
  fail(text, code) {
    const a = /** @type {Active} */ (this.active);
    if (shownLength(a.msg) > a.before) {
      a.msg.reason = code === "disconnected" ? "interrupted" : "error";
    } else {
      a.undo();
      if (a.typed !== null) this.d.restoreInput(a.typed);  // nothing typed is lost: words and images
    }
    this.end();
    this.d.error(text, code);
  }

  end() {
    const a = /** @type {Active} */ (this.active);
    if (a.msg.tokens && a.msg.tokens.length === 0) delete a.msg.tokens;
    this.active = null;
    this.d.progress(a.trimmed ? `Note: ${trimmedNote(a.trimmed)}.` : "");
    this.d.lib.save(a.conv);
    this.d.refresh();
  }
}
