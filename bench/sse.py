"""A text/event-stream reader for the OpenAI-style streaming endpoints of the servers we compare against.

It follows the WHATWG rules that matter for these servers: an event is the `data:` lines before a blank line,
joined by newlines (one optional space after the colon is dropped); comment lines (`:`) and other fields (`event:`,
`id:`, `retry:`) carry no data; lines end in LF, CRLF or CR. An event left open at the end of the stream is still
delivered (the spec drops it; a server that omits the last blank line should not lose its final chunk here).
Events are yielded as their last line arrives, so the caller can timestamp them.
"""
import re
from collections.abc import Iterable, Iterator

DONE = "[DONE]"  # OpenAI's end-of-stream sentinel
_LINE_ENDING = re.compile(rb"\r\n?|\n")


def iter_event_data(lines: Iterable[bytes]) -> Iterator[str]:
    """The `data` of each event in a stream of raw lines (as `HTTPResponse.readline` gives them)."""
    data_lines: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data_lines:
                yield "\n".join(data_lines)
            data_lines = []
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data_lines.append(value[1:] if value.startswith(" ") else value)
    if data_lines:
        yield "\n".join(data_lines)


def split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Raw lines from arbitrary byte chunks (a recorded stream cut anywhere), each with its line ending; a lone
    CR ends a line too."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        while (end := _line_end(pending)) is not None:
            yield pending[:end]
            pending = pending[end:]
    if pending:
        yield pending


def _line_end(buffer: bytes) -> int | None:
    """The index just past the first complete line ending in `buffer` (None if there is none yet); a CR at the very
    end may be the first half of CRLF, so it waits for the next chunk."""
    match = _LINE_ENDING.search(buffer)
    if match is None or (match.group() == b"\r" and match.end() == len(buffer)):
        return None
    return match.end()
