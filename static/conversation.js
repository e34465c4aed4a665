// The conversation as data (no DOM): its messages, the answer being streamed, what a request sends as history,
// and how a reload keeps it (localStorage, until New chat).
import {loadStored, store} from "./storage.js";

const CHAT_STORAGE = "lockstep.chat";

// messages: [{role: "user", content}, {role: "assistant", content, state, meta, error}] — always a user turn
// followed by its answer. running: the answer being streamed (its request id, element and timings).
export const chat = {messages: [], running: null, counter: 0};

const isAnswered = (message) => message && message.role === "assistant" && message.content !== "";

// The turns sent with a request: a question whose answer failed or came back empty is left out with it, so the
// model never sees two user turns in a row.
export function historyFor(messages) {
  const turns = [];
  for (let i = 0; i + 1 < messages.length; i++) {
    if (messages[i].role === "user" && isAnswered(messages[i + 1])) {
      turns.push({role: "user", content: messages[i].content}, {role: "assistant", content: messages[i + 1].content});
    }
  }
  return turns;
}

export const saveChat = () => store(CHAT_STORAGE, {messages: chat.messages});

export function loadChat() {
  const saved = loadStored(CHAT_STORAGE);
  const messages = saved && Array.isArray(saved.messages) ? saved.messages : [];
  chat.messages = messages.filter((m) => m && (m.role === "user" || m.role === "assistant") &&
                                         typeof m.content === "string");
}
