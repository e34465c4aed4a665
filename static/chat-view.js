// Drawing the conversation: each message and its buttons, the composer's controls and notice, and following a
// streaming answer down the page. Answers render through markdown.js (loaded before the modules, as a global).
import {isConnected, isModelLoading} from "./connection.js";
import {chat} from "./conversation.js";
import {$, button, el, errorBox, finishItem, markFinish, metaLine} from "./ui.js";

const FOLLOW_SLACK_PX = 48;

export function messageElement(message, index) {
  const item = el("li", `msg ${message.role}`);
  item.dataset.index = String(index);
  item.append(el("span", "role", message.role === "user" ? "You" : "Assistant"));
  if (message.reasoning) item.append(reasoningElement(message.reasoning));
  const body = el("div", message.role === "user" ? "body" : "body markdown");
  if (message.role === "user") body.textContent = message.content;
  else if (message.content) body.append(window.lockstepMarkdown.renderMarkdown(message.content));
  item.append(body);
  if (message.role === "assistant") decorateAnswer(item, message);
  item.append(el("div", "msg-actions"));
  return item;
}

// The model's thinking (a reasoning template's <think> block), folded above its answer; plain text, never markup.
export function reasoningElement(text) {
  const box = el("details", "reasoning");
  box.append(el("summary", "", "Thinking"), el("div", "reasoning-text", text));
  return box;
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

export function redecorateAnswer(item, message) {
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

export function logItems() {
  return [...$("chat-log").children];
}

export function renderLog() {
  $("chat-log").replaceChildren(...chat.messages.map(messageElement));
  $("chat-empty").hidden = chat.messages.length > 0;
  markFailedQuestions();
  showChatControls();
}

// A question whose answer failed with nothing to show is marked, and left out of later requests.
export function markFailedQuestions() {
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

export function showChatControls() {
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
  notice.textContent = isModelLoading() ? "The model is loading; Send unlocks when it is ready." : "";
}

// kind "wait": a notice about the connection, replaced as soon as the connection changes.
export function chatNotice(text, kind = "error") {
  const notice = $("chat-notice");
  notice.dataset.kind = text ? kind : "info";
  notice.textContent = text;
  if (!text) showWaitingHint();
}

// The page itself scrolls (no nested scroll box); it follows a streaming answer unless the user scrolled up.
const follow = {isOn: true, lastY: 0};

function isNearBottom() {
  const root = document.scrollingElement;
  return root.scrollTop + root.clientHeight >= root.scrollHeight - FOLLOW_SLACK_PX;
}

export function onPageScroll() {
  const y = document.scrollingElement.scrollTop;
  if (isNearBottom()) follow.isOn = true;
  else if (y < follow.lastY) follow.isOn = false;  // only a move up turns it off: growing content never does
  follow.lastY = y;
}

export function followStream() {
  if (follow.isOn) document.scrollingElement.scrollTop = document.scrollingElement.scrollHeight;
}

// A new question: follow its answer again, wherever the user had scrolled.
export function followFromHere() {
  follow.isOn = true;
  followStream();
}

// The sticky composer covers the bottom of the page: errors scrolled into view must land above it.
export function trackComposerHeight() {
  const composer = $("chat-form");
  new ResizeObserver(() => {
    document.documentElement.style.setProperty("--composer-height", `${composer.offsetHeight}px`);
  }).observe(composer);
}
