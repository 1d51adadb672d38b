// @ts-check
/**
 * The page's entry point: wires the connection, the conversation view, the composer, the sidebar, the heatmap and the
 * settings. Per-token alternatives are always requested (settings' "alternatives", at least 1), so that the heatmap
 * can be switched on for any reply, live or past, and the token data survives in localStorage.
 */

import { ChatView } from "./chat.js";
import { Connection, socketUrl } from "./connection.js";
import { TokenPopover } from "./popover.js";
import { SettingsPanel } from "./settings.js";
import { renderSidebar } from "./sidebar.js";
import { Library } from "./conversations.js";
import { Drawer, HeatmapControls } from "./panels.js";
import { newId } from "./store.js";

/**
 * @typedef {import("./store.js").Conversation} Conversation
 * @typedef {import("./store.js").Message} Message
 * @typedef {import("./reply.js").ReplyView} ReplyView
 * @typedef {import("./connection.js").ServerMessage} ServerMessage
 * @typedef {{id: string, conv: Conversation, msg: Message, view: ReplyView, typed: string | null,
 *            previous: Message | null, stopping: boolean, trimmed: number}} Active
 *   `typed`: the user's text of a fresh send (restored to the input if the request fails before any text);
 *   `previous`: the reply a regenerate replaced (put back if the new one fails).
 *   `trimmed`: how many of the oldest messages the server left out to fit the context (`start.trimmed_messages`).
 */

/** @template {HTMLElement} T @param {string} id @returns {T} */
const $ = (id) => /** @type {T} */ (document.getElementById(id));

const input = /** @type {HTMLTextAreaElement} */ ($("input"));
const sendBtn = /** @type {HTMLButtonElement} */ ($("send"));
const stopBtn = /** @type {HTMLButtonElement} */ ($("stop"));
const messagesEl = $("messages");
const conn = $("conn");
const activity = $("activity");

const settings = new SettingsPanel($("settings-form"));
const view = new ChatView(messagesEl, { onRegenerate: regenerate, onEdit: editLast });
const popover = new TokenPopover(messagesEl, $("popover"), () => heat.on);
const heat = new HeatmapControls(/** @type {HTMLInputElement} */ ($("heatmap")),
  /** @type {HTMLSelectElement} */ ($("heat-mode")), $("legend"), messagesEl, (on) => {
    view.setFocusable(on);
    if (!on) popover.hide();
  });
const drawer = new Drawer($("settings"), $("settings-open"), $("settings-close"));
const connection = new Connection(socketUrl(), { onState: showConn, onMessage: onServer, onClose: onConnectionLost });

const lib = new Library();
/** @type {Active | null} */
let active = null;
let requestCounter = 0;
const STOP_TIMEOUT_MS = 15000;

function refresh() {
  view.render(lib.current.messages);
  renderList();
  scrollToEnd(true);
}

function renderList() {
  const actions = { onSelect: selectConversation, onDelete: deleteConversation };
  renderSidebar($("conv-list"), lib.all, lib.current.id, active !== null, actions);
}

/** @param {boolean} force */
function scrollToEnd(force) {
  view.scrollToEnd(force);
}

/** @param {string} id */
function selectConversation(id) {
  if (active) return;
  lib.select(id);
  view.clearError();
  refresh();
  document.body.classList.remove("sidebar-open");
}

/** @param {string} id */
function deleteConversation(id) {
  if (active && active.conv.id === id) return;
  lib.remove(id);
  refresh();
}

/**
 * @param {import("./connection.js").ConnState} state
 * @param {string} detail
 */
function showConn(state, detail) {
  conn.dataset.state = state;
  conn.textContent = state === "open" ? "connected" : detail;
  updateButtons();
}

function updateButtons() {
  const streaming = active !== null;
  sendBtn.hidden = streaming;
  stopBtn.hidden = !streaming;
  stopBtn.disabled = active?.stopping ?? false;
  stopBtn.textContent = active?.stopping ? "Stopping…" : "Stop";
  sendBtn.disabled = !connection.isOpen;
  sendBtn.title = connection.isOpen ? "Send (Enter)" : "Not connected; your text stays here until it reconnects";
}

/** @param {ServerMessage} msg */
function onServer(msg) {
  if (msg.type === "hello") return applyHello(msg);
  if (msg.type === "error" && active && msg.id === null) {
    fail(msg.message, msg.code); // an error the server could not tie to a request: never leave the page stuck
    return;
  }
  if (msg.type === "error" && (msg.id === null || !active || msg.id !== active.id)) {
    view.showError(msg.message, msg.code);
    return;
  }
  if (!active || !("id" in msg) || msg.id !== active.id) return;
  const a = active;
  if (msg.type === "queued") {
    a.view.queued(msg.position);
    activity.textContent = `Waiting in queue: position ${msg.position}`;
  } else if (msg.type === "start") {
    a.view.started();
    a.trimmed = msg.trimmed_messages ?? 0;
    activity.textContent = `Reading the prompt: ${msg.prompt_tokens} tokens (${msg.reused_tokens} reused)`
      + (a.trimmed ? ` · ${trimmedNote(a.trimmed)}` : "");
  } else if (msg.type === "chunk") {
    a.view.chunk(msg);
    activity.textContent = "";
    scrollToEnd(false);
    lib.saveSoon();
  } else if (msg.type === "done") {
    a.view.finish(msg.reason, msg.stats);
    endRequest();
  } else if (msg.type === "error") {
    fail(msg.message, msg.code);
  }
}

/** @param {import("./connection.js").Hello} hello */
function applyHello(hello) {
  $("model-name").textContent = hello.model;
  document.title = `webchat · ${hello.model}`;
  $("model-info").textContent = `${hello.device} · ${hello.dtype} · context ${hello.context_length}`;
  settings.setServerLimits(hello);
}

function onConnectionLost() {
  if (active) fail("the connection to the server was lost", "disconnected");
}

/**
 * Ends the active request with an error: a reply with text keeps it; otherwise the turn is undone and the user's
 * typed text goes back into the input.
 * @param {string} text
 * @param {string} code
 */
function fail(text, code) {
  const a = /** @type {Active} */ (active);
  if (a.msg.content !== "") {
    a.view.finish(code === "disconnected" ? "interrupted" : "error", undefined);
  } else {
    a.conv.messages.splice(a.conv.messages.indexOf(a.msg), 1);
    if (a.previous) a.conv.messages.push(a.previous);
    if (a.typed !== null) {
      a.conv.messages.pop();
      input.value = input.value.trim() === "" ? a.typed : `${a.typed}\n${input.value}`;
      saveDraft();
    }
  }
  endRequest();
  view.showError(text, code);
  scrollToEnd(true);
}

/** @param {number} n */
function trimmedNote(n) {
  return `the ${n} oldest message${n === 1 ? " was" : "s were"} left out to fit the model's context`;
}

function endRequest() {
  const trimmed = active?.trimmed ?? 0;
  active = null;
  activity.textContent = trimmed ? `Note: ${trimmedNote(trimmed)}.` : "";
  lib.save();
  refresh();
  updateButtons();
}

/**
 * Starts a reply to the conversation as it stands (its last message is the user's).
 * @param {string | null} typed
 * @param {Message | null} previous
 * @returns {boolean} false when nothing was sent (the reason is shown)
 */
function generate(typed, previous) {
  const invalid = settings.validateAll();
  if (invalid.length > 0) {
    view.showError(`fix the settings first: ${invalid.join(", ")}`, "invalid_settings");
    drawer.open(true);
    return false;
  }
  if (!connection.isOpen) {
    view.showError("not connected to the server; your message is kept, send it again once reconnected", "offline");
    return false;
  }
  const req = settings.request();
  const conv = lib.current;
  const history = conv.messages.map((m) => ({ role: m.role, content: m.content }));
  const messages = req.system.trim() ? [{ role: "system", content: req.system }, ...history] : history;
  const id = `r${++requestCounter}-${newId()}`;
  const ok = connection.send({
    type: "generate", id, messages, settings: req.settings, max_new_tokens: req.max_new_tokens,
    stop: [], alternatives: Math.max(1, req.alternatives), speculative: req.speculative,
  });
  if (!ok) {
    view.showError("the message could not be sent; it is kept in the input", "offline");
    return false;
  }
  /** @type {Message} */
  const msg = { role: "assistant", content: "" };
  conv.updated = Date.now();
  view.clearError();
  view.render(conv.messages);
  conv.messages.push(msg);
  active = { id, conv, msg, view: view.startReply(msg), typed, previous, stopping: false, trimmed: 0 };
  renderList();
  updateButtons();
  scrollToEnd(true);
  return true;
}

function send() {
  const text = input.value;
  const messages = lib.current.messages;
  if (active || text.trim() === "") return;
  messages.push({ role: "user", content: text });
  if (generate(text, null)) {
    input.value = "";
    saveDraft();
  } else {
    messages.pop();
  }
}

function stop() {
  if (!active || active.stopping) return;
  active.stopping = true;
  const id = active.id;
  if (!connection.send({ type: "stop", id })) onConnectionLost();
  updateButtons();
  window.setTimeout(() => { // a stop the server never answers must not leave the page stuck
    if (active && active.id === id && active.stopping) fail("the server did not answer the stop", "stop_timeout");
  }, STOP_TIMEOUT_MS);
}

function regenerate() {
  const messages = lib.current.messages;
  const last = messages[messages.length - 1];
  if (active || !last || last.role !== "assistant") return;
  messages.pop();
  if (!generate(null, last)) messages.push(last);
}

function editLast() {
  const messages = lib.current.messages;
  const i = messages.map((m) => m.role).lastIndexOf("user");
  if (active || i < 0) return;
  const text = messages[i].content;
  messages.splice(i);
  lib.save();
  refresh();
  input.value = text;
  saveDraft();
  input.focus();
}

function saveDraft() {
  sessionStorage.setItem("webchat.draft", input.value);
}

input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
input.addEventListener("input", saveDraft);
$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
stopBtn.addEventListener("click", stop);
document.addEventListener("keydown", (e) => {
  if (e.key !== "Escape") return;
  if (active) stop();
  else if (drawer.isOpen) drawer.close();
  else popover.hide();
});
$("new-chat").addEventListener("click", () => {
  if (active) return;
  lib.startNew();
  refresh();
  input.focus();
});
$("settings-form").addEventListener("submit", (e) => e.preventDefault());
$("sidebar-toggle").addEventListener("click", () => {
  const open = document.body.classList.toggle("sidebar-open");
  $("sidebar-toggle").setAttribute("aria-expanded", String(open));
});
input.value = sessionStorage.getItem("webchat.draft") ?? "";
heat.apply();
refresh();
updateButtons();
connection.open();
