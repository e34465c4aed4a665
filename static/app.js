// lockstep chat page: streaming chat over /ws, single and batch modes over REST.
// Model output and server messages are only ever inserted as text (textContent / Text nodes), never as HTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  // The API key (when the server has one) lives in this tab's sessionStorage and travels only in the
  // Authorization header and the socket's first frame: never in a URL, where logs and Referers would keep it.
  const KEY_STORAGE = "lockstep.apiKey";
  const apiKey = () => sessionStorage.getItem(KEY_STORAGE) || "";
  const AUTH_CLOSE_CODE = 1008;
  const MAX_STOP_STRINGS = 8;
  const MAX_STOP_LENGTH = 200;
  const PRESETS = [
    ["KV cache", "Explain what a KV cache is in two sentences."],
    ["Haiku", "Write a haiku about the sea."],
    ["Primes", "List three prime numbers."],
    ["Completion", "The capital of France is"],
    ["Translate", "Translate into French: Good morning, my friend."],
  ];
  const FINISH_HINTS = {stop: "end of answer or stop string", length: "max tokens reached",
                        abort: "stopped", error: "failed"};

  let maxModelLen = 0;

  // ---- small DOM helpers ------------------------------------------------------------------------------

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function errorBox(code, message) {
    const box = el("div", "error");
    box.setAttribute("role", "alert");
    box.append(el("strong", "", code), el("span", "", ` ${message}`));
    return box;
  }

  function metaLine(items) {
    const line = el("p", "meta");
    for (const [key, text] of items) {
      const part = el("span", "", text);
      part.dataset.k = key;
      line.append(part);
    }
    return line;
  }

  function timingItems(timing, usage, finishReason) {
    const items = [];
    if (timing && timing.ttft_ms != null) items.push(["ttft", `TTFT ${Math.round(timing.ttft_ms)} ms`]);
    if (timing && timing.tokens_per_s != null) items.push(["tps", `${timing.tokens_per_s.toFixed(1)} tokens/s`]);
    if (usage) items.push(["tokens", `${usage.completion_tokens} tokens`]);
    items.push(["finish", finishReason]);
    return items;
  }

  function finishTitle(reason) {
    return FINISH_HINTS[reason] ? `finish reason: ${reason} (${FINISH_HINTS[reason]})` : `finish reason: ${reason}`;
  }

  // ---- server calls -----------------------------------------------------------------------------------

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

  async function request(path, body) {
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
  function connectSocket(onMessage, onState, onDrop) {
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
        const why = event.code === AUTH_CLOSE_CODE ? "API key needed (Settings)" : "disconnected";
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

  // ---- settings ---------------------------------------------------------------------------------------

  // Each check returns [value, problem]; value undefined means "leave the field out".
  function numberField(name, {integer = false, optional = false, check, rule}) {
    const raw = $(name).value.trim();
    if (raw === "") return optional ? [undefined, ""] : [undefined, "Required."];
    const value = Number(raw);
    if (!Number.isFinite(value) || (integer && !Number.isSafeInteger(value))) {
      return [undefined, integer ? "Must be a whole number." : "Must be a number."];
    }
    return check(value) ? [value, ""] : [undefined, rule];
  }

  function stopField() {
    const lines = $("stop").value.split("\n").filter((line) => line !== "")
      .map((line) => line.replaceAll("\\n", "\n"));
    if (lines.length > MAX_STOP_STRINGS) return [undefined, `At most ${MAX_STOP_STRINGS} stop strings.`];
    if (lines.some((line) => line.length > MAX_STOP_LENGTH)) {
      return [undefined, `Each stop string may have at most ${MAX_STOP_LENGTH} characters.`];
    }
    return [lines.length ? lines : undefined, ""];
  }

  function settingChecks() {
    const maxTokensRule = maxModelLen ? `Must be a whole number from 1 to ${maxModelLen}.`
                                      : "Must be a whole number, at least 1.";
    return {
      temperature: numberField("temperature", {check: (v) => v >= 0 && v <= 100,
                                               rule: "Temperature must be between 0 and 100."}),
      max_tokens: numberField("max_tokens", {integer: true, check: (v) => v >= 1 && (!maxModelLen || v <= maxModelLen),
                                             rule: maxTokensRule}),
      top_p: numberField("top_p", {check: (v) => v > 0 && v <= 1, rule: "Top-p must be above 0 and at most 1."}),
      stop: stopField(),
      seed: numberField("seed", {integer: true, optional: true, check: (v) => v >= 0,
                                 rule: "Seed must be a whole number, 0 or more."}),
    };
  }

  // Show each field's problem next to it; return the sampling fields and the first bad field's name.
  function checkSettings() {
    const params = {};
    let firstBad = null;
    for (const [name, [value, problem]] of Object.entries(settingChecks())) {
      $(`${name}-error`).textContent = problem;
      $(name).setAttribute("aria-invalid", problem ? "true" : "false");
      if (problem && !firstBad) firstBad = name;
      if (value !== undefined) params[name] = value;
    }
    return {params, firstBad};
  }

  // The sampling fields for a request, or null after pointing the user at the first bad field.
  function readSettings() {
    const {params, firstBad} = checkSettings();
    if (!firstBad) return params;
    $("settings").open = true;
    $(firstBad).focus();
    return null;
  }

  // ---- chat -------------------------------------------------------------------------------------------

  const chat = {history: [], running: null, counter: 0};

  function addMessage(role, text) {
    const item = el("li", `msg ${role}`);
    item.append(el("span", "role", role === "user" ? "You" : "Assistant"));
    const body = el("div", "body");
    const textNode = document.createTextNode(text);
    body.append(textNode);
    item.append(body);
    const log = $("chat-log");
    const stickToBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 40;
    log.append(item);
    $("chat-empty").hidden = true;
    if (stickToBottom) log.scrollTop = log.scrollHeight;
    return {item, body, textNode};
  }

  function setChatBusy(isBusy) {
    $("chat-send").disabled = isBusy;
    $("chat-stop").disabled = !isBusy;
  }

  function chatNotice(text) {
    $("chat-notice").textContent = text;
  }

  function sendChat() {
    const content = $("chat-input").value;
    if (chat.running) return;
    if (!content.trim()) return chatNotice("Write a message first.");
    const settings = readSettings();
    if (!settings) return chatNotice("Check the settings: a value is out of range.");
    const system = $("system-prompt").value.trim();
    const user = {role: "user", content};
    const messages = [...(system ? [{role: "system", content: system}] : []), ...chat.history, user];
    const id = `chat-${++chat.counter}`;
    if (!socket.send({type: "generate", id, messages, ...settings})) {
      return chatNotice("Not connected; the page is reconnecting. Try again in a moment.");
    }
    chatNotice("");
    const question = addMessage("user", content);
    const answer = addMessage("assistant", "");
    answer.item.dataset.state = "waiting";
    chat.history.push(user);
    chat.running = {id, question, answer, text: ""};
    $("chat-input").value = "";
    setChatBusy(true);
  }

  function onSocketMessage(message) {
    const run = chat.running;
    if (!run || (message.id !== run.id && !(message.type === "error" && message.id == null))) return;
    const log = $("chat-log");
    const stickToBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 40;
    switch (message.type) {
      case "start":
        run.answer.item.dataset.state = "streaming";
        break;
      case "delta":
        run.text += message.text;
        run.answer.textNode.appendData(message.text);
        run.answer.item.dataset.state = "streaming";
        break;
      case "done":
        finishChat(message);
        break;
      case "error":
        failChat(message.code || "error", message.message || "the request failed");
        break;
    }
    if (stickToBottom) log.scrollTop = log.scrollHeight;
  }

  function finishChat(done) {
    const run = chat.running;
    if (run.text) chat.history.push({role: "assistant", content: run.text});
    const meta = metaLine(timingItems(done.timing, done.usage, done.finish_reason));
    meta.querySelector("[data-k=finish]").title = finishTitle(done.finish_reason);
    run.answer.item.append(meta);
    run.answer.item.dataset.state = "done";
    endChat();
  }

  // The turn failed: say why, in place, and take the question out of the conversation so later turns still work.
  function failChat(code, message) {
    const run = chat.running;
    if (run.text) {
      chat.history.push({role: "assistant", content: run.text});
    } else {
      chat.history.pop();
      run.question.item.classList.add("failed");
    }
    run.answer.item.append(errorBox(code, message));
    run.answer.item.dataset.state = "error";
    endChat();
  }

  function endChat() {
    chat.running = null;
    setChatBusy(false);
  }

  function stopChat() {
    if (chat.running) socket.send({type: "cancel", id: chat.running.id});
  }

  function newChat() {
    stopChat();
    if (chat.running) endChat();
    chat.history = [];
    $("chat-log").replaceChildren();
    $("chat-empty").hidden = false;
    chatNotice("");
    $("chat-input").focus();
  }

  function onSocketDrop() {
    if (chat.running) failChat("connection_lost", "the connection dropped before the answer finished");
  }

  // ---- single and batch (REST) ------------------------------------------------------------------------

  async function runSingle() {
    const prompt = $("single-input").value;
    const output = $("single-result");
    if (!prompt.trim()) return output.replaceChildren(errorBox("empty", "write a prompt first."));
    const settings = readSettings();
    if (!settings) return output.replaceChildren(errorBox("settings", "a value is out of range; see the settings."));
    await withPending($("single-form"), output, async () => {
      const {data, latencyMs} = await request("basic_generate", {prompt, ...settings});
      const items = [["latency", `latency ${Math.round(latencyMs)} ms`],
                     ...timingItems(data.timing, data.usage, data.finish_reason)];
      return [el("div", "answer", data.generated_text), metaLine(items)];
    });
  }

  async function runBatch() {
    const prompts = $("batch-input").value.split("\n").filter((line) => line.trim());
    const output = $("batch-result");
    if (!prompts.length) return output.replaceChildren(errorBox("empty", "write one prompt per line first."));
    const settings = readSettings();
    if (!settings) return output.replaceChildren(errorBox("settings", "a value is out of range; see the settings."));
    await withPending($("batch-form"), output, async () => {
      const {data, latencyMs} = await request("generate", {prompts, ...settings});
      const list = el("ol", "answers");
      data.generated_texts.forEach((text, i) => {
        const item = el("li");
        item.append(el("p", "prompt", prompts[i]), el("div", "answer", text),
                    metaLine([["finish", data.finish_reasons[i]]]));
        list.append(item);
      });
      const summary = metaLine([["latency", `latency ${Math.round(latencyMs)} ms`],
                                ["prompts", `${prompts.length} prompts`],
                                ["tokens", `${data.usage.completion_tokens} tokens`]]);
      return [summary, list];
    });
  }

  async function withPending(form, output, work) {
    const button = form.querySelector("button[type=submit]");
    button.disabled = true;
    output.replaceChildren(el("p", "hint", "Generating…"));
    try {
      output.replaceChildren(...await work());
    } catch (err) {
      output.replaceChildren(errorBox(err.code || "error", err.message));
    } finally {
      button.disabled = false;
    }
  }

  // ---- header, tabs, presets --------------------------------------------------------------------------

  function setConnection(state, text) {
    const badge = $("conn-badge");
    badge.dataset.state = state;
    badge.textContent = text;
  }

  // A local model folder shows as its last part; a hub id like org/name stays whole.
  function displayName(modelId) {
    const isPath = /^([/.~]|[A-Za-z]:\\)/.test(modelId);
    return isPath ? modelId.replace(/[/\\]+$/, "").split(/[/\\]/).pop() : modelId;
  }

  async function loadModelBadge() {
    const badge = $("model-badge");
    try {
      const {data} = await request("v1/models");
      const model = data.data[0];
      maxModelLen = model.max_model_len || 0;
      const parts = [displayName(model.id), model.backend, model.dtype, model.device].filter(Boolean);
      badge.textContent = parts.join(" · ") + (model.ready ? "" : " (loading)");
      badge.title = [`model: ${model.id}`, model.backend_reason && `backend: ${model.backend_reason}`]
        .filter(Boolean).join("\n");
    } catch (err) {
      badge.textContent = `model: unavailable (${err.message})`;
      badge.classList.add("bad");
    }
  }

  function tabs() {
    return [...document.querySelectorAll("[role=tab]")];
  }

  function selectTab(tab) {
    for (const other of tabs()) {
      const isSelected = other === tab;
      other.setAttribute("aria-selected", String(isSelected));
      other.tabIndex = isSelected ? 0 : -1;
      $(other.getAttribute("aria-controls")).hidden = !isSelected;
    }
  }

  function onTabKey(event) {
    const all = tabs();
    const index = all.indexOf(event.target);
    const next = {ArrowRight: index + 1, ArrowLeft: index - 1, Home: 0, End: all.length - 1}[event.key];
    if (next === undefined) return;
    event.preventDefault();
    const tab = all[(next + all.length) % all.length];
    selectTab(tab);
    tab.focus();
  }

  function activeInput() {
    const panel = document.querySelector("[role=tab][aria-selected=true]").getAttribute("aria-controls");
    return {"panel-chat": $("chat-input"), "panel-single": $("single-input"), "panel-batch": $("batch-input")}[panel];
  }

  function usePreset(text) {
    const input = activeInput();
    if (input.id === "batch-input" && input.value.trim()) {
      input.value = `${input.value.replace(/\n*$/, "")}\n${text}`;
    } else {
      input.value = text;
    }
    input.focus();
  }

  // ---- wiring -----------------------------------------------------------------------------------------

  for (const [label, text] of PRESETS) {
    const button = el("button", "preset", label);
    button.type = "button";
    button.title = text;
    button.setAttribute("aria-label", `${label}: ${text}`);
    button.addEventListener("click", () => usePreset(text));
    $("presets").append(button);
  }
  for (const tab of tabs()) {
    tab.addEventListener("click", () => selectTab(tab));
    tab.addEventListener("keydown", onTabKey);
  }
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sendChat();
  });
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      sendChat();
    } else if (event.key === "Escape") {
      stopChat();
    }
  });
  $("chat-stop").addEventListener("click", stopChat);
  $("chat-new").addEventListener("click", newChat);
  $("single-form").addEventListener("submit", (event) => {
    event.preventDefault();
    runSingle();
  });
  $("batch-form").addEventListener("submit", (event) => {
    event.preventDefault();
    runBatch();
  });
  $("settings-form").addEventListener("input", checkSettings);  // live: show problems, keep the focus
  $("settings-form").addEventListener("submit", (event) => event.preventDefault());  // never a GET with the key
  if (matchMedia("(min-width: 900px)").matches) $("settings").open = true;

  $("api_key").value = apiKey();
  $("api_key").addEventListener("change", () => {
    const key = $("api_key").value.trim();
    if (key === apiKey()) return;
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    $("model-badge").classList.remove("bad");
    socket.reconnect();
    loadModelBadge();
  });

  const socket = connectSocket(onSocketMessage, setConnection, onSocketDrop);
  loadModelBadge();
})();
