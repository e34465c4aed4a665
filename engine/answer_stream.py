"""An answer's text taken apart as it streams: the model's reasoning (a `<think>` block, where the chat template has
one), the text meant for the user, and tool calls (each one's name as soon as it is known, its arguments as they
form). A whole answer is read by the same splitter, so a streamed answer and a returned one are told apart alike,
and call markup never reaches the text.

Calls are constrained by their grammar (engine/tool_calls.py), so the splitter can follow a call's JSON as it comes:
it finds the call's name and the raw text of its arguments by the object's own structure (not by the closing
markup, which a string inside the arguments could hold).
"""
import json
import logging
from dataclasses import dataclass, field

from .errors import EngineError
from .tool_calls import ToolCall, ToolFormat, ToolRequest, new_call_id

logger = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's prefix of a call (llama3-json)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    index: int
    call: ToolCall


Part = ContentDelta | ReasoningDelta | CallStart | ArgumentsDelta | CallEnd


@dataclass(frozen=True)
class SplitAnswer:
    """A whole answer taken apart: `content` None when the answer is calls only."""

    content: str | None
    reasoning: str | None
    calls: tuple[ToolCall, ...]


def template_has_reasoning(chat_template: str | None) -> bool:
    """Whether a chat template knows a reasoning block (Qwen3's, DeepSeek-R1's `<think>`)."""
    return bool(chat_template) and THINK_OPEN in chat_template and THINK_CLOSE in chat_template


def opens_reasoning(render, thinking: bool | None) -> bool:
    """Whether the template's generation prompt itself opens the `<think>` block (so the answer starts inside
    it), asked of `render(messages, extra)` with a one-message chat."""
    extra = {} if thinking is None else {"enable_thinking": thinking}
    try:
        return render([{"role": "user", "content": "Hi"}], extra).rstrip().endswith(THINK_OPEN)
    except EngineError:  # a template that refuses a lone user message: the answer opens its own block
        return False


@dataclass(frozen=True)
class AnswerShape:
    """What to look for in an answer: calls (the request's tools, in the template's format) and reasoning
    (`in_reasoning`: the prompt already opened the `<think>` block, so the answer starts inside it)."""

    tools: ToolRequest | None = None
    tool_format: ToolFormat | None = None
    has_reasoning: bool = False
    in_reasoning: bool = False

    @property
    def has_calls(self) -> bool:
        return self.tools is not None and bool(self.tools.offered) and self.tool_format is not None

    @property
    def is_plain(self) -> bool:
        """Nothing to take apart: the text is the answer."""
        return not (self.has_calls or self.has_reasoning)

    @property
    def reasoning_grammar(self) -> str | None:
        """What a forced call's grammar lets come before the calls (engine/tool_calls.py's REASONING_PREFIXES)."""
        if not self.has_reasoning:
            return None
        return "open" if self.in_reasoning else "optional"

    def split(self, text: str) -> SplitAnswer:
        splitter = AnswerSplitter(self)
        splitter.feed(text)
        splitter.finish()
        return splitter.result()


class CallScanner:
    """Follows one call's JSON object as it streams: its name once that string closes, and the raw text of its
    arguments value (the object under `arguments` or `parameters`) as it comes."""

    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self):
        self.body: list[str] = []
        self.depth = 0
        self.in_string = self.escaped = False
        self.expects_key = self.reads_key = self.after_colon = False
        self.key_start = 0
        self.key: str | None = None  # the top-level key whose value comes next (or is being read)
        self.value_start: int | None = None
        self.name: str | None = None
        self.arguments_span: tuple[int, int] | None = None
        self.is_done = self.is_broken = False

    def feed(self, text: str) -> int:
        """Read `text` up to the end of the object; return how many characters were read."""
        for count, char in enumerate(text, 1):
            self._read(char)
            if self.is_done or self.is_broken:
                return count
        return len(text)

    def arguments_so_far(self) -> str:
        if self.arguments_span is not None:
            return "".join(self.body[slice(*self.arguments_span)])
        if self.key in self.ARGUMENT_KEYS and self.value_start is not None:
            return "".join(self.body[self.value_start:])
        return ""

    @property
    def text(self) -> str:
        return "".join(self.body)

    def _read(self, char: str) -> None:
        position = len(self.body)
        self.body.append(char)
        if self.in_string:
            self._read_in_string(char, position)
        elif char == '"':
            self.in_string = True
            if self.depth == 1 and self.expects_key:
                self.reads_key, self.expects_key, self.key_start = True, False, position
            elif self.depth == 1 and self.after_colon:
                self._start_value(position)
        elif char in "{[":
            if self.depth == 0 and char == "[":
                self.is_broken = True
            if self.depth == 1 and self.after_colon:
                self._start_value(position)
            self.depth += 1
            self.expects_key = self.depth == 1
        elif char in "}]":
            if self.depth == 1 and self.value_start is not None:  # a number, true, false or null ends here
                self._end_value(position)
            self.depth -= 1
            if self.depth == 1 and self.value_start is not None:  # an object or array value ends here
                self._end_value(position + 1)
            self.is_done = self.depth == 0
        elif self.depth == 0:
            self.is_broken = not char.isspace()
        elif self.depth == 1:
            self._read_top_level(char, position)

    def _read_in_string(self, char: str, position: int) -> None:
        if self.escaped:
            self.escaped = False
        elif char == "\\":
            self.escaped = True
        elif char == '"':
            self.in_string = False
            if self.depth == 1 and self.reads_key:
                self.reads_key = False
                self.key = _json_or_none("".join(self.body[self.key_start:position + 1]))
            elif self.depth == 1 and self.value_start is not None:
                self._end_value(position + 1)

    def _read_top_level(self, char: str, position: int) -> None:
        if char == ":":
            self.after_colon = True
        elif char == ",":
            if self.value_start is not None:
                self._end_value(position)
            self.expects_key = True
        elif self.after_colon and not char.isspace():
            self._start_value(position)

    def _start_value(self, position: int) -> None:
        self.value_start, self.after_colon = position, False

    def _end_value(self, end: int) -> None:
        text = "".join(self.body[self.value_start:end])
        if self.key == "name":
            value = _json_or_none(text)
            self.name = value if isinstance(value, str) else None
        elif self.key in self.ARGUMENT_KEYS:
            self.arguments_span = (self.value_start, end)
        self.value_start, self.key = None, None


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclass
class _OpenCall:
    index: int
    scanner: CallScanner = field(default_factory=CallScanner)
    id: str = field(default_factory=new_call_id)
    started: bool = False
    sent_arguments: int = 0


class AnswerSplitter:
    """Feed it the answer's text as it comes; each feed returns the parts it could tell apart so far. Text that may
    be the start of markup (`<tool_ca`, `</thi`) is held until the next feed shows what it is."""

    def __init__(self, shape: AnswerShape):
        self.shape = shape
        self.stage = "reasoning" if shape.in_reasoning else "start" if shape.has_reasoning else "content"
        self.pending = ""
        self.parts: list[Part] = []
        self.content_text = _Channel(self.parts, ContentDelta)
        self.reasoning_text = _Channel(self.parts, ReasoningDelta)
        self.calls: list[ToolCall] = []
        self.call: _OpenCall | None = None
        self.num_calls = 0

    # -- the interface ------------------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Part]:
        self.pending += text
        while self.pending and self._step():
            pass
        return self._take_parts()

    def finish(self) -> list[Part]:
        """The answer ended: what was held is given out (an unfinished call is dropped: it was cut short)."""
        if self.stage == "reasoning":
            self._reasoning(self.pending)
        elif self.stage == "after_call":
            self._end_call()
        elif self.stage != "call":
            self._content(self.pending, final=True)
        self.pending = ""
        self.reasoning_text.close(keep_held=False)
        self.content_text.close(keep_held=not self.calls)  # after calls, what is held is markup cut short
        return self._take_parts()

    def result(self) -> SplitAnswer:
        content = self.content_text.text
        if self.calls:
            content = content or None
        return SplitAnswer(content, self.reasoning_text.text or None, tuple(self.calls))

    # -- the stages -----------------------------------------------------------------------------------------------

    def _step(self) -> bool:
        """Take what the pending text allows in the current stage; False when it must wait for more."""
        return {"start": self._start, "reasoning": self._in_reasoning, "content": self._in_content,
                "text": self._in_text, "call": self._in_call, "after_call": self._after_call}[self.stage]()

    def _start(self) -> bool:
        text = self.pending.lstrip()
        if text.startswith(THINK_OPEN):
            self.pending, self.stage = text[len(THINK_OPEN):], "reasoning"
            return True
        if THINK_OPEN.startswith(text):
            return False
        self.stage = "content"
        return True

    def _in_reasoning(self) -> bool:
        if not self._give_until(THINK_CLOSE, self._reasoning):
            return False
        self.stage = "content"
        return True

    def _in_content(self) -> bool:
        if not self.shape.has_calls or not self._may_call():
            self.stage = "text"
            return True
        tool_format = self.shape.tool_format
        if not tool_format.opening:
            return self._maybe_whole_answer_call()
        if not self._give_until(tool_format.opening.strip(), self._content):
            return False
        self._open_call()
        return True

    def _give_until(self, marker: str, give) -> bool:
        """Give the pending text to `give` up to `marker`, which is dropped (True), or, where it has not come yet,
        up to what may be its start (False: the rest waits for more)."""
        at = self.pending.find(marker)
        if at >= 0:
            give(self.pending[:at])
            self.pending = self.pending[at + len(marker):]
            return True
        kept = len(self.pending) - _partial_marker(self.pending, marker)
        give(self.pending[:kept])
        self.pending = self.pending[kept:]
        return False

    def _maybe_whole_answer_call(self) -> bool:
        """llama3-json: the answer is one call when it opens with `{` (or Llama's python tag)."""
        text = self.pending.lstrip()
        if not text or (PYTHON_TAG.startswith(text) and not self.content_text.started):
            return False
        if not self.content_text.started and (text.startswith("{") or text.startswith(PYTHON_TAG)):
            self.pending = text.removeprefix(PYTHON_TAG)
            self._open_call()
            return True
        self.stage = "text"
        return True

    def _in_text(self) -> bool:
        self._content(self.pending)
        self.pending = ""
        return False

    def _in_call(self) -> bool:
        scanner = self.call.scanner
        read = scanner.feed(self.pending)
        self.pending = self.pending[read:]
        if scanner.is_broken:  # not a call after all (unconstrained text can open one): it stays text
            logger.info("text that opened a call is not a call's JSON; kept as text")
            self._content(self.shape.tool_format.opening.strip() + scanner.text)
            self.call, self.stage = None, "content"
            return True
        self._send_call_progress()
        if scanner.is_done:
            self.stage = "after_call"
            return True
        return False

    def _after_call(self) -> bool:
        closing = self.shape.tool_format.closing.strip()
        text = self.pending.lstrip()
        if closing and text.startswith(closing):
            self.pending = text[len(closing):]
        elif closing and closing.startswith(text):
            return False  # `\n</tool_` so far
        self._end_call()
        self.stage = "content"
        return True

    # -- calls ----------------------------------------------------------------------------------------------------

    def _may_call(self) -> bool:
        tools, tool_format = self.shape.tools, self.shape.tool_format
        return self.num_calls == 0 or (tools.is_parallel and tool_format.allows_several)

    def _open_call(self) -> None:
        self.content_text.drop_held()  # whitespace before a call is no part of the text
        self.call = _OpenCall(self.num_calls)
        self.num_calls += 1
        self.stage = "call"

    def _send_call_progress(self) -> None:
        call, scanner = self.call, self.call.scanner
        if not call.started and scanner.name is not None:
            call.started = True
            self.parts.append(CallStart(call.index, call.id, scanner.name))
        if call.started:
            arguments = scanner.arguments_so_far()
            if len(arguments) > call.sent_arguments:
                self.parts.append(ArgumentsDelta(call.index, arguments[call.sent_arguments:]))
                call.sent_arguments = len(arguments)

    def _end_call(self) -> None:
        call, self.call = self.call, None
        made = self._checked_call(call)
        if made is None:
            logger.warning("a call the grammar should have kept valid does not name an offered tool with object "
                           "arguments; dropped")
            return
        self.calls.append(made)
        self.parts.append(CallEnd(call.index, made))

    def _checked_call(self, call: _OpenCall) -> ToolCall | None:
        value = _json_or_none(call.scanner.text)
        offered = {tool.name for tool in self.shape.tools.offered}
        arguments = call.scanner.arguments_so_far() or "{}"
        if not isinstance(value, dict) or value.get("name") not in offered or not call.started:
            return None
        if not isinstance(_json_or_none(arguments), dict):
            return None
        return ToolCall(call.id, call.scanner.name, arguments)

    # -- text -----------------------------------------------------------------------------------------------------

    def _reasoning(self, text: str, final: bool = False) -> None:
        self.reasoning_text.add(text, final)

    def _content(self, text: str, final: bool = False) -> None:
        self.content_text.add(text, final)

    def _take_parts(self) -> list[Part]:
        parts = list(self.parts)
        self.parts.clear()  # in place: the channels append to this list
        return parts


class _Channel:
    """One kind of text (the answer's, the reasoning's): its leading whitespace dropped, and whitespace held until
    more text follows, so that neither starts nor ends with the blank lines around markup."""

    def __init__(self, parts: list[Part], kind):
        self.parts, self.kind = parts, kind
        self.pieces: list[str] = []
        self.held = ""
        self.started = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, text: str, final: bool = False) -> None:
        if not self.started:
            text = text.lstrip()
            if not text:
                return
            self.started = True
        body = "" if final else text.rstrip()
        if body:
            self._emit(self.held + body)
            self.held = text[len(body):]
        else:
            self.held += text

    def drop_held(self) -> None:
        self.held = ""

    def close(self, keep_held: bool) -> None:
        """The end: what is held is given out when it is text, not whitespace (or markup cut short)."""
        if keep_held and self.held.strip():
            self._emit(self.held.rstrip())
        self.held = ""

    def _emit(self, text: str) -> None:
        self.pieces.append(text)
        self.parts.append(self.kind(text))


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
