"""A response's output items, built as its answer is taken apart (engine/answer_stream.py): a `reasoning` item for
the model's thinking, the assistant's `message`, and a `function_call` item per call, in the order they appear.

The same builder serves POST /v1/responses (the whole answer at once) and the WebSocket mode, where each step is
also an event as OpenAI's stream names them: response.output_item.added / .done, response.content_part.added /
.done, response.output_text.delta / .done, response.reasoning_text.delta / .done and
response.function_call_arguments.delta / .done.
"""
import uuid
from collections.abc import Callable

from engine import FinishReason, RequestOutput
from engine.answer_stream import (AnswerShape, AnswerSplitter, ArgumentsDelta, CallEnd, CallStart, ContentDelta,
                                  Part, ReasoningDelta)

Emit = Callable[..., None]  # emit(event_type, **fields)


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, status: str, text: str | None) -> dict:
    """The assistant's message item; `text` None: as it starts (no content yet)."""
    content = [] if text is None else [output_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def item_status(output: RequestOutput) -> str:
    return "completed" if output.finish_reason is FinishReason.STOP else "incomplete"


class OutputItems:
    """Feed it the answer's text; `finish` closes every item and returns them. `emit` hears each step as an event
    (nothing when None). A plain answer (no tools, no reasoning) has its message item from the start, as before
    any text; otherwise each item opens when its first part comes."""

    def __init__(self, shape: AnswerShape, emit: Emit | None = None):
        self.splitter = None if shape.is_plain else AnswerSplitter(shape)
        self.emit = emit or (lambda event_type, **fields: None)
        self.items: list[dict] = []
        self.texts: dict[int, list[str]] = {}  # output index -> the text (or arguments) so far
        self.reasoning_at: int | None = None  # the open reasoning item's output index
        self.message_at: int | None = None
        self.calls_at: dict[int, int] = {}  # a call's index in the answer -> its item's output index
        if self.splitter is None:
            self._open_message()

    def feed(self, text: str) -> None:
        self._take(self.splitter.feed(text) if self.splitter is not None else [ContentDelta(text)] if text else [])

    def finish(self, output: RequestOutput) -> list[dict]:
        if self.splitter is not None:
            self._take(self.splitter.finish())
        self._close_reasoning()
        if self.message_at is not None:
            self._close_message(item_status(output))
        for at in self.calls_at.values():  # calls cut short (their end never came): as far as they streamed
            self._close_call(at, "".join(self.texts[at]), "incomplete")
        self.calls_at.clear()
        return self.items

    # -- the parts ------------------------------------------------------------------------------------------------

    def _take(self, parts: list[Part]) -> None:
        for part in parts:
            if not isinstance(part, ReasoningDelta):
                self._close_reasoning()
            match part:
                case ReasoningDelta(text):
                    self._reasoning(text)
                case ContentDelta(text):
                    if self.message_at is None:
                        self._open_message()
                    self._append(self.message_at, "response.output_text.delta", text, content_index=0,
                                 logprobs=[])
                case CallStart(index, call_id, name):
                    self.calls_at[index] = self._add({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                                                      "status": "in_progress", "call_id": call_id, "name": name,
                                                      "arguments": ""})
                case ArgumentsDelta(index, text):
                    self._append(self.calls_at[index], "response.function_call_arguments.delta", text)
                case CallEnd(index, call):
                    self._close_call(self.calls_at.pop(index), call.arguments, "completed")

    def _close_call(self, at: int, arguments: str, status: str) -> None:
        item = self.items[at]
        item.update(arguments=arguments, status=status)
        self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=at, name=item["name"],
                  arguments=arguments)
        self.emit("response.output_item.done", output_index=at, item=item)

    def _reasoning(self, text: str) -> None:
        if self.reasoning_at is None:
            self.reasoning_at = self._add({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                                           "content": [], "status": "in_progress"})
        self._append(self.reasoning_at, "response.reasoning_text.delta", text, content_index=0)

    def _close_reasoning(self) -> None:
        at, self.reasoning_at = self.reasoning_at, None
        if at is None:
            return
        item, text = self.items[at], "".join(self.texts[at])
        item.update(content=[{"type": "reasoning_text", "text": text}], status="completed")
        self.emit("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0, text=text)
        self.emit("response.output_item.done", output_index=at, item=item)

    def _open_message(self) -> None:
        self.message_at = self._add(message_item(f"msg_{uuid.uuid4().hex}", "in_progress", None))
        self.emit("response.content_part.added", item_id=self.items[self.message_at]["id"],
                  output_index=self.message_at, content_index=0, part=output_text_part(""))

    def _close_message(self, status: str) -> None:
        at, self.message_at = self.message_at, None
        item, text = self.items[at], "".join(self.texts[at])
        item.update(message_item(item["id"], status, text))
        ref = {"item_id": item["id"], "output_index": at, "content_index": 0}
        self.emit("response.output_text.done", **ref, text=text, logprobs=[])
        self.emit("response.content_part.done", **ref, part=output_text_part(text))
        self.emit("response.output_item.done", output_index=at, item=item)

    # -- items ----------------------------------------------------------------------------------------------------

    def _add(self, item: dict) -> int:
        self.items.append(item)
        at = len(self.items) - 1
        self.texts[at] = []
        self.emit("response.output_item.added", output_index=at, item=dict(item))
        return at

    def _append(self, at: int, event_type: str, text: str, **fields) -> None:
        self.texts[at].append(text)
        self.emit(event_type, item_id=self.items[at]["id"], output_index=at, **fields, delta=text)
