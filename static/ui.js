// Small DOM pieces every part of the page builds with: elements, buttons, copy, meta lines and error boxes.
// Server messages and the user's text are inserted as text only; nothing here builds HTML from strings.
import {errorText} from "./config.js";

const FINISH_LABELS = {stop: "finished", length: "max tokens reached", abort: "stopped", error: "failed"};
const FINISH_HINTS = {stop: "the model ended its answer (or a stop string matched)",
                      length: "the answer reached Max tokens (see Settings)",
                      abort: "you stopped the answer", error: "the answer failed"};
// The page's own errors: these never come from the server, so the server has no sentence for them.
const PAGE_ERROR_TEXTS = {
  connection_lost: "The connection dropped before the answer finished. Try again once the page has reconnected.",
  network_error: "Could not reach the server. Check that it is running.",
};

export const $ = (id) => document.getElementById(id);

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function button(label, action, className = "") {
  const node = el("button", className, label);
  node.type = "button";
  if (action) node.dataset.action = action;
  return node;
}

export function onSubmit(form, handler) {
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    handler();
  });
}

// A problem the page found itself (an empty prompt, a bad setting): one plain sentence.
export function inputProblem(text) {
  const box = el("div", "error");
  box.setAttribute("role", "alert");
  box.append(el("p", "error-text", text));
  return box;
}

// A plain sentence first (the server's, see config.js); the machine code in small print below it.
export function errorBox(code, message) {
  const box = inputProblem(errorText(code, message, PAGE_ERROR_TEXTS[code] || "The request failed."));
  box.dataset.code = code;
  box.append(el("small", "error-code", code));
  return box;
}

export function metaLine(items) {
  const line = el("p", "meta");
  for (const [key, text, title] of items) {
    const part = el("span", "", text);
    part.dataset.k = key;
    if (title) part.title = title;
    line.append(part);
  }
  return line;
}

export function finishItem(reason) {
  return ["finish", FINISH_LABELS[reason] || reason, FINISH_HINTS[reason] || `finish reason: ${reason}`];
}

export function timingItems(timing, usage, finishReason) {
  const items = [];
  if (timing && timing.ttft_ms != null) items.push(["ttft", `TTFT ${Math.round(timing.ttft_ms)} ms`]);
  if (timing && timing.tokens_per_s != null) items.push(["tps", `${timing.tokens_per_s.toFixed(1)} tokens/s`]);
  if (usage) items.push(["tokens", `${usage.completion_tokens} tokens`]);
  items.push(finishItem(finishReason));
  return items;
}

export function markFinish(line, reason) {
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

export async function copyWithFeedback(control, text) {
  await copyText(text);
  const label = control.textContent;
  control.textContent = "Copied";
  setTimeout(() => { control.textContent = label; }, 1500);
}
