// What a reload keeps, as JSON in localStorage (the conversation; the system prompt and settings). Full or disabled
// storage never breaks the page: it just forgets on reload.

export function loadStored(key) {
  try {
    return JSON.parse(localStorage.getItem(key) || "null");
  } catch {
    return null;
  }
}

export function store(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch {
    // Full or disabled storage: the page still works, it just forgets on reload.
  }
}
