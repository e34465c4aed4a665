// The header's two badges and what they stand for. The page is connected only when the socket is open AND the model
// is ready (GET /ready): this module owns both watchers, and reads the model card (name, backend, limits) once the
// model is ready, when the card's "(loading)" and its limits are final.
import {readLimits} from "./config.js";
import {connectSocket, request, watchReadiness} from "./transport.js";
import {$} from "./ui.js";

const state = {socketState: "connecting", socketText: "connecting…", isModelReady: false, loadingReason: ""};
let socket = null;
let readiness = null;
let onChange = () => {};

export const isSocketOpen = () => state.socketState === "open";
export const isModelLoading = () => isSocketOpen() && !state.isModelReady;
export const isConnected = () => isSocketOpen() && state.isModelReady && socket.isOpen();

// `onMessage` gets the socket's frames, `onDrop` runs when it closes, `onConnectionChange` after each change.
export function startConnection({onMessage, onDrop, onConnectionChange}) {
  onChange = onConnectionChange;
  readiness = watchReadiness(onReadiness);
  socket = connectSocket(onMessage, onSocketState, onDrop);
}

export function checkReadiness() {
  readiness.check();
}

export const send = (message) => socket.send(message);

// An error said the model went away (restarting, busy): Send waits until GET /ready answers again.
export function recheckModel() {
  state.isModelReady = false;
  showConnection();
  readiness.check();
}

// A new API key: the socket authenticates again and the card may now be readable.
export function reconnect() {
  socket.reconnect();
  loadModelCard();
}

function showConnection() {
  const badge = $("conn-badge");
  const isLoading = isModelLoading();
  badge.dataset.state = isLoading ? "loading" : state.socketState;
  badge.textContent = isLoading ? "model loading…" : state.socketText;
  badge.title = isLoading ? state.loadingReason : "";
  onChange();
}

function onSocketState(socketState, text) {
  Object.assign(state, {socketState, socketText: text});
  if (socketState === "open") readiness.check();  // a reconnect may follow a server restart
  showConnection();
}

function onReadiness(isReady, reason) {
  const becameReady = isReady && !state.isModelReady;
  Object.assign(state, {isModelReady: isReady, loadingReason: reason});
  showConnection();
  if (becameReady) loadModelCard();
}

// A local model folder shows as its last part; a hub id like org/name stays whole.
function displayName(modelId) {
  const isPath = /^([/.~]|[A-Za-z]:\\)/.test(modelId);
  return isPath ? modelId.replace(/[/\\]+$/, "").split(/[/\\]/).pop() : modelId;
}

export async function loadModelCard() {
  const badge = $("model-badge");
  try {
    const {data} = await request("v1/models");
    const model = data.data[0];
    readLimits(model);
    if (model.max_model_len) $("max_tokens").max = String(model.max_model_len);
    const parts = [displayName(model.id), model.architecture, model.backend, model.weights || model.dtype,
      model.device]
      .filter(Boolean);
    badge.textContent = parts.join(" · ") + (model.ready ? "" : " (loading)");
    badge.title = [`model: ${model.id}`, model.backend_reason && `backend: ${model.backend_reason}`,
      model.weight_types && Object.keys(model.weight_types).length &&
        `weights in the file: ${Object.entries(model.weight_types).map(([t, n]) => `${t} x${n}`).join(", ")}`,
      model.compute && `compute: ${model.compute}`, model.compute_reason && `why: ${model.compute_reason}`]
      .filter(Boolean).join("\n");
    badge.classList.remove("bad");
  } catch (err) {
    badge.textContent = `model: unavailable (${err.message})`;
    badge.classList.add("bad");
  }
}
