// Talking to the server: REST calls, the chat socket (reconnecting by itself) and the readiness poll. No DOM here.
// The API key (when the server has one) lives in this tab's sessionStorage and travels only in the Authorization
// header and the socket's first frame: never in localStorage or a URL.
import {authCloseCode} from "./config.js";

const KEY_STORAGE = "lockstep.apiKey";

export const apiKey = () => sessionStorage.getItem(KEY_STORAGE) || "";

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

class ServerError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

function authHeaders() {
  const key = apiKey();
  return key ? {Authorization: `Bearer ${key}`} : {};
}

export async function request(path, body) {
  const options = {headers: authHeaders()};
  if (body !== undefined) {
    options.method = "POST";
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const started = performance.now();
  let response;
  try {
    response = await fetch(new URL(path, document.baseURI), options);
  } catch (err) {
    throw new ServerError("network_error", `could not reach the server (${err.message})`);
  }
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    const error = (data && data.error) || {};
    throw new ServerError(error.code || `http_${response.status}`,
                          error.message || `${response.status} ${response.statusText}`);
  }
  return {data, latencyMs: performance.now() - started};
}

function socketUrl() {
  const url = new URL("ws", document.baseURI);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  return url;
}

// A WebSocket that reconnects by itself (0.5 s, 1 s, 2 s ... up to 8 s) and reports its state. Its first frame
// authenticates it; it counts as open once the server answers "ready".
export function connectSocket(onMessage, onState, onDrop) {
  let ws = null;
  let attempts = 0;
  let isReady = false;
  let timer = null;

  function open() {
    timer = null;
    isReady = false;
    onState("connecting", attempts ? "reconnecting…" : "connecting…");
    ws = new WebSocket(socketUrl());
    ws.onopen = () => ws.send(JSON.stringify({type: "auth", api_key: apiKey()}));
    ws.onmessage = (event) => {
      let message;
      try {
        message = JSON.parse(event.data);
      } catch {
        return;
      }
      if (message.type === "ready") {
        isReady = true;
        attempts = 0;
        onState("open", "connected");
      } else if (isReady) {
        onMessage(message);
      }
    };
    ws.onclose = (event) => {
      ws = null;
      isReady = false;
      const delayMs = Math.min(8000, 500 * 2 ** attempts++);
      const why = event.code === authCloseCode ? "API key needed (Settings)" : "disconnected";
      onState("closed", `${why}, retrying in ${Math.ceil(delayMs / 1000)} s`);
      onDrop();
      timer = setTimeout(open, delayMs);
    };
  }

  open();
  return {
    isOpen: () => ws !== null && isReady && ws.readyState === WebSocket.OPEN,
    send(message) {
      if (!this.isOpen()) return false;
      ws.send(JSON.stringify(message));
      return true;
    },
    reconnect() {
      attempts = 0;
      if (ws) {
        ws.close();  // its onclose schedules the next attempt
      } else {
        clearTimeout(timer);
        open();
      }
    },
  };
}

// Polls GET /ready (0.5 s, 1 s, 2 s ... up to 4 s) until the model answers, then stops; `check()` starts it again
// (after a reconnect, or an error that says the model went away).
export function watchReadiness(onChange) {
  let delayMs = 500;
  let timer = null;
  let isChecking = false;

  async function poll() {
    timer = null;
    isChecking = true;
    let isReady = false;
    let reason = "";
    try {
      const response = await fetch(new URL("ready", document.baseURI), {cache: "no-store"});
      isReady = response.ok;
      if (!isReady) reason = ((await response.json().catch(() => null)) || {}).reason || "";
    } catch {
      reason = "the server does not answer";
    }
    isChecking = false;
    onChange(isReady, reason);
    if (isReady) {
      delayMs = 500;
    } else {
      timer = setTimeout(poll, delayMs);
      delayMs = Math.min(4000, delayMs * 2);
    }
  }

  return {
    check() {
      if (isChecking) return;
      clearTimeout(timer);
      poll();
    },
  };
}
