// The Settings panel: sampling fields checked as the user types (against the server's limits, see config.js),
// kept with the system prompt in localStorage, and the API key kept in this tab only (transport.js).
import {limits} from "./config.js";
import {loadStored, store} from "./storage.js";
import {apiKey, setApiKey} from "./transport.js";
import {$} from "./ui.js";

const SETTINGS_STORAGE = "lockstep.settings";
const SETTING_FIELDS = ["temperature", "max_tokens", "top_p", "stop", "seed"];

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
    seed: numberField("seed", {integer: true, optional: true, check: () => true, rule: ""}),
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
export function readSettings() {
  const {params, firstBad} = checkSettings();
  if (!firstBad) return params;
  $("settings").open = true;
  $(firstBad).focus();
  return null;
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

// `onApiKeyChange` runs when the user enters another key (the socket and the model card need it).
export function wireSettings(onApiKeyChange) {
  restoreSettings();
  $("settings-form").addEventListener("input", () => {  // live: show problems, keep the focus
    checkSettings();
    saveSettings();
  });
  $("system-prompt").addEventListener("input", saveSettings);
  $("settings-form").addEventListener("submit", (event) => event.preventDefault());  // never a GET with the key
  if (matchMedia("(min-width: 900px)").matches) $("settings").open = true;
  $("api_key").value = apiKey();
  $("api_key").addEventListener("change", () => {
    const key = $("api_key").value.trim();
    if (key === apiKey()) return;
    setApiKey(key);
    onApiKeyChange();
  });
}
