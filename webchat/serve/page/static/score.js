// @ts-check
/**
 * Scoring (protocol `score` → `scored`): any message, the user's own included, shown as the model read it ("Score"
 * on the message, in its chat), a pasted text ("Score a text"), and the same text under another model side by side
 * ("Score with…"). Scores are kept with the chat: a message's on the message (`scores`), a pasted text's on the
 * conversation (`scoredText`). One request at a time on the socket, as a reply is.
 */

import { mergeParts } from "./reply.js";
import { savedMode, saveMode, scorePanel } from "./scoreview.js";
import { newId } from "./store.js";
import { path } from "./tree.js";

/**
 * @typedef {import("./heatmap.js").Tok} Tok
 * @typedef {import("./store.js").Message} Message
 * @typedef {import("./tree.js").Step} Step
 * @typedef {import("./tree.js").Conversation} Conversation
 * @typedef {import("./scoreview.js").Score} Score
 * @typedef {import("./scorecolor.js").ScoreMode} ScoreMode
 * @typedef {import("./connection.js").WireToken} WireToken
 * @typedef {{connection: import("./connection.js").Connection, lib: import("./conversations.js").Library,
 *   settings: import("./settings.js").SettingsPanel, models: () => string[], model: () => string | null,
 *   busy: () => boolean, refresh: () => void, error: (text: string, code: string) => void,
 *   progress: (text: string) => void}} Deps
 *   `models`: every model the server offers (empty with one); `model`: the picked one (null: the server's default).
 * @typedef {{id: string, done: (score: Score) => void, what: string}} Pending
 */

export const UNAVAILABLE = "scoring needs an engine with prompt logprobs";

/**
 * The scored tokens as the page keeps them: a character split over byte tokens merged into one (as replies do).
 * @param {WireToken[]} wire
 * @returns {Tok[]}
 */
export function scoredTokens(wire) {
  /** @type {Tok[]} */
  const out = [];
  /** @type {WireToken[]} */
  let parts = [];
  for (const t of wire) {
    parts.push(t);
    if (t.text === "") continue;
    out.push(mergeParts(parts));
    parts = [];
  }
  if (parts.length) out.push(mergeParts(parts));
  return out;
}

/**
 * A view added to a text's scores: the same model's replaces its old one; another model's becomes the second view.
 * @param {Score[] | undefined} scores
 * @param {Score} score
 * @returns {Score[]}
 */
export function withScore(scores, score) {
  const old = scores ?? [];
  const at = old.findIndex((s) => s.model === score.model);
  if (at >= 0) return old.map((s, i) => (i === at ? score : s));
  return old.length === 0 ? [score] : [old[0], score];
}

export class Scorer {
  /** @param {Deps} deps */
  constructor(deps) {
    this.d = deps;
    /** @type {Pending | null} */
    this.active = null;
    this.available = true;
    /** @type {ScoreMode} */
    this.mode = savedMode();
    this.counter = 0;
    /** @type {Conversation | null} */
    this.viewConv = null;
  }

  /**
   * hello: a remote engine without prompt logprobs cannot score (hello.engine.prompt_logprobs, docs/scale-out.md).
   * @param {import("./connection.js").Hello} hello
   */
  setEngine(hello) {
    this.available = !(hello.engine && hello.engine.prompt_logprobs === "absent");
  }

  /** Why a score cannot be asked for now, or "". */
  blocked() {
    if (!this.available) return `${UNAVAILABLE}; this upstream returns none`;
    if (!this.d.connection.isOpen) return "not connected to the server";
    if (this.active || this.d.busy()) return "a request is still running";
    return "";
  }

  /**
   * Sends one score request; `done` gets the scored view.
   * @param {Record<string, unknown>} what `messages` or `text`
   * @param {string | null} model
   * @param {string} label what the activity line says meanwhile
   * @param {(score: Score) => void} done
   */
  request(what, model, label, done) {
    const why = this.blocked();
    if (why) {
      this.d.error(why, this.available ? "busy" : "scoring_unavailable");
      return;
    }
    const id = `s${++this.counter}-${newId()}`;
    const alternatives = Math.max(1, this.d.settings.request().alternatives);
    const frame = { type: "score", id, alternatives, ...what, ...(model ? { model } : {}) };
    if (!this.d.connection.send(frame)) {
      this.d.error("the score could not be sent: not connected", "offline");
      return;
    }
    this.active = { id, done, what: label };
    this.d.progress(`Scoring ${label}…`);
    this.d.refresh();
  }

  /**
   * A server message for the score in flight; true when it was (the rest go to the replies).
   * @param {import("./connection.js").ServerMessage} msg
   * @returns {boolean}
   */
  onServer(msg) {
    const a = this.active;
    if (!a || !("id" in msg) || msg.id !== a.id) return false;
    if (msg.type === "scored") {
      this.active = null;
      this.d.progress("");
      a.done({ model: msg.model, tokens: scoredTokens(msg.tokens), at: Date.now() });
    } else if (msg.type === "error" || msg.type === "done") {
      this.active = null;
      this.d.progress("");
      if (msg.type === "error") this.d.error(msg.message, msg.code);
      this.d.refresh();
    } else if (msg.type === "loading") {
      this.d.progress(msg.state === "loading" ? `Loading ${msg.model}…` : `Loaded ${msg.model}; scoring ${a.what}…`);
    } else if (msg.type === "queued") {
      this.d.progress(`Waiting in queue to score: position ${msg.position}`);
    }
    return true;
  }

  /** The socket closed: the score in flight is lost. */
  lost() {
    if (!this.active) return;
    this.active = null;
    this.d.progress("");
    this.d.error("the connection to the server was lost while scoring", "disconnected");
  }

  // ------------------------------------------------------------ a message's score
  /**
   * The chat up to and including the step's message, with the system prompt, as a generate would send it.
   * @param {Step} step
   */
  chatUpTo(step) {
    const system = this.d.settings.request().system;
    const msgs = path(this.d.lib.current).slice(0, step.index + 1).map((s) => ({ role: s.msg.role, content: s.msg.content,
      ...(s.msg.toolCallId ? { tool_call_id: s.msg.toolCallId } : {}) }));  // a tool's result names its call
    return system.trim() ? [{ role: "system", content: system }, ...msgs] : msgs;
  }

  /**
   * Scores a message with `model` (its own model, the chat's, or the picked one when null).
   * @param {Step} step
   * @param {string | null} model
   */
  scoreStep(step, model) {
    const conv = this.d.lib.current;
    const msg = step.msg;
    const who = model ?? msg.model ?? conv.model ?? this.d.model();
    this.request({ messages: this.chatUpTo(step) }, who, msg.role === "user" ? "your message" : "the reply", (s) => {
      msg.scores = withScore(msg.scores, s);
      delete msg.scoreHidden;
      this.d.lib.save(conv);
      this.d.refresh();
    });
  }

  /**
   * The Score button: asks for a score, or shows / hides the one kept.
   * @param {Step} step
   */
  onScore(step) {
    const msg = step.msg;
    if (!msg.scores?.length) this.scoreStep(step, null);
    else {
      msg.scoreHidden = !msg.scoreHidden;
      this.d.lib.save(this.d.lib.current);
      this.d.refresh();
    }
  }

  /**
   * The Score button's label and state.
   * @param {Step} step
   * @returns {{label: string, disabled: boolean, title: string}}
   */
  scoreState(step) {
    const has = Boolean(step.msg.scores?.length);
    const images = path(this.d.lib.current).slice(0, step.index + 1).some((s) => s.msg.images?.length);
    const why = has ? "" : this.blocked() || (images ? "Scoring a chat that holds images is not done yet" : "");
    return { label: !has ? "Score" : step.msg.scoreHidden ? "Show score" : "Hide score", disabled: why !== "",
      title: why || "Show how the model reads this message: each token coloured by how likely it found it" };
  }

  /**
   * Adds the score panel under a message that has one shown.
   * @param {HTMLElement} el the message element
   * @param {Step} step
   */
  decorate(el, step) {
    const msg = step.msg;
    if (!msg.scores?.length || msg.scoreHidden) return;
    const panel = this.panel(msg.scores, (m) => this.scoreStep(step, m), () => {
      msg.scoreHidden = true;
      this.d.lib.save(this.d.lib.current);
      this.d.refresh();
    });
    el.querySelector(".msg-body")?.after(panel);
  }

  /**
   * @param {Score[]} scores
   * @param {(model: string) => void} onWith
   * @param {(() => void) | null} onHide
   * @returns {HTMLElement}
   */
  panel(scores, onWith, onHide) {
    const others = this.d.models().filter((m) => m !== scores[0].model);
    return scorePanel(scores, { mode: this.mode, others, onWith: others.length ? onWith : null, onHide,
      onMode: (m) => {
        this.mode = m;
        saveMode(m);
        this.d.refresh();
      } });
  }

  // ------------------------------------------------------------ "Score a text"
  /**
   * Scores the pasted text with `model` (the picked one when null); kept on the conversation.
   * @param {string} text
   * @param {string | null} model
   */
  scoreText(text, model) {
    if (text.trim() === "") return;
    const conv = this.d.lib.current;
    this.request({ text }, model ?? this.d.model(), "the text", (s) => {
      const same = conv.scoredText?.text === text;
      conv.scoredText = { text, scores: withScore(same ? conv.scoredText?.scores : undefined, s) };
      this.d.lib.save(conv);
      this.d.refresh();
    });
  }

  /**
   * Renders the pasted text's view: its text (kept per chat) and its score panel.
   * @param {HTMLTextAreaElement} input
   * @param {HTMLElement} result
   */
  renderText(input, result) {
    const conv = this.d.lib.current;
    if (this.viewConv !== conv) {
      this.viewConv = conv;
      input.value = conv.scoredText?.text ?? "";
    }
    const kept = conv.scoredText;
    result.replaceChildren();
    if (kept?.scores.length) {
      result.append(this.panel(kept.scores, (m) => this.scoreText(kept.text, m), null));
    }
  }
}
