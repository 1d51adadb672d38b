// @ts-check
/**
 * The page's entry point: wires the connection, the conversation view, the composer, the sidebar (search, rename,
 * export, import), the heatmap and the settings. Per-token alternatives are always requested (at least 1), so the
 * heatmap can be switched on for any reply, live or past, and the token data is kept with the conversation.
 */

import { Announcer } from "./announce.js";
import { Attachments } from "./attach.js";
import { ChatView } from "./chat.js";
import { Connection, socketUrl } from "./connection.js";
import { Library } from "./conversations.js";
import { ImageViewer } from "./imageview.js";
import { ModelPicker, describe } from "./models.js";
import { Drawer, HeatmapControls } from "./panels.js";
import { TokenPopover, nextLowConfidence } from "./popover.js";
import { download, fileName, readExport } from "./portability.js";
import { Presets } from "./presets.js";
import { tokenIndex } from "./reply.js";
import { ReplyFormatField } from "./replyformat.js";
import { SettingsPanel } from "./settings.js";
import { Scorer } from "./score.js";
import { renderSidebar } from "./sidebar.js";
import { titleOf } from "./store.js";
import { ThinkSwitch } from "./thinking.js";
import { ToolLoop, settleStored } from "./tools.js";
import { ToolsPanel } from "./toolspanel.js";
import { path, removeVersion, show } from "./tree.js";
import { Turns } from "./turns.js";

/** @template {HTMLElement} T @param {string} id @returns {T} */
const $ = (id) => /** @type {T} */ (document.getElementById(id));

const input = /** @type {HTMLTextAreaElement} */ ($("input"));
const sendBtn = /** @type {HTMLButtonElement} */ ($("send"));
const stopBtn = /** @type {HTMLButtonElement} */ ($("stop"));
const search = /** @type {HTMLInputElement} */ ($("search"));
const messagesEl = $("messages");
const activity = $("activity");
const scoreInput = /** @type {HTMLTextAreaElement} */ ($("score-input"));

const settings = new SettingsPanel($("settings-form"));
new Presets($("settings-form"), settings);
const lib = await Library.load();
settleStored(lib.all);  // tool calls a closed page left waiting or running are not run
const replyFormat = new ReplyFormatField($("settings-form"), (conv) => lib.save(conv));
const announcer = new Announcer($("announcer"));
const connection = new Connection(socketUrl(), {
  onState: showConn, onClose: () => { turns.lost(); scorer.lost(); tools.lost(); },
  onMessage: (m) => (m.type === "hello" ? applyHello(m) : m.type === "tools" ? toolsPanel.set(m)
    : tools.onServer(m) || scorer.onServer(m) || turns.onServer(m)),
});
const turns = new Turns({
  connection, lib, settings, refresh, error: (text, code) => view.showError(text, code),
  progress: (text) => { if (activity.textContent !== text) activity.textContent = text; },  // no DOM write per chunk
  announce: (text, final) => announcer.add(text, final),
  restoreInput: ({ text, images }) => {
    if (text !== "") input.value = input.value.trim() === "" ? text : `${text}\n${input.value}`;
    attachments.restore(images);
    saveDraft();
  },
  imagesBlocked: () => attachments.blocked,
  model: () => picker.value,
  loaded: (names) => picker.markLoaded(names),
  format: () => replyFormat.value(),
  formatError: () => replyFormat.error(),
  templateKwargs: (conv) => think.kwargs(conv),
  toolFields: (conv, history, cont) => tools.fields(conv, history, cont),
  afterReply: (conv, msg, reason, calls) => tools.afterReply(conv, msg, reason, calls),
});
const tools = new ToolLoop({
  connection, lib, turns, refresh, error: (text, code) => view.showError(text, code),
  progress: (text) => { activity.textContent = text; }, rounds: () => settings.toolRounds(),
  ready: () => toolsPanel.ready(),
});
const toolsPanel = new ToolsPanel($("tools-view"), /** @type {HTMLButtonElement} */ ($("tools-open")),
  (conv) => lib.save(conv), () => settings.limits.contextLength);
const think = new ThinkSwitch($("think-switch"), /** @type {HTMLInputElement} */ ($("think")), (on) => {
  lib.current.think = on;
  lib.save();
});
/** @type {import("./connection.js").Hello["thinking"]} the default model's thinking (hello) */
let defaultThinking = null;
/** The default model's name and images (hello.vision); whether any served model reads images. */
const served = { model: "", vision: /** @type {import("./connection.js").Vision | null} */ (null), anyVision: false };
const attachments = new Attachments({ composer: $("composer"), input,
  button: /** @type {HTMLButtonElement} */ ($("attach")), picker: /** @type {HTMLInputElement} */ ($("attach-file")),
  list: $("attachments"), refuse: (text) => view.showError(text, "image_refused") });
const viewer = new ImageViewer(/** @type {HTMLDialogElement} */ ($("image-view")));
const scorer = new Scorer({
  connection, lib, settings, refresh, error: (text, code) => view.showError(text, code),
  progress: (text) => { activity.textContent = text; },
  models: () => picker.cards.map((c) => c.name), model: () => picker.value, busy: () => tools.busy,
});
/** The header while a model is picked: its name and what it is; with one model, hello's line stays. */
const picker = new ModelPicker(/** @type {HTMLSelectElement} */ ($("model-picker")), (card) => {
  $("model-name").hidden = card !== null;
  if (card) {
    $("model-info").textContent = describe(card);
    document.title = `webchat · ${card.name}`;
  }
  think.setModel(card && !card.default ? card.thinking : defaultThinking);
  attachments.setModel(card?.name ?? served.model, card ? Boolean(card.vision) : served.vision !== null,
    served.anyVision, served.vision?.max_images ?? 16);
});
const view = new ChatView(messagesEl, {
  onEdit: (step, text) => turns.edit(step, text),
  onRegenerate: (step) => turns.regenerate(step),
  onContinue: (step) => turns.continueReply(step),
  onDelete: (step) => {
    removeVersion(lib.current, step.thread);
    lib.save();
    refresh();
  },
  onVersion: (step, delta) => {
    show(step.thread, step.thread.current + delta);
    lib.save();
    refresh();
  },
  onImage: (img) => viewer.open(img),
  score: { state: (step) => scorer.scoreState(step), onScore: (step) => scorer.onScore(step),
    decorate: (el, step) => scorer.decorate(el, step) },
});
const popover = new TokenPopover(messagesEl, $("popover"), {
  enabled: (span) => heat.on || span.closest(".score, .tool-call") !== null,  // a call's tokens: always coloured
  canPick: (span) => !tools.busy && connection.isOpen && span.closest(".score") === null,
  settingsOf: (span) => stepOf(span)?.msg.settings,
  onPick: (span, alt) => {
    const step = stepOf(span);
    const k = tokenIndex.get(span);
    if (step && k !== undefined) turns.branch(step, k, alt);
  },
});
const heat = new HeatmapControls(/** @type {HTMLInputElement} */ ($("heatmap")),
  /** @type {HTMLSelectElement} */ ($("heat-mode")), $("legend"), messagesEl, (on) => {
    view.setFocusable(on);
    if (!on) popover.hide();
  });
const drawer = new Drawer($("settings"), $("settings-open"), $("settings-close"));

/**
 * The step of the shown path whose reply holds this token span.
 * @param {HTMLElement} span
 */
function stepOf(span) {
  const el = span.closest(".msg");
  const i = [...messagesEl.querySelectorAll(".msg")].indexOf(/** @type {Element} */ (el));
  return i < 0 ? null : path(lib.current)[i] ?? null;
}

function refresh() {
  const a = turns.active;
  const live = a && a.conv === lib.current ? a.msg : null;
  const liveView = view.render(path(lib.current), live, tools.busy || scorer.active !== null);
  if (a) a.view = liveView;
  scorer.renderText(scoreInput, $("score-result"));
  if (replyFormat.conv !== lib.current || !a) replyFormat.show(lib.current);
  think.show(lib.current);
  toolsPanel.show(lib.current);
  renderList();
  updateButtons();
  view.scrollToEnd(true);
}

function renderList() {
  const actions = {
    onSelect: (/** @type {string} */ id) => {
      lib.select(id);
      picker.pick(lib.current.model);
      view.clearError();
      refresh();
      document.body.classList.remove("sidebar-open");
    },
    onDelete: (/** @type {string} */ id) => {
      lib.remove(id);
      refresh();
    },
    onRename: (/** @type {string} */ id, /** @type {string} */ title) => {
      lib.rename(id, title);
      renderList();
    },
    onExport: (/** @type {string} */ id) => {
      const conv = lib.all.find((c) => c.id === id);
      if (conv) download([conv], fileName(titleOf(conv)));
    },
  };
  renderSidebar($("conv-list"), lib.search(search.value), lib.current.id, turns.active?.conv.id ?? null, actions);
}

/**
 * @param {import("./connection.js").ConnState} state
 * @param {string} detail
 */
function showConn(state, detail) {
  const conn = $("conn");
  conn.dataset.state = state;
  conn.textContent = state === "open" ? "connected" : detail;
  updateButtons();
}

function updateButtons() {
  const a = turns.active ?? tools.running;  // a reply streaming, or a tool call running
  const here = a !== null && a.conv === lib.current;
  sendBtn.hidden = here;
  stopBtn.hidden = !here;
  stopBtn.disabled = a?.stopping ?? false;
  stopBtn.textContent = a?.stopping ? "Stopping…" : "Stop";
  sendBtn.disabled = !connection.isOpen || a !== null || scorer.active !== null;
  sendBtn.title = !connection.isOpen ? "Not connected; your text stays here until it reconnects"
    : a ? "A reply is still streaming in another chat" : "Send (Enter)";
}

// the header's words for each precision (docs/quant.md): [short, the line's title]
/** @type {Record<string, [string, string]>} */
const ACTIVATIONS = {
  exact: ["exact", "float32 activations (within float rounding of the float32 model on these weights)"],
  int8: ["int8 activations", "int8 activations: each matrix input quantized to 8 bits, a scale per 8 values (per 32 "
    + "in a K-quant; faster; prompt scores exact; docs/quant.md)"],
  int8x2: ["int8x2 activations", "int8x2 activations: each matrix input as two 8-bit rows, the value and its "
    + "rounding's residual (about 15 bits: the exact path's greedy text at int8's speed; prompt scores exact; "
    + "docs/quant.md)"],
};

/** @param {import("./connection.js").Hello} hello */
function applyHello(hello) {
  $("model-name").textContent = hello.model;
  document.title = `webchat · ${hello.model}`;
  // quantized weights: what they are and what they multiply (the activations' float32 goes without saying)
  const quantized = hello.weights && hello.weights !== hello.dtype
    ? `${hello.weights} weights · ${ACTIVATIONS[hello.precision ?? "exact"]?.[0] ?? hello.precision}` : hello.dtype;
  const info = $("model-info");
  const engine = hello.engine;
  if (engine) {
    info.textContent = `${engine.kind} at ${engine.url} · context ${engine.context_length ?? "not given"}`;
    info.dataset.engineState = engine.state;
    const heat = engine.state !== "ready" ? `upstream ${engine.state}${engine.error ? `: ${engine.error}` : ""}`
      : [`probabilities ${engine.probabilities}`,
        engine.max_top_logprobs ? `top ${engine.max_top_logprobs} alternatives` : "no alternatives",
        "rank within the top k", `token ids ${engine.token_ids}`, `bytes ${engine.bytes}`,
        `continue via ${engine.continue_final}`,
        `branches as ${engine.token_prompt === "tokenize" || engine.token_prompt === "apply_template"
          ? `token ids (${engine.token_prompt})` : "text"}`].join(" · ");
    const el = $("engine-info");
    el.textContent = `heatmap: ${heat}`;
    el.title = el.textContent;
    el.hidden = false;
    el.dataset.state = engine.state;
  } else {
    info.textContent = `${hello.device} · ${quantized} · context ${hello.context_length}`;
    info.dataset.precision = hello.precision ?? "exact";
    // the line in full first: a narrow header cuts it with an ellipsis
    info.title = `${info.textContent}\n` + (ACTIVATIONS[hello.precision ?? "exact"] ?? ACTIVATIONS.exact)[1];
  }
  settings.setServerLimits(hello);
  defaultThinking = hello.thinking ?? null;
  served.model = hello.model;
  served.vision = hello.vision ?? null;
  served.anyVision = served.vision !== null || (hello.models ?? []).some((m) => m.vision);
  scorer.setEngine(hello);
  picker.set(hello.models, lib.current.model ?? null);
}

function send() {
  if (tools.busy || scorer.active) return;
  view.clearError();
  if (turns.ask(input.value, attachments.images)) {
    tools.skipPending(lib.current);  // calls of the last reply still waiting are not run
    input.value = "";
    attachments.take();
    saveDraft();
  } else if (turns.d.settings.validateAll().length > 0) {
    drawer.open(true);
  }
}

function saveDraft() {
  sessionStorage.setItem("webchat.draft", input.value);
}

/** @param {File} file */
async function importFile(file) {
  try {
    const added = lib.importMany(await readExport(file));
    $("import-status").textContent = `Imported ${added} conversation${added === 1 ? "" : "s"}`;
  } catch (err) {
    $("import-status").textContent = `Import failed: ${err instanceof Error ? err.message : String(err)}`;
  }
  renderList();
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
stopBtn.addEventListener("click", () => (tools.running ? tools.stop() : turns.stop()));
document.addEventListener("keydown", (e) => {
  if (e.key !== "Escape" || viewer.isOpen) return;  // the viewer's Escape closes the viewer, nothing else
  if (tools.running && tools.running.conv === lib.current) tools.stop();
  else if (turns.active && turns.active.conv === lib.current) turns.stop();
  else if (drawer.isOpen) drawer.close();
  else popover.hide();
});
$("new-chat").addEventListener("click", () => {
  lib.startNew();
  refresh();
  input.focus();
});
search.addEventListener("input", renderList);
$("export-all").addEventListener("click", () => download(lib.all.filter((c) => c.root !== null), fileName("all")));
const importInput = /** @type {HTMLInputElement} */ ($("import-file"));
$("import").addEventListener("click", () => importInput.click());
importInput.addEventListener("change", () => {
  const file = importInput.files?.[0];
  if (file) importFile(file).finally(() => { importInput.value = ""; });
});
$("next-low").addEventListener("click", () => {
  const focused = document.activeElement instanceof HTMLElement && document.activeElement.classList.contains("tok")
    ? document.activeElement : null;
  if (!nextLowConfidence(messagesEl, focused, 1)) activity.textContent = "No low-confidence token here.";
});
$("settings-form").addEventListener("submit", (e) => e.preventDefault());
new TokenPopover($("score-view"), $("score-popover"), {
  enabled: () => true, canPick: () => false, onPick: () => {}, settingsOf: () => undefined,
});
$("score-text-open").addEventListener("click", () => {
  const open = $("score-view").hidden;
  $("score-view").hidden = !open;
  $("score-text-open").setAttribute("aria-expanded", String(open));
  if (open) scoreInput.focus();
});
$("score-close").addEventListener("click", () => {
  $("score-view").hidden = true;
  $("score-text-open").setAttribute("aria-expanded", "false");
});
$("score-form").addEventListener("submit", (e) => {
  e.preventDefault();
  view.clearError();
  scorer.scoreText(scoreInput.value, null);
});
$("sidebar-toggle").addEventListener("click", () => {
  const open = document.body.classList.toggle("sidebar-open");
  $("sidebar-toggle").setAttribute("aria-expanded", String(open));
});
tools.attach(messagesEl);
input.value = sessionStorage.getItem("webchat.draft") ?? "";
heat.apply();
refresh();
connection.open();
document.body.dataset.ready = "true";
