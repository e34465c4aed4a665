// The mode tabs (Chat, Single, Batch) with their keyboard, the presets that fill the active tab's input, and the
// two REST modes: Single (POST /basic_generate) and Batch (POST /generate), each run in one request.
import {limits} from "./config.js";
import {readSettings} from "./settings.js";
import {request} from "./transport.js";
import {$, button, el, errorBox, finishItem, inputProblem, markFinish, metaLine, onSubmit, timingItems} from "./ui.js";

const PRESETS = [
  ["KV cache", "Explain what a KV cache is in two sentences."],
  ["Code", "Write a Python function that reverses a string, in a code block."],
  ["Haiku", "Write a haiku about the sea."],
  ["Primes", "List three prime numbers."],
  ["Completion", "The capital of France is"],
];
const BAD_SETTINGS = "A value in the settings is out of range.";

// ---- tabs and presets -----------------------------------------------------------------------------------------

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

export function wireTabs() {
  for (const [label, text] of PRESETS) {
    const preset = button(label, "", "preset");
    preset.title = text;
    preset.setAttribute("aria-label", `${label}: ${text}`);
    preset.addEventListener("click", () => usePreset(text));
    $("presets").append(preset);
  }
  for (const tab of tabs()) {
    tab.addEventListener("click", () => selectTab(tab));
    tab.addEventListener("keydown", onTabKey);
  }
}

// ---- single and batch (REST) ------------------------------------------------------------------------------------

async function runSingle() {
  const prompt = $("single-input").value;
  const output = $("single-result");
  if (!prompt.trim()) return output.replaceChildren(inputProblem("Write a prompt first."));
  const settings = readSettings();
  if (!settings) return output.replaceChildren(inputProblem(BAD_SETTINGS));
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
  if (!settings) return output.replaceChildren(inputProblem(BAD_SETTINGS));
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

function submitOnCtrlEnter(input, form) {
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
}

export function wireRestModes() {
  onSubmit($("single-form"), runSingle);
  onSubmit($("batch-form"), runBatch);
  submitOnCtrlEnter($("single-input"), $("single-form"));
  submitOnCtrlEnter($("batch-input"), $("batch-form"));
}
