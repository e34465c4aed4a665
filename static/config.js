// What the server tells the page about itself (rendered into #page-config by app/pages.py): the limits the page
// checks before it sends, and what the server's error codes mean to someone chatting. The page repeats none of it;
// the limits are read again from the model card (GET /v1/models) once the model is ready.

const config = JSON.parse(document.getElementById("page-config").textContent);
const userMessageCodes = new Set(config.user_message_codes);
const recheckReadyCodes = new Set(config.recheck_ready_codes);

export const authCloseCode = config.auth_close_code;

export const limits = {maxModelLen: 0, maxStopStrings: 0, maxStopLength: 0, maxPrompts: 0};

// `source` is the page config's limits or a model card: each limit it serves replaces the one known so far.
export function readLimits(source) {
  limits.maxModelLen = source.max_model_len || 0;
  limits.maxStopStrings = source.max_stop_strings || limits.maxStopStrings;
  limits.maxStopLength = source.max_stop_length || limits.maxStopLength;
  limits.maxPrompts = source.max_prompts || limits.maxPrompts;
}

readLimits(config.limits);

// A server message written for users (a limit, a bad value) is shown as it is; other codes get the server's plain
// sentence for them, since their messages can carry internals (process exit codes and the like).
export function errorText(code, message, fallback) {
  if (userMessageCodes.has(code) && message) return message;
  return config.error_texts[code] || fallback;
}

// After these errors the model may be gone for a while: the page checks GET /ready again.
export const shouldRecheckReady = (code) => recheckReadyCodes.has(code);
