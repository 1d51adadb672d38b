// @ts-check
/** The websocket to `/ws` (docs/protocol.md): JSON frames, connection state, automatic reconnect with backoff. */

/**
 * @typedef {"connecting" | "open" | "reconnecting" | "closed"} ConnState
 * @typedef {{type: "hello", v: number, model: string, context_length: number, device: string, dtype: string,
 *            weights?: string, precision?: string, speculative: string[], max_alternatives: number,
 *            engine?: Engine | null, models?: import("./models.js").ModelCard[] | null,
 *            thinking?: {start: string, end: string, switch: boolean} | null, vision?: Vision | null}} Hello
 * @typedef {{projector: string, image_size?: number, tokens_per_tile?: number, max_tiles?: number,
 *            max_images?: number, formats?: string[]}} Vision
 *   The default model reads images (docs/protocol.md, hello.vision); `projector` "upstream" behind --engine-url.
 * @typedef {{url: string, state: string, error: string | null, kind: string, models: string[], model: string | null,
 *            context_length: number | null, max_top_logprobs: number, probabilities: string, bytes: string,
 *            token_ids: string, continue_final: string, token_prompt: string, prompt_logprobs?: string}} Engine
 *   A remote engine's probed capabilities (`webchat serve --engine-url`, docs/scale-out.md).
 * @typedef {{id: number, text: string, p: number | null, rank: number | null,
 *            top: {id: number, text: string, p: number}[], sampled_p?: number | null, forbidden?: number[],
 *            part?: "thinking", raw?: string}} WireToken
 *   `id` -1, `p` / `rank` null: a remote engine did not return them. `part` "thinking": a token of the thinking;
 *   `raw`: the text it wrote where that differs from `text` (a marker).
 * @typedef {{type: "queued", id: string, position: number}
 *         | {type: "start", id: string, prompt_tokens: number, reused_tokens: number, trimmed_messages?: number}
 *         | {type: "chunk", id: string, text: string, thinking?: string, tokens?: WireToken[]}
 *         | {type: "done", id: string, reason: string, trigger?: unknown, stats: import("./store.js").Stats,
 *            tool_calls?: import("./toolwire.js").WireCall[]}
 *         | {type: "tools", servers: ToolServer[], max_result_chars: number}
 *         | {type: "tool_result", id: string, name: string, text: string, is_error: boolean, error: string | null,
 *            truncated: boolean, total_chars: number, ms: number}
 *         | {type: "error", id: string | null, code: string, message: string}
 *         | {type: "loading", id: string, model: string, state: "loading" | "loaded", size_bytes?: number,
 *            estimate_bytes?: number, seconds?: number, loaded?: string[]}
 *         | {type: "scored", id: string, model: string, tokens: WireToken[], stats: import("./store.js").Stats}
 *         | Hello} ServerMessage
 * @typedef {{name: string, transport: string, state: string, message: string, notes: string[],
 *            retry_in_s: number | null, tools: ServerTool[]}} ToolServer  an MCP server of --mcp-config (issue 66)
 * @typedef {{name: string, tool: string, title: string | null, description: string,
 *            parameters: Record<string, unknown>, tokens: number}} ServerTool
 *   `name` is what the model calls it by (`server__tool`), `tokens` about what its definition takes of the context.
 * @typedef {{onState: (state: ConnState, detail: string) => void, onMessage: (msg: ServerMessage) => void,
 *            onClose: () => void}} Handlers
 */

/** Protocol version this page speaks. */
export const PROTOCOL_VERSION = 1;
const BACKOFF_MS = [250, 500, 1000, 2000, 4000, 8000];

/** One websocket, reopened after it closes (backoff 0.25 s → 8 s; at once when the tab becomes visible). */
export class Connection {
  /**
   * @param {string} url
   * @param {Handlers} handlers
   */
  constructor(url, handlers) {
    this.url = url;
    this.handlers = handlers;
    /** @type {WebSocket | null} */
    this.ws = null;
    this.attempt = 0;
    /** @type {number | undefined} */
    this.timer = undefined;
    /** @type {ConnState} */
    this.state = "closed";
    document.addEventListener("visibilitychange", () => {
      if (document.visibilityState === "visible" && this.state === "reconnecting") this.reconnectNow();
    });
    window.addEventListener("online", () => this.reconnectNow());
  }

  /** @param {ConnState} state @param {string} detail */
  setState(state, detail) {
    this.state = state;
    this.handlers.onState(state, detail);
  }

  open() {
    window.clearTimeout(this.timer);
    this.setState(this.attempt === 0 ? "connecting" : "reconnecting", "connecting…");
    const ws = new WebSocket(this.url);
    this.ws = ws;
    ws.addEventListener("open", () => {
      this.attempt = 0;
      this.setState("open", "connected");
    });
    ws.addEventListener("message", (ev) => this.receive(ev.data));
    ws.addEventListener("close", () => {
      if (this.ws !== ws) return;
      this.ws = null;
      this.handlers.onClose();
      this.scheduleReconnect();
    });
  }

  /** @param {unknown} data */
  receive(data) {
    if (typeof data !== "string") return;
    let msg;
    try {
      msg = JSON.parse(data);
    } catch {
      console.warn("webchat: a frame that is not JSON", data);
      return;
    }
    if (msg && typeof msg === "object" && typeof msg.type === "string") this.handlers.onMessage(msg);
  }

  scheduleReconnect() {
    const delay = BACKOFF_MS[Math.min(this.attempt, BACKOFF_MS.length - 1)];
    this.attempt += 1;
    this.setState("reconnecting", `reconnecting in ${(delay / 1000).toFixed(delay < 1000 ? 2 : 0)} s`);
    this.timer = window.setTimeout(() => this.open(), delay);
  }

  reconnectNow() {
    if (this.ws !== null) return;
    window.clearTimeout(this.timer);
    this.open();
  }

  /** @returns {boolean} */
  get isOpen() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  /**
   * Sends one message; false when the socket is not open (nothing is sent).
   * @param {Record<string, unknown>} msg
   * @returns {boolean}
   */
  send(msg) {
    if (!this.isOpen || this.ws === null) return false;
    this.ws.send(JSON.stringify(msg));
    return true;
  }
}

/** @returns {string} ws:// or wss:// URL of `/ws` on the page's own origin */
export function socketUrl() {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  return `${proto}//${location.host}/ws`;
}
