// The Chat tab's actions: send a question over the socket, stream its answer in, stop, regenerate or retry, edit
// and resend, start a new chat, export. The conversation is in conversation.js, its drawing in chat-view.js.
import {shouldRecheckReady} from "./config.js";
import {isConnected, isSocketOpen, recheckModel, send} from "./connection.js";
import {chat, historyFor, loadChat, saveChat} from "./conversation.js";
import {chatNotice, followFromHere, followStream, logItems, markFailedQuestions, messageElement, onPageScroll,
        reasoningElement, redecorateAnswer, renderLog, showChatControls, trackComposerHeight} from "./chat-view.js";
import {readSettings} from "./settings.js";
import {$, button, copyWithFeedback, el, onSubmit} from "./ui.js";

const NOT_CONNECTED = "Not connected; the page is reconnecting. Try again in a moment.";

function sendChat() {
  if (chat.running) return;
  const content = $("chat-input").value;
  if (!content.trim()) return chatNotice("Write a message first.");
  if (askForAnswer(chat.messages.length, content)) $("chat-input").value = "";
}

// Replace everything from `index` on with a question and ask for its answer. False when it could not be sent.
function askForAnswer(index, question) {
  if (!isConnected()) {
    chatNotice(isSocketOpen() ? "The model is still loading; Send unlocks when it is ready." : NOT_CONNECTED, "wait");
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
  if (!send({type: "generate", id, messages: sent, ...settings})) {
    chatNotice(NOT_CONNECTED);
    return false;
  }
  chatNotice("");
  showQuestion(messages, index);
  startAnswer(id);
  followFromHere();
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
  const markdown = new window.lockstepMarkdown.StreamingMarkdown(body, followStream);
  chat.running = {id, index, message, item, markdown, firstTokenAt: 0, lastTokenAt: 0};
  showChatControls();
}

export function onSocketMessage(message) {
  const run = chat.running;
  if (!run || (message.id !== run.id && !(message.type === "error" && message.id == null))) return;
  switch (message.type) {
    case "start":
      run.item.dataset.state = "streaming";
      break;
    case "delta":
      if (message.reasoning) onReasoning(run, message.reasoning);
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

// Thinking streams into its folded box, created with its first piece.
function onReasoning(run, text) {
  if (!run.reasoningBox) {
    run.reasoningBox = reasoningElement("");
    run.item.querySelector(".body").before(run.reasoningBox);
  }
  run.message.reasoning = (run.message.reasoning || "") + text;
  run.reasoningBox.querySelector(".reasoning-text").textContent = run.message.reasoning;
  run.item.dataset.state = "streaming";
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
  if (shouldRecheckReady(code)) recheckModel();
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
  if (chat.running) send({type: "cancel", id: chat.running.id});
  $("chat-input").focus();
}

export function onSocketDrop() {
  if (chat.running) failAnswer("connection_lost", "");
}

function regenerate() {
  const question = chat.messages[chat.messages.length - 2];
  if (!chat.running && question && question.role === "user") askForAnswer(chat.messages.length - 2, question.content);
}

function newChat() {
  if (chat.running) {
    send({type: "cancel", id: chat.running.id});
    chat.running.markdown.finish();
    chat.running = null;
  }
  chat.messages = [];
  saveChat();
  renderLog();
  chatNotice("");
  $("chat-input").focus();
}

// ---- editing a question in place ----------------------------------------------------------------------------

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

// ---- export -----------------------------------------------------------------------------------------------------

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

// ---- wiring -----------------------------------------------------------------------------------------------------

// Clicks on message buttons: one listener for the whole log.
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

export function wireChat() {
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

// The conversation a reload kept.
export function restoreChat() {
  loadChat();
  renderLog();
}
