"""The chat page in real headless Chromium (Playwright) against a live server with the real embedded model."""
import os
import re
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
DOCS = Path(__file__).resolve().parents[2] / "docs"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 375, "height": 740}
GENERATION_MS = 180_000  # the real model on shared CPU cores: generous, but every wait ends as soon as it can
# max_tokens for an answer a test stops: a greedy long story runs past this without ending (4,000 tokens measured,
# "length"), so the Stop lands first on any host; at 300-400 a fast host under the suite's load finished first
STOP_TOKENS = 4000
PROBE_IMG = "<img src=x onerror=window.__xss=1>"
PROBE_SCRIPT = "<script>window.__xss=1</script>"

# Records the last answer's text length on every DOM change while it is still streaming.
RECORD_PARTIAL_LENGTHS = """() => {
  window.__partialLengths = [];
  new MutationObserver(() => {
    const answer = [...document.querySelectorAll('#chat-log .msg.assistant')].pop();
    if (answer && answer.dataset.state === 'streaming') {
      window.__partialLengths.push(answer.querySelector('.body').textContent.length);
    }
  }).observe(document.getElementById('chat-log'), {subtree: true, childList: true, characterData: true,
                                                    attributes: true});
}"""


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium is needed at {CHROMIUM} for the page tests: run `make chromium`")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def open_page(browser, smol_server):
    """Open the page at a viewport size; fail the test on any script error or dialog (an XSS probe firing)."""
    contexts, problems = [], []

    def open_at(viewport=DESKTOP, before_load=None):
        context = browser.new_context(viewport=viewport)
        contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
        page.on("dialog", lambda dialog: (problems.append(f"dialog: {dialog.message}"), dialog.dismiss()))
        if before_load:
            before_load(page)
        page.goto(smol_server.url)
        expect(page.locator("#conn-badge")).to_have_attribute("data-state", "open")
        return page

    yield open_at
    for context in contexts:
        context.close()
    assert not problems


def set_settings(page, **values):
    if not page.locator("#settings").evaluate("details => details.open"):
        page.click("#settings > summary")
    for name, value in values.items():
        page.fill(f"#{name}", str(value))


def send(page, text):
    page.fill("#chat-input", text)
    page.press("#chat-input", "Enter")


def last_answer(page):
    return page.locator("#chat-log .msg.assistant").last


def wait_done(answer):
    expect(answer.locator("[data-k=finish]")).to_be_visible(timeout=GENERATION_MS)


def has_no_horizontal_scroll(page) -> bool:
    return page.evaluate("document.scrollingElement.scrollWidth <= document.scrollingElement.clientWidth")


def test_header_shows_model_backend_and_connection(open_page, smol_server):
    page = open_page()
    backend = smol_server.state.model_card()["backend"]
    expect(page.locator("#model-badge")).to_contain_text(backend)
    model_id = smol_server.state.model_card()["id"]
    expect(page.locator("#model-badge")).to_contain_text(Path(model_id).name)
    expect(page.locator("#model-badge")).to_have_attribute("title", re.compile(re.escape(model_id)))
    expect(page.locator("#conn-badge")).to_have_text("connected")
    ids = page.evaluate("[...document.querySelectorAll('[id]')].map(node => node.id)")
    assert len(ids) == len(set(ids)), "element ids must be unique"


def test_chat_streams_the_answer_and_shows_timings(open_page):
    page = open_page()
    # A long story, bounded by tokens: 200 stream over many frames of the page on any host (a short poem's ~12, on
    # a fast host beside a busy suite, reached a headless Chromium all within one frame).
    set_settings(page, temperature=0, max_tokens=200)
    page.evaluate(RECORD_PARTIAL_LENGTHS)
    page.fill("#chat-input", "Write a long story about a dragon who learns to fly.")
    page.press("#chat-input", "Shift+Enter")
    page.type("#chat-input", "Give it a happy ending.")
    prompt = "Write a long story about a dragon who learns to fly.\nGive it a happy ending."
    expect(page.locator("#chat-input")).to_have_value(prompt)
    page.press("#chat-input", "Enter")

    expect(page.locator("#chat-log .msg.user .body")).to_have_text(prompt)
    answer = last_answer(page)
    wait_done(answer)
    partial_lengths = {n for n in page.evaluate("window.__partialLengths") if n > 0}
    assert len(partial_lengths) >= 2, "the answer should grow delta by delta while streaming"
    expect(answer.locator(".body")).to_have_text(re.compile(r"\S"))
    expect(answer.locator("[data-k=ttft]")).to_have_text(re.compile(r"^TTFT \d+ ms$"))
    expect(answer.locator("[data-k=tps]")).to_have_text(re.compile(r"^\d+\.\d tokens/s$"))
    expect(answer.locator("[data-k=tokens]")).to_have_text(re.compile(r"^([1-9]|[1-9][0-9]|1[0-9][0-9]|200) tokens$"))
    expect(answer.locator("[data-k=finish]")).to_have_attribute("data-reason", re.compile(r"^(stop|length)$"))
    expect(page.locator("#chat-send")).to_be_enabled()
    expect(page.locator("#chat-stop")).to_be_disabled()

    page.click("#chat-new")
    expect(page.locator("#chat-log .msg")).to_have_count(0)


def test_stop_keeps_the_partial_answer(open_page):
    page = open_page()
    set_settings(page, temperature=0, max_tokens=STOP_TOKENS)
    send(page, "Write a long story about a dragon who learns to fly.")
    answer = last_answer(page)
    expect(answer.locator(".body")).to_have_text(re.compile(r"\S"), timeout=GENERATION_MS)
    page.click("#chat-stop")

    expect(answer.locator("[data-k=finish]")).to_have_attribute("data-reason", "abort", timeout=GENERATION_MS)
    expect(answer.locator("[data-k=finish]")).to_have_text("stopped")
    partial = answer.locator(".body").inner_text()
    assert partial.strip()
    tokens = int(answer.locator("[data-k=tokens]").inner_text().split()[0])
    assert 1 <= tokens < STOP_TOKENS
    expect(answer.locator(".body")).to_have_text(partial)
    expect(page.locator("#chat-send")).to_be_enabled()


def test_server_errors_are_shown_inline(open_page):
    page = open_page()
    set_settings(page, max_tokens=4)
    too_long = "hello " * 9000  # over the model's 8192-token context: only the server can tell

    send(page, too_long)
    error = last_answer(page).locator(".error")
    expect(error).to_contain_text("context_length_exceeded", timeout=GENERATION_MS)
    expect(error).to_contain_text("8192")
    expect(page.locator("#chat-log .msg.user")).to_have_class(re.compile(r"\bfailed\b"))
    expect(page.locator("#chat-send")).to_be_enabled()

    page.click("#tab-single")
    page.fill("#single-input", too_long)
    page.click("#single-form button[type=submit]")
    expect(page.locator("#single-result .error")).to_contain_text("context_length_exceeded", timeout=GENERATION_MS)


def test_settings_out_of_range_are_refused_in_the_page(open_page):
    page = open_page()
    set_settings(page, temperature=-1)
    send(page, "hello")
    expect(page.locator("#temperature-error")).to_be_visible()
    expect(page.locator("#temperature-error")).to_have_text("Temperature must be between 0 and 100.")
    expect(page.locator("#temperature")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#temperature")).to_be_focused()
    expect(page.locator("#chat-log .msg")).to_have_count(0)

    set_settings(page, temperature=0.5, max_tokens=0, top_p=0, seed=1.5, stop="\n".join("abcdefghi"))
    for name in ("max_tokens", "top_p", "seed", "stop"):
        expect(page.locator(f"#{name}-error")).to_be_visible()
    expect(page.locator("#temperature-error")).to_be_hidden()
    page.click("#tab-batch")
    page.fill("#batch-input", "hello")
    page.click("#batch-form button[type=submit]")
    expect(page.locator("#batch-result .error")).to_contain_text("settings")


def test_model_text_is_never_html(open_page):
    page = open_page(PHONE)
    set_settings(page, temperature=0, max_tokens=1)
    long_word = "https://example.com/" + "a" * 150
    probe = f"{PROBE_IMG} {PROBE_SCRIPT} {long_word}"
    send(page, probe)
    expect(page.locator("#chat-log .msg.user .body")).to_have_text(probe)
    wait_done(last_answer(page))
    assert has_no_horizontal_scroll(page)

    # Raw completion echoes a repeated line: the model's own output now holds the probe.
    set_settings(page, max_tokens=16)
    page.click("#tab-single")
    page.fill("#single-input", f"{PROBE_IMG}\n" * 3)
    page.click("#single-form button[type=submit]")
    result = page.locator("#single-result")
    expect(result.locator(".answer")).to_contain_text(PROBE_IMG, timeout=GENERATION_MS)
    expect(result.locator("[data-k=latency]")).to_have_text(re.compile(r"^latency \d+ ms$"))
    assert page.locator("main img, main script").count() == 0
    assert page.evaluate("window.__xss") is None


def test_batch_mode_returns_one_answer_per_prompt(open_page):
    page = open_page()
    set_settings(page, temperature=0, max_tokens=4)
    page.click("#tab-batch")
    expect(page.locator("#panel-batch")).to_be_visible()
    expect(page.locator("#panel-chat")).to_be_hidden()
    prompts = ["The sky is", "One, two, three,", "My favourite food is"]
    page.fill("#batch-input", "\n".join(prompts))
    page.click("#batch-form button[type=submit]")

    answers = page.locator("#batch-result .answers > li")
    expect(answers).to_have_count(3, timeout=GENERATION_MS)
    for i, prompt in enumerate(prompts):
        expect(answers.nth(i).locator(".prompt")).to_have_text(prompt)
        expect(answers.nth(i).locator("[data-k=finish]")).to_have_attribute("data-reason",
                                                                            re.compile(r"^(stop|length)$"))
    expect(page.locator("#batch-result [data-k=prompts]")).to_have_text("3 prompts")


def test_tabs_and_presets_work_from_the_keyboard(open_page):
    page = open_page()
    page.focus("#tab-chat")
    page.keyboard.press("ArrowRight")
    expect(page.locator("#tab-single")).to_be_focused()
    expect(page.locator("#panel-single")).to_be_visible()
    page.keyboard.press("End")
    expect(page.locator("#panel-batch")).to_be_visible()
    page.keyboard.press("Home")
    expect(page.locator("#panel-chat")).to_be_visible()
    page.locator("#presets button").first.press("Enter")
    expect(page.locator("#chat-input")).to_be_focused()
    expect(page.locator("#chat-input")).not_to_have_value("")


def test_reconnects_after_the_socket_drops(open_page):
    routes = []

    def forward(route):
        route.connect_to_server()
        routes.append(route)

    page = open_page(before_load=lambda page: page.route_web_socket(re.compile(r"/ws(\?|$)"), forward))
    page.evaluate("""() => {
      window.__states = [];
      const badge = document.getElementById('conn-badge');
      // each change of state (the page may set the state it is in again, e.g. once the model card comes)
      new MutationObserver(() => {
        if (badge.dataset.state !== (window.__states.at(-1) ?? 'open')) window.__states.push(badge.dataset.state);
      })
        .observe(badge, {attributes: true, attributeFilter: ['data-state']});
    }""")
    routes[0].close(code=1011, reason="test drop")

    expect(page.locator("#conn-badge")).to_have_attribute("data-state", "open", timeout=10_000)
    assert len(routes) == 2
    assert page.evaluate("window.__states")[:2] == ["closed", "connecting"]
    set_settings(page, max_tokens=2)
    send(page, "Hi")
    wait_done(last_answer(page))


def test_api_key_from_the_settings_reaches_rest_and_socket_never_the_url(browser, make_server_for, tiny_model_dir):
    from app.settings import ServerSettings

    server = make_server_for(tiny_model_dir, ServerSettings(api_key="sekret"))
    context = browser.new_context(viewport=DESKTOP)
    urls = []
    try:
        page = context.new_page()
        page.on("request", lambda request: urls.append(request.url))
        page.on("websocket", lambda ws: urls.append(ws.url))
        page.goto(f"{server.url}/?api_key=sekret")  # a key in the URL is not read
        expect(page.locator("#model-badge")).to_contain_text("a valid API key is required")
        expect(page.locator("#conn-badge")).to_contain_text("API key needed")

        set_settings(page, api_key="sekret")
        page.locator("#api_key").dispatch_event("change")
        expect(page.locator("#conn-badge")).to_have_attribute("data-state", "open")
        expect(page.locator("#model-badge")).to_contain_text("hf")
        set_settings(page, max_tokens=2)
        send(page, "Hi")
        wait_done(last_answer(page))

        page.goto(server.url)  # the key stays with the tab
        expect(page.locator("#conn-badge")).to_have_attribute("data-state", "open")
        assert page.evaluate("sessionStorage.getItem('lockstep.apiKey')") == "sekret"
        assert [url for url in urls if "sekret" in url] == [f"{server.url}/?api_key=sekret"]  # only our goto

        other = context.new_page()  # another tab starts without it
        other.goto(server.url)
        expect(other.locator("#model-badge")).to_contain_text("a valid API key is required")
        expect(other.locator("#conn-badge")).to_have_attribute("data-state", "closed")
    finally:
        context.close()


def test_screenshots_of_a_finished_conversation(open_page, tmp_path):
    """UPDATE_SCREENSHOTS=1 refreshes the README's pictures in docs/; otherwise they go to a temporary folder."""
    folder = DOCS if os.environ.get("UPDATE_SCREENSHOTS") == "1" else tmp_path
    page = open_page(DESKTOP)
    set_settings(page, temperature=0, max_tokens=24)
    send(page, "What is the capital of France? Answer in one sentence.")
    wait_done(last_answer(page))
    set_settings(page, max_tokens=64)
    send(page, "Write a Python function that reverses a string, in a code block.")
    wait_done(last_answer(page))
    page.locator("#chat-input").blur()
    page.screenshot(path=folder / "screenshot-desktop.png")

    page.set_viewport_size(PHONE)
    page.click("#settings > summary")  # a phone opens with the settings folded
    expect(page.locator("#temperature")).to_be_hidden()
    assert has_no_horizontal_scroll(page)
    last_answer(page).evaluate("answer => answer.scrollIntoView({block: 'end'})")  # lands above the composer
    page.screenshot(path=folder / "screenshot-phone.png")
