// Markdown for the model's answers: marked parses, DOMPurify cleans, highlight.js colours code (all in static/vendor).
// Answers are untrusted text: raw HTML in them is shown as text (never parsed), images become plain links (the page
// loads nothing an answer names), and DOMPurify removes whatever else could run.
// While an answer streams, only its last, still-open block is parsed again (once per animation frame at most);
// finished blocks are rendered once and kept, so a long answer costs the same per token as a short one.
"use strict";

window.lockstepMarkdown = (() => {
  // Autodetection is tried only among these when a code block names no language (all of them would be slow).
  const GUESSED_LANGUAGES = ["python", "javascript", "typescript", "bash", "shell", "json", "c", "cpp", "java", "go",
                             "rust", "sql", "xml", "css", "yaml"];
  const PURIFY_OPTIONS = {USE_PROFILES: {html: true}, FORBID_TAGS: ["img", "style", "form", "button", "textarea",
                                                                     "select"],
                          RETURN_DOM_FRAGMENT: true};
  // Time spent rendering streamed answers: read by the page tests (the 1,000-token measurement).
  const renderStats = {frames: 0, totalMs: 0, maxMs: 0};

  const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

  const marked = new window.marked.Marked({
    gfm: true,
    renderer: {
      html: ({text}) => escapeHtml(text),
      image: ({href, text}) => `<a href="${escapeHtml(href || "")}">${escapeHtml(text || href || "image")}</a>`,
    },
  });

  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A" && node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });

  function tokensToFragment(tokens) {
    return DOMPurify.sanitize(marked.parser(tokens), PURIFY_OPTIONS);
  }

  function languageOf(code) {
    const match = /\blanguage-([\w+#.-]+)/.exec(code.className);
    return match ? match[1].toLowerCase() : "";
  }

  function highlight(code) {
    const language = languageOf(code);
    const text = code.textContent;
    let result = null;
    if (language && hljs.getLanguage(language)) result = hljs.highlight(text, {language, ignoreIllegals: true});
    else if (!language) result = hljs.highlightAuto(text, GUESSED_LANGUAGES);
    if (!result || (!language && result.relevance < 5)) return;  // a weak guess colours prose badly
    code.innerHTML = result.value;  // highlight.js escapes the text it wraps in spans
    code.classList.add("hljs");
  }

  // Each code block gets a small header (language, Copy) and each table a box that scrolls sideways on a phone.
  function decorate(root, {colour}) {
    for (const pre of root.querySelectorAll("pre")) {
      const code = pre.querySelector("code");
      if (!code) continue;
      if (colour) highlight(code);
      const head = document.createElement("div");
      head.className = "code-head";
      const label = document.createElement("span");
      label.textContent = languageOf(code) || "code";
      const copy = document.createElement("button");
      copy.type = "button";
      copy.className = "copy-code";
      copy.dataset.action = "copy-code";
      copy.textContent = "Copy";
      copy.setAttribute("aria-label", `Copy ${label.textContent}`);
      head.append(label, copy);
      const block = document.createElement("div");
      block.className = "code-block";
      pre.replaceWith(block);
      block.append(head, pre);
    }
    for (const table of root.querySelectorAll("table")) {
      const box = document.createElement("div");
      box.className = "table-box";
      table.replaceWith(box);
      box.append(table);
    }
    return root;
  }

  // Carriage returns would make marked's offsets differ from ours; the model never needs them.
  const normalize = (text) => text.replace(/\r/g, "");

  function renderMarkdown(text) {
    return decorate(tokensToFragment(marked.lexer(normalize(text))), {colour: true});
  }

  function lastContentIndex(tokens) {
    for (let i = tokens.length - 1; i >= 0; i--) if (tokens[i].type !== "space") return i;
    return -1;
  }

  // One streamed answer inside `container`: `done` holds finished blocks, `tail` the block still being written.
  // A block is finished once another block starts after it (the lexer then cannot change it any more).
  class StreamingMarkdown {
    constructor(container, onRender = () => {}) {
      this.done = document.createElement("div");
      this.tail = document.createElement("div");
      this.done.className = "md-done";
      this.tail.className = "md-tail";
      container.replaceChildren(this.done, this.tail);
      this.onRender = onRender;
      this.text = "";
      this.committedLength = 0;
      this.frame = 0;
    }

    append(delta) {
      this.text += normalize(delta);
      if (!this.frame) this.frame = requestAnimationFrame(() => this.renderFrame());
    }

    renderFrame() {
      this.frame = 0;
      const started = performance.now();
      this.render(false);
      const elapsedMs = performance.now() - started;
      renderStats.frames += 1;
      renderStats.totalMs += elapsedMs;
      renderStats.maxMs = Math.max(renderStats.maxMs, elapsedMs);
      this.onRender();
    }

    // Parse what is not committed yet; commit every block but the last (or all of them when the answer is over).
    render(isFinal) {
      const rest = this.text.slice(this.committedLength);
      const tokens = marked.lexer(rest);
      const rawLength = tokens.reduce((sum, token) => sum + token.raw.length, 0);
      const offsetsAgree = rawLength === rest.length;
      const open = isFinal ? tokens.length : offsetsAgree ? Math.max(lastContentIndex(tokens), 0) : 0;
      const finished = tokens.slice(0, open);
      if (finished.length) {
        this.done.append(decorate(tokensToFragment(finished), {colour: true}));
        this.committedLength += finished.reduce((sum, token) => sum + token.raw.length, 0);
      }
      const pending = tokens.slice(open);
      this.tail.replaceChildren(decorate(tokensToFragment(pending), {colour: false}));
    }

    finish() {
      cancelAnimationFrame(this.frame);
      this.frame = 0;
      // If the lexer's offsets ever disagreed with ours, nothing was committed and the final pass sees it all.
      this.render(true);
      this.onRender();
    }
  }

  return {renderMarkdown, StreamingMarkdown, renderStats};
})();
