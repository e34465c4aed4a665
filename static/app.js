// lockstep chat page: streaming chat over /ws, single and batch modes over REST.
// Server messages and the user's text are inserted as text only; the model's answers go through markdown.js
// (raw HTML shown as text, then sanitised). Nothing here builds HTML from strings.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const {renderMarkdown, StreamingMarkdown} = window.lockstepMarkdown;

  // The API key (when the server has one) lives in this tab's sessionStorage and travels only in the
  // Authorization header and the socket's first frame: never in localStorage or a URL.
  const KEY_STORAGE = "lockstep.apiKey";
  const CHAT_STORAGE = "lockstep.chat";
  const SETTINGS_STORAGE = "lockstep.settings";
  const SETTING_FIELDS = ["temperature", "max_tokens", "top_p", "stop", "seed"];
  const apiKey = () => sessionStorage.getItem(KEY_STORAGE) || "";
  const AUTH_CLOSE_CODE = 1008;
  const FOLLOW_SLACK_PX = 48;
  const PRESETS = [
    ["KV cache", "Explain what a KV cache is in two sentences."],
    ["Code", "Write a Python function that reverses a string, in a code block."],
    ["Haiku", "Write a haiku about the sea."],
    ["Primes", "List three prime numbers."],
    ["Completion", "The capital of France is"],
  ];
  const FINISH_LABELS = {stop: "finished", length: "max tokens reached", abort: "stopped", error: "failed"};
  const FINISH_HINTS = {stop: "the model ended its answer (or a stop string matched)",
                        length: "the answer reached Max tokens (see Settings)",
                        abort: "you stopped the answer", error: "the answer failed"};
  // What each error code means to someone chatting. Only the codes in SHOW_SERVER_MESSAGE keep the server's own
  // sentence (written for users: limits, bad values); the others could carry internals such as process exit codes.
  const ERROR_TEXTS = {
    context_length_exceeded: "This conversation is longer than the model can read. Start a new chat or shorten " +
                             "your message.",
    invalid_value: "The server could not accept this request.",
    missing_field: "The server could not accept this request.",
    unsupported_field: "The server could not accept this request.",
    overloaded: "The server is busy with other requests. Try again in a moment.",
    not_ready: "The model is still loading. Try again when the badge says connected.",
    worker_failed: "The model stopped unexpectedly and is being restarted. Try again in a moment.",
    worker_busy: "The model is busy. Try again in a moment.",
    backend_unavailable: "This server cannot run its model backend.",
    deadline_exceeded: "The answer took too long and was cut off.",
    request_failed: "The answer failed on the server. Try again.",
    connection_lost: "The connection dropped before the answer finished. Try again once the page has reconnected.",
    network_error: "Could not reach the server. Check that it is running.",
    auth_required: "The server needs an API key: enter it under Settings.",
    invalid_api_key: "The API key was not accepted: check it under Settings.",
    unauthorized: "The server needs an API key: enter it under Settings.",
  };
  const SHOW_SERVER_MESSAGE = new Set(["context_length_exceeded", "invalid_value", "missing_field", "unsupported_field"]);
  const RECHECK_READY_AFTER = new Set(["not_ready", "worker_failed", "worker_busy"]);

  // Server limits, from GET /v1/models; the fallbacks match the server's defaults until the card has arrived.
  const limits = {maxModelLen: 0, maxStopStrings: 8, maxStopLength: 200, maxPrompts: 0};

  // ---- small DOM helpers ------------------------------------------------------------------------------

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function button(label, action, className = "") {
    const node = el("button", className, label);
    node.type = "button";
    if (action) node.dataset.action = action;
    return node;
  }

  // A plain sentence first; the machine code (and a user-facing server message) in small print below it.
  function errorBox(code, message) {
    const box = el("div", "error");
    box.setAttribute("role", "alert");
    box.dataset.code = code;
    box.append(el("p", "error-text", ERROR_TEXTS[code] || "The request failed."));
    const detail = SHOW_SERVER_MESSAGE.has(code) && message ? `${code}: ${message}` : code;
    box.append(el("small", "error-code", detail));
    return box;
  }

  function metaLine(items) {
    const line = el("p", "meta");
    for (const [key, text, title] of items) {
      const part = el("span", "", text);
      part.dataset.k = key;
      if (title) part.title = title;
      line.append(part);
    }
    return line;
  }

  function finishItem(reason) {
    const item = ["finish", FINISH_LABELS[reason] || reason, FINISH_HINTS[reason] || `finish reason: ${reason}`];
    return item;
  }

  function timingItems(timing, usage, finishReason) {
    const items = [];
    if (timing && timing.ttft_ms != null) items.push(["ttft", `TTFT ${Math.round(timing.ttft_ms)} ms`]);
    if (timing && timing.tokens_per_s != null) items.push(["tps", `${timing.tokens_per_s.toFixed(1)} tokens/s`]);
    if (usage) items.push(["tokens", `${usage.completion_tokens} tokens`]);
    items.push(finishItem(finishReason));
    return items;
  }

  function markFinish(line, reason) {
    line.querySelector("[data-k=finish]").dataset.reason = reason;
    return line;
  }

  async function copyText(text) {
    try {
      await navigator.clipboard.writeText(text);
    } catch {
      // No clipboard API outside a secure context (plain http on a LAN address): the old way still works there.
      const area = el("textarea");
      area.value = text;
      area.setAttribute("readonly", "");
      area.style.position = "fixed";
      area.style.opacity = "0";
      document.body.append(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
  }

  async function copyWithFeedback(control, text) {
    await copyText(text);
    const label = control.textContent;
    control.textContent = "Copied";
    setTimeout(() => { control.textContent = label; }, 1500);
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

  // Polls GET /ready (0.5 s, 1 s, 2 s ... up to 4 s) until the model answers, then stops; `check()` starts it again
  // (after a reconnect, or an error that says the model went away).
  function watchReadiness(onChange) {
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

  // ---- connection state: the socket is open AND the model is ready ------------------------------------

  const connection = {socketState: "connecting", socketText: "connecting…", isModelReady: false, loadingReason: ""};

  const isConnected = () => connection.socketState === "open" && connection.isModelReady && socket.isOpen();

  function showConnection() {
    const badge = $("conn-badge");
    const isLoading = connection.socketState === "open" && !connection.isModelReady;
    badge.dataset.state = isLoading ? "loading" : connection.socketState;
    badge.textContent = isLoading ? "model loading…" : connection.socketText;
    badge.title = isLoading ? connection.loadingReason : "";
    showChatControls();
  }

  function onSocketState(state, text) {
    Object.assign(connection, {socketState: state, socketText: text});
    if (state === "open") readiness.check();  // a reconnect may follow a server restart
    showConnection();
  }

  function onReadiness(isReady, reason) {
    const becameReady = isReady && !connection.isModelReady;
    Object.assign(connection, {isModelReady: isReady, loadingReason: reason});
    showConnection();
    if (becameReady) loadModelCard();  // the card's "(loading)" and its limits are final only now
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
    if (lines.length > limits.maxStopStrings) return [undefined, `At most ${limits.maxStopStrings} stop strings.`];
    if (lines.some((line) => line.length > limits.maxStopLength)) {
      return [undefined, `Each stop string may have at most ${limits.maxStopLength} characters.`];
    }
    return [lines.length ? lines : undefined, ""];
  }

  function settingChecks() {
    const maxLen = limits.maxModelLen;
    const maxTokensRule = maxLen ? `Must be a whole number from 1 to ${maxLen}.` : "Must be a whole number, at least 1.";
    return {
      temperature: numberField("temperature", {check: (v) => v >= 0 && v <= 100,
                                               rule: "Temperature must be between 0 and 100."}),
      max_tokens: numberField("max_tokens", {integer: true, check: (v) => v >= 1 && (!maxLen || v <= maxLen),
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

  // ---- what a reload keeps (localStorage): the conversation, the system prompt and the settings -----------

  function loadStored(key) {
    try {
      return JSON.parse(localStorage.getItem(key) || "null");
    } catch {
      return null;
    }
  }

  function store(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
    } catch {
      // Full or disabled storage: the page still works, it just forgets on reload.
    }
  }

  function saveSettings() {
    const values = {system: $("system-prompt").value};
    for (const name of SETTING_FIELDS) values[name] = $(name).value;
    store(SETTINGS_STORAGE, values);
  }

  function restoreSettings() {
    const values = loadStored(SETTINGS_STORAGE) || {};
    for (const name of SETTING_FIELDS) if (typeof values[name] === "string") $(name).value = values[name];
    if (typeof values.system === "string") $("system-prompt").value = values.system;
    if ($("system-prompt").value) $("system-prompt").closest("details").open = true;
  }

  const saveChat = () => store(CHAT_STORAGE, {messages: chat.messages});

  function restoreChat() {
    const saved = loadStored(CHAT_STORAGE);
    const messages = saved && Array.isArray(saved.messages) ? saved.messages : [];
    chat.messages = messages.filter((m) => m && (m.role === "user" || m.role === "assistant") &&
                                           typeof m.content === "string");
    renderLog();
  }

  // ---- chat: state -------------------------------------------------------------------------------------

  // messages: [{role: "user", content}, {role: "assistant", content, state, meta, error}] — always a user turn
  // followed by its answer. running: the answer being streamed (its request id, element and timings).
  const chat = {messages: [], running: null, counter: 0};

  const isAnswered = (message) => message && message.role === "assistant" && message.content !== "";

  // The turns sent with a request: a question whose answer failed or came back empty is left out with it, so the
  // model never sees two user turns in a row.
  function historyFor(messages) {
    const turns = [];
    for (let i = 0; i + 1 < messages.length; i++) {
      if (messages[i].role === "user" && isAnswered(messages[i + 1])) {
        turns.push({role: "user", content: messages[i].content}, {role: "assistant", content: messages[i + 1].content});
      }
    }
    return turns;
  }

  // ---- chat: rendering ---------------------------------------------------------------------------------

  function messageElement(message, index) {
    const item = el("li", `msg ${message.role}`);
    item.dataset.index = String(index);
    item.append(el("span", "role", message.role === "user" ? "You" : "Assistant"));
    const body = el("div", message.role === "user" ? "body" : "body markdown");
    if (message.role === "user") body.textContent = message.content;
    else if (message.content) body.append(renderMarkdown(message.content));
    item.append(body);
    if (message.role === "assistant") decorateAnswer(item, message);
    item.append(el("div", "msg-actions"));
    return item;
  }

  function decorateAnswer(item, message) {
    item.dataset.state = message.state || "done";
    if (message.error) item.append(errorBox(message.error.code, message.error.message));
    if (!message.content && (message.state === "empty" || message.state === "stopped")) {
      item.append(el("p", "note", message.state === "stopped" ? "Stopped before any text came back."
                                                                : "The model returned an empty answer."));
    }
    if (message.meta) item.append(markFinish(metaLine(metaItems(message.meta)), message.meta.finish));
  }

  function redecorateAnswer(item, message) {
    item.querySelectorAll(":scope > .error, :scope > .note, :scope > .meta").forEach((node) => node.remove());
    const actions = item.querySelector(".msg-actions");
    decorateAnswer(item, message);
    item.append(actions);
  }

  function metaItems(meta) {
    const items = [];
    if (meta.ttftMs != null) items.push(["ttft", `TTFT ${Math.round(meta.ttftMs)} ms`, "time to first token"]);
    if (meta.decodeTps != null) {
      items.push(["tps", `${meta.decodeTps.toFixed(1)} tokens/s`,
                  "decode speed, measured in this page: (tokens − 1) / time from the first token to the last"]);
    }
    if (meta.tokens != null) items.push(["tokens", `${meta.tokens} tokens`]);
    items.push(finishItem(meta.finish));
    return items;
  }

  function logItems() {
    return [...$("chat-log").children];
  }

  function renderLog() {
    $("chat-log").replaceChildren(...chat.messages.map(messageElement));
    $("chat-empty").hidden = chat.messages.length > 0;
    markFailedQuestions();
    showChatControls();
  }

  // A question whose answer failed with nothing to show is marked, and left out of later requests.
  function markFailedQuestions() {
    logItems().forEach((item, i) => {
      const answer = chat.messages[i + 1];
      const isFailed = chat.messages[i].role === "user" && answer && answer.error && !answer.content;
      item.classList.toggle("failed", Boolean(isFailed));
    });
  }

  // Buttons under each message depend on what is running and which answer is last.
  function actionsFor(message, index) {
    if (message.role === "user") {
      const edit = button("Edit", "edit");
      edit.disabled = Boolean(chat.running);  // disabled, not removed: the page above the reader must not move
      return [edit];
    }
    const isLast = index === chat.messages.length - 1;
    const actions = message.content ? [button("Copy", "copy-message")] : [];
    if (isLast && !chat.running) actions.push(button(message.error ? "Retry" : "Regenerate", "regenerate"));
    return actions;
  }

  function showChatControls() {
    const isBusy = Boolean(chat.running);
    $("chat-send").disabled = isBusy || !isConnected();
    $("chat-stop").disabled = !isBusy;
    $("chat-export").disabled = chat.messages.length === 0;
    $("chat-log").setAttribute("aria-busy", String(isBusy));
    logItems().forEach((item, i) => {
      const message = chat.messages[i];
      if (!message || (chat.running && chat.running.index === i)) return;
      item.querySelector(".msg-actions").replaceChildren(...actionsFor(message, i));
    });
    showWaitingHint();
  }

  function showWaitingHint() {
    const notice = $("chat-notice");
    if (notice.dataset.kind === "error") return;
    notice.dataset.kind = "info";
    notice.textContent = connection.socketState === "open" && !connection.isModelReady
      ? "The model is loading; Send unlocks when it is ready." : "";
  }

  // kind "wait": a notice about the connection, replaced as soon as the connection changes.
  function chatNotice(text, kind = "error") {
    const notice = $("chat-notice");
    notice.dataset.kind = text ? kind : "info";
    notice.textContent = text;
    if (!text) showWaitingHint();
  }

  // ---- chat: following the stream ------------------------------------------------------------------------

  // The page itself scrolls (no nested scroll box); it follows a streaming answer unless the user scrolled up.
  const follow = {isOn: true, lastY: 0};

  function isNearBottom() {
    const root = document.scrollingElement;
    return root.scrollTop + root.clientHeight >= root.scrollHeight - FOLLOW_SLACK_PX;
  }

  function onPageScroll() {
    const y = document.scrollingElement.scrollTop;
    if (isNearBottom()) follow.isOn = true;
    else if (y < follow.lastY) follow.isOn = false;  // only a move up turns it off: growing content never does
    follow.lastY = y;
  }

  function followStream() {
    if (follow.isOn) document.scrollingElement.scrollTop = document.scrollingElement.scrollHeight;
  }

  // ---- chat: requests ----------------------------------------------------------------------------------

  function sendChat() {
    if (chat.running) return;
    const content = $("chat-input").value;
    if (!content.trim()) return chatNotice("Write a message first.");
    if (askForAnswer(chat.messages.length, content)) $("chat-input").value = "";
  }

  // Replace everything from `index` on with a question and ask for its answer. False when it could not be sent.
  function askForAnswer(index, question) {
    if (!isConnected()) {
      chatNotice(connection.socketState === "open" ? "The model is still loading; Send unlocks when it is ready."
                                                     : "Not connected; the page is reconnecting. Try again in a moment.",
                 "wait");
      return false;
    }
    const settings = readSettings();
    if (!settings) {
      chatNotice("Check the settings: a value is out of range.");
      return false;
    }
    const messages = [...chat.messages.slice(0, index), {role: "user", content: question}];
    const system = $("system-prompt").value.trim();
    const id = `chat-${++chat.counter}`;
    const sent = [...(system ? [{role: "system", content: system}] : []), ...historyFor(messages),
                  {role: "user", content: question}];
    if (!socket.send({type: "generate", id, messages: sent, ...settings})) {
      chatNotice("Not connected; the page is reconnecting. Try again in a moment.");
      return false;
    }
    chatNotice("");
    showQuestion(messages, index);
    startAnswer(id);
    follow.isOn = true;
    followStream();
    $("chat-input").focus();
    return true;
  }

  // Only what changed is redrawn: the messages from `index` on (all earlier answers keep their rendered DOM).
  function showQuestion(messages, index) {
    chat.messages = messages;
    logItems().slice(index).forEach((item) => item.remove());
    $("chat-log").append(messageElement(messages[index], index));
    $("chat-empty").hidden = true;
    markFailedQuestions();
  }

  function startAnswer(id) {
    const message = {role: "assistant", content: "", state: "waiting"};
    chat.messages.push(message);
    const index = chat.messages.length - 1;
    const item = messageElement(message, index);
    $("chat-log").append(item);
    const body = item.querySelector(".body");
    const markdown = new StreamingMarkdown(body, followStream);
    chat.running = {id, index, message, item, markdown, firstTokenAt: 0, lastTokenAt: 0};
    showChatControls();
  }

  function onSocketMessage(message) {
    const run = chat.running;
    if (!run || (message.id !== run.id && !(message.type === "error" && message.id == null))) return;
    switch (message.type) {
      case "start":
        run.item.dataset.state = "streaming";
        break;
      case "delta":
        onDelta(run, message.text);
        break;
      case "done":
        finishAnswer(message);
        break;
      case "error":
        failAnswer(message.code || "error", message.message || "");
        break;
    }
  }

  function onDelta(run, text) {
    const now = performance.now();
    if (!run.firstTokenAt) run.firstTokenAt = now;
    run.lastTokenAt = now;
    run.message.content += text;
    run.markdown.append(text);
    run.item.dataset.state = "streaming";
  }

  // Decode speed as the reader sees it: tokens after the first over the time from the first to the last. The
  // server's own tokens/s counts the queueing and the prefill too, so one token after 4 s of waiting showed 0.2.
  function decodeTokensPerSecond(run, numTokens) {
    const seconds = (run.lastTokenAt - run.firstTokenAt) / 1000;
    return numTokens > 1 && seconds > 0 ? (numTokens - 1) / seconds : null;
  }

  function finishAnswer(done) {
    const run = chat.running;
    const numTokens = done.usage ? done.usage.completion_tokens : null;
    run.message.meta = {ttftMs: done.timing ? done.timing.ttft_ms : null, decodeTps: decodeTokensPerSecond(run, numTokens),
                        tokens: numTokens, finish: done.finish_reason};
    const isStopped = done.finish_reason === "abort";
    run.message.state = isStopped ? "stopped" : run.message.content ? "done" : "empty";
    endAnswer();
  }

  // The turn failed: say why in place. A partial answer stays (and is sent with later turns); an empty one does not.
  function failAnswer(code, message) {
    const run = chat.running;
    run.message.error = {code, message};
    run.message.state = "error";
    endAnswer();
    if (RECHECK_READY_AFTER.has(code)) {
      connection.isModelReady = false;
      showConnection();
      readiness.check();
    }
    const box = logItems()[run.index].querySelector(".error");
    box.scrollIntoView({block: "nearest"});
  }

  function endAnswer() {
    const run = chat.running;
    run.markdown.finish();
    chat.running = null;
    redecorateAnswer(run.item, run.message);  // the streamed body stays as it is: no second render
    saveChat();
    markFailedQuestions();
    showChatControls();
    followStream();
  }

  // Leaving the page mid-answer keeps what has arrived, as a stopped answer.
  function keepPartialAnswer() {
    if (!chat.running) return;
    Object.assign(chat.running.message, {state: "stopped", meta: {finish: "abort"}});
    saveChat();
  }

  function stopChat() {
    if (chat.running) socket.send({type: "cancel", id: chat.running.id});
    $("chat-input").focus();
  }

  function onSocketDrop() {
    if (chat.running) failAnswer("connection_lost", "");
  }

  function regenerate() {
    const question = chat.messages[chat.messages.length - 2];
    if (!chat.running && question && question.role === "user") askForAnswer(chat.messages.length - 2, question.content);
  }

  function newChat() {
    if (chat.running) {
      socket.send({type: "cancel", id: chat.running.id});
      chat.running.markdown.finish();
      chat.running = null;
    }
    chat.messages = [];
    saveChat();
    renderLog();
    chatNotice("");
    $("chat-input").focus();
  }

  // ---- chat: editing a question in place -----------------------------------------------------------------

  function startEdit(item, index) {
    const body = item.querySelector(".body");
    const editor = el("textarea", "edit-input");
    editor.value = chat.messages[index].content;
    editor.rows = Math.min(12, editor.value.split("\n").length + 1);
    editor.setAttribute("aria-label", "Edit your message");
    const actions = item.querySelector(".msg-actions");
    actions.replaceChildren(button("Send", "edit-send", "primary"), button("Cancel", "edit-cancel"));
    body.replaceChildren(editor);
    editor.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        finishEdit(item, true);
      } else if (event.key === "Escape") {
        event.stopPropagation();
        finishEdit(item, false);
      }
    });
    editor.focus();
  }

  function finishEdit(item, isSend) {
    const index = Number(item.dataset.index);
    const editor = item.querySelector(".edit-input");
    if (isSend && editor.value.trim() && askForAnswer(index, editor.value)) return;
    if (!isSend) renderLog();
  }

  // ---- chat: export -----------------------------------------------------------------------------------------

  function conversationMarkdown() {
    const lines = [`# Chat (${new Date().toLocaleString()})`, ""];
    const system = $("system-prompt").value.trim();
    if (system) lines.push("## System", "", system, "");
    for (const message of chat.messages) {
      if (message.role === "assistant" && !message.content) continue;
      lines.push(message.role === "user" ? "## You" : "## Assistant", "", message.content, "");
    }
    return lines.join("\n");
  }

  function exportChat() {
    const blob = new Blob([conversationMarkdown()], {type: "text/markdown"});
    const link = el("a");
    link.href = URL.createObjectURL(blob);
    link.download = `chat-${new Date().toISOString().slice(0, 16).replace(/[:T]/g, "-")}.md`;
    link.click();
    setTimeout(() => URL.revokeObjectURL(link.href), 1000);
  }

  // ---- chat: clicks on message buttons (one listener for the whole log) ------------------------------------

  function onLogClick(event) {
    const control = event.target.closest("[data-action]");
    if (!control) return;
    const item = control.closest(".msg");
    const index = Number(item.dataset.index);
    switch (control.dataset.action) {
      case "copy-code":
        copyWithFeedback(control, control.closest(".code-block").querySelector("pre").textContent);
        break;
      case "copy-message":
        copyWithFeedback(control, chat.messages[index].content);
        break;
      case "regenerate":
        regenerate();
        break;
      case "edit":
        if (!chat.running) startEdit(item, index);
        break;
      case "edit-send":
        finishEdit(item, true);
        break;
      case "edit-cancel":
        finishEdit(item, false);
        break;
    }
  }

  // ---- single and batch (REST) ------------------------------------------------------------------------

  async function runSingle() {
    const prompt = $("single-input").value;
    const output = $("single-result");
    if (!prompt.trim()) return output.replaceChildren(inputProblem("Write a prompt first."));
    const settings = readSettings();
    if (!settings) return output.replaceChildren(inputProblem("A value in the settings is out of range."));
    await withPending($("single-form"), output, async () => {
      const {data, latencyMs} = await request("basic_generate", {prompt, ...settings});
      const items = [["latency", `latency ${Math.round(latencyMs)} ms`],
                     ...timingItems(data.timing, data.usage, data.finish_reason)];
      return [el("div", "answer", data.generated_text), markFinish(metaLine(items), data.finish_reason)];
    });
  }

  async function runBatch() {
    const prompts = $("batch-input").value.split("\n").filter((line) => line.trim());
    const output = $("batch-result");
    if (!prompts.length) return output.replaceChildren(inputProblem("Write one prompt per line first."));
    if (limits.maxPrompts && prompts.length > limits.maxPrompts) {
      return output.replaceChildren(inputProblem(`At most ${limits.maxPrompts} prompts at a time.`));
    }
    const settings = readSettings();
    if (!settings) return output.replaceChildren(inputProblem("A value in the settings is out of range."));
    await withPending($("batch-form"), output, async () => {
      const {data, latencyMs} = await request("generate", {prompts, ...settings});
      const list = el("ol", "answers");
      data.generated_texts.forEach((text, i) => {
        const item = el("li");
        item.append(el("p", "prompt", prompts[i]), el("div", "answer", text),
                    markFinish(metaLine([finishItem(data.finish_reasons[i])]), data.finish_reasons[i]));
        list.append(item);
      });
      const summary = metaLine([["latency", `latency ${Math.round(latencyMs)} ms`],
                                ["prompts", `${prompts.length} prompts`],
                                ["tokens", `${data.usage.completion_tokens} tokens`]]);
      return [summary, list];
    });
  }

  function inputProblem(text) {
    const box = el("div", "error");
    box.setAttribute("role", "alert");
    box.append(el("p", "error-text", text));
    return box;
  }

  async function withPending(form, output, work) {
    const submit = form.querySelector("button[type=submit]");
    submit.disabled = true;
    output.replaceChildren(el("p", "hint", "Generating…"));
    try {
      output.replaceChildren(...await work());
    } catch (err) {
      output.replaceChildren(errorBox(err.code || "error", err.message));
    } finally {
      submit.disabled = false;
    }
    output.lastElementChild.scrollIntoView({block: "nearest"});
  }

  // ---- header, tabs, presets --------------------------------------------------------------------------

  // A local model folder shows as its last part; a hub id like org/name stays whole.
  function displayName(modelId) {
    const isPath = /^([/.~]|[A-Za-z]:\\)/.test(modelId);
    return isPath ? modelId.replace(/[/\\]+$/, "").split(/[/\\]/).pop() : modelId;
  }

  function readLimits(model) {
    limits.maxModelLen = model.max_model_len || 0;
    limits.maxStopStrings = model.max_stop_strings || limits.maxStopStrings;
    limits.maxStopLength = model.max_stop_length || limits.maxStopLength;
    limits.maxPrompts = model.max_prompts || limits.maxPrompts;
    if (limits.maxModelLen) $("max_tokens").max = String(limits.maxModelLen);
  }

  async function loadModelCard() {
    const badge = $("model-badge");
    try {
      const {data} = await request("v1/models");
      const model = data.data[0];
      readLimits(model);
      const parts = [displayName(model.id), model.backend, model.weights || model.dtype, model.device]
        .filter(Boolean);
      badge.textContent = parts.join(" · ") + (model.ready ? "" : " (loading)");
      badge.title = [`model: ${model.id}`, model.backend_reason && `backend: ${model.backend_reason}`,
        model.compute && `compute: ${model.compute}`, model.compute_reason && `why: ${model.compute_reason}`]
        .filter(Boolean).join("\n");
      badge.classList.remove("bad");
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

  function submitOnCtrlEnter(input, form) {
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        form.requestSubmit();
      }
    });
  }

  function onSubmit(form, handler) {
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      handler();
    });
  }

  function onComposerKey(event) {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      sendChat();
    }
  }

  // Escape stops a streaming answer wherever the focus is (an open message editor handles its own Escape first).
  function onPageKey(event) {
    if (event.key === "Escape" && chat.running) stopChat();
  }

  // The sticky composer covers the bottom of the page: errors scrolled into view must land above it.
  function trackComposerHeight() {
    const composer = $("chat-form");
    new ResizeObserver(() => {
      document.documentElement.style.setProperty("--composer-height", `${composer.offsetHeight}px`);
    }).observe(composer);
  }

  function wirePresets() {
    for (const [label, text] of PRESETS) {
      const preset = button(label, "", "preset");
      preset.title = text;
      preset.setAttribute("aria-label", `${label}: ${text}`);
      preset.addEventListener("click", () => usePreset(text));
      $("presets").append(preset);
    }
  }

  function wireTabs() {
    for (const tab of tabs()) {
      tab.addEventListener("click", () => selectTab(tab));
      tab.addEventListener("keydown", onTabKey);
    }
  }

  function wireChat() {
    onSubmit($("chat-form"), sendChat);
    $("chat-input").addEventListener("keydown", onComposerKey);
    $("chat-stop").addEventListener("click", stopChat);
    $("chat-new").addEventListener("click", newChat);
    $("chat-export").addEventListener("click", exportChat);
    $("chat-log").addEventListener("click", onLogClick);
    document.addEventListener("keydown", onPageKey);
    window.addEventListener("scroll", onPageScroll, {passive: true});
    window.addEventListener("pagehide", keepPartialAnswer);
    trackComposerHeight();
  }

  function wireRest() {
    onSubmit($("single-form"), runSingle);
    onSubmit($("batch-form"), runBatch);
    submitOnCtrlEnter($("single-input"), $("single-form"));
    submitOnCtrlEnter($("batch-input"), $("batch-form"));
  }

  function wireSettings() {
    restoreSettings();
    $("settings-form").addEventListener("input", () => {  // live: show problems, keep the focus
      checkSettings();
      saveSettings();
    });
    $("system-prompt").addEventListener("input", saveSettings);
    $("settings-form").addEventListener("submit", (event) => event.preventDefault());  // never a GET with the key
    if (matchMedia("(min-width: 900px)").matches) $("settings").open = true;
    $("api_key").value = apiKey();
    $("api_key").addEventListener("change", onApiKeyChange);
  }

  function onApiKeyChange() {
    const key = $("api_key").value.trim();
    if (key === apiKey()) return;
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    socket.reconnect();
    loadModelCard();
  }

  wirePresets();
  wireTabs();
  wireChat();
  wireRest();
  wireSettings();
  const readiness = watchReadiness(onReadiness);
  const socket = connectSocket(onSocketMessage, onSocketState, onSocketDrop);
  restoreChat();
  readiness.check();
  loadModelCard();
  if (!matchMedia("(pointer: coarse)").matches) $("chat-input").focus();  // a phone would pop its keyboard up
})();
