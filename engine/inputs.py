"""InputProcessor: a prompt, chat messages or token ids -> validated prompt token ids.

The first of vLLM v1's three roles (input processing -> engine core -> output processing). It refuses
what cannot be tokenized or cannot fit *before* tokenizing, bounds how much tokenization runs at once
(a 900 KB prompt costs ~170 MB while it is tokenized), and encodes chat content with special tokens
as plain text, so `<|im_end|>` in a message cannot forge a turn; the template's own markers stay special.

A raw `prompt` keeps its special tokens, as vLLM's completions endpoint does: it is the caller's whole
model input, with no other party's turn in it to forge.
"""
import json
import logging
import math
import re
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from jinja2 import TemplateError

from .errors import InvalidRequest, Overloaded, PromptTooLong
from .hardware import available_cores
from .memory import release_freed_memory

logger = logging.getLogger(__name__)

SMALL_INPUT_CHARS = 16384  # tokenized at once, never queued: microseconds and a few MB at most
TOKENIZE_WAIT_S = 10.0
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# How many input characters one normalized character can stand for. NFC/NFKC compose at most 4 code points
# into one (no canonical decomposition is longer, e.g. U+1FAF); unlisted normalizers (Strip, BertNormalizer,
# regex Replace, ...) can delete any number, so a tokenizer that uses one gets no bound.
_NORMALIZER_SHRINK = {"Prepend": 1, "Lowercase": 1, "NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4}
_NON_DROPPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


def check_encodable(text: str, param: str, label: str = "") -> None:
    """Refuse text no tokenizer can take: a Python str may hold lone surrogates (JSON "\\ud800" decodes to one).
    Control characters, NUL included, are text: byte-level tokenizers encode them."""
    if text.isascii():
        return
    match = _LONE_SURROGATE.search(text)
    if match:
        raise InvalidRequest(f"{label or param} is not valid Unicode text: a lone surrogate "
                             f"(U+{ord(match.group()):04X}) at character {match.start()}", param)


@dataclass(frozen=True)
class ChatPiece:
    text: str
    is_content: bool  # a message's content (plain text) or the template's own markup (special tokens live)


class InputProcessor:
    """Thread-safe: tokenizes with private copies of the fast tokenizer that are never reconfigured
    (transformers flips the shared tokenizer's `encode_special_tokens` per call, which races)."""

    def __init__(self, tokenizer, max_model_len: Callable[[], int], max_parallel: int = 0,
                 wait_s: float = TOKENIZE_WAIT_S):
        self.tokenizer = tokenizer  # renders the chat template
        backend = tokenizer.backend_tokenizer
        self._markup = _private_copy(backend, special_tokens_as_text=False)
        self._text = _private_copy(backend, special_tokens_as_text=True)
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._special_texts = tuple(t.content for t in backend.get_added_tokens_decoder().values() if t.special)
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._max_model_len = max_model_len
        self.max_chars_per_token = max_chars_per_token(backend)
        self._slots = threading.BoundedSemaphore(max_parallel or available_cores())
        self._wait_s = wait_s
        logger.info("input processor: at most %s characters per token", self.max_chars_per_token)

    @property
    def max_prompt_chars(self) -> int | None:
        """No prompt longer than this can fit in the context: every token covers at most `max_chars_per_token`."""
        if not self.max_chars_per_token or not self._max_model_len():
            return None
        return self._max_model_len() * self.max_chars_per_token

    # -- the three kinds of input -----------------------------------------------------------------------

    def process(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                prompt_token_ids: list[int] | None = None, tools: list[dict] | None = None,
                thinking: bool | None = None) -> list[int]:
        """`prompt` is text, or token ids as OpenAI's completions take them (checked like `prompt_token_ids`)."""
        if prompt_token_ids is not None:
            return self.check_token_ids(prompt_token_ids)
        if isinstance(prompt, list):
            return self.check_token_ids(prompt, "prompt")
        if messages is not None:
            return self.encode_chat(messages, tools, thinking)
        return self.encode_prompt(prompt)

    def encode_prompt(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequest("prompt must be a non-empty string", "prompt")
        self._check_length(len(prompt), "prompt")
        check_encodable(prompt, "prompt")
        with self._tokenizing(len(prompt)):
            return self._encode(self._markup, prompt, "prompt", add_special_tokens=True).ids

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    thinking: bool | None = None) -> list[int]:
        """`tools` (OpenAI's shape) and the messages' `tool_calls` go to a template that renders them: they are
        markup there, so special-token text in them is refused rather than encoded as a special token. `thinking`
        is the template's `enable_thinking` (None: not passed)."""
        if not self.tokenizer.chat_template:
            raise InvalidRequest("this model has no chat template; send a prompt instead", "messages")
        contents = _contents(messages)
        markup = _tool_markup(messages, tools)
        num_chars = sum(map(len, contents)) + len(markup)
        self._check_length(num_chars, "messages")
        for index, content in enumerate(contents):
            check_encodable(content, "messages", f"messages[{index}].content")
        self._refuse_special_texts(markup, "the tools and tool calls")
        with self._tokenizing(num_chars):
            extra = {"tools": tools} if thinking is None else {"tools": tools, "enable_thinking": thinking}
            pieces = self._render_pieces(messages, extra)
            if pieces is None:
                return self._encode_unsplit(messages, contents, extra)
            return self._encode_pieces(pieces)

    @property
    def chat_template(self) -> str | None:
        template = self.tokenizer.chat_template
        return template if isinstance(template, str) else None

    def check_token_ids(self, token_ids: list[int], param: str = "prompt_token_ids") -> list[int]:
        if not isinstance(token_ids, list) or not token_ids:
            raise InvalidRequest(f"{param} must be a non-empty list of token ids", param)
        bad = next((index for index, i in enumerate(token_ids)
                    if type(i) is not int or not 0 <= i < self._vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{param} must hold integer token ids in [0, {self._vocab_size}) (this model's "
                                 f"vocabulary); {param}[{bad}] is {repr(token_ids[bad])[:32]}", param)
        return list(token_ids)

    # -- checks before tokenizing ---------------------------------------------------------------------------

    def _check_length(self, num_chars: int, param: str) -> None:
        limit = self.max_prompt_chars
        if limit is not None and num_chars > limit:
            raise PromptTooLong(f"{param} has {num_chars} characters; this model's context holds "
                                f"{self._max_model_len()} tokens of at most {self.max_chars_per_token} "
                                f"characters each ({limit} characters)", param)

    @contextmanager
    def _tokenizing(self, num_chars: int) -> Iterator[None]:
        """At most one long tokenization per core; past `wait_s` the caller is told to retry (never waits forever)."""
        if num_chars <= SMALL_INPUT_CHARS:
            yield
            return
        if not self._slots.acquire(timeout=self._wait_s):
            raise Overloaded("too many long prompts are being tokenized; retry shortly")
        try:
            yield
        finally:
            self._slots.release()
            release_freed_memory()

    # -- chat: template markup stays special, content is plain text ---------------------------------------------

    def render(self, messages: list[dict], extra: dict | None = None) -> str:
        """The chat as the template writes it, ending with the assistant's opening; `extra`: the template's
        other arguments (tools, enable_thinking)."""
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                      **(extra or {}))
        except TemplateError as exc:  # the template's own raise_exception (roles must alternate, ...)
            raise InvalidRequest(f"the chat template refused these messages: {exc}", "messages") from None

    def _render_pieces(self, messages: list[dict], extra: dict) -> list[ChatPiece] | None:
        """The rendered chat cut into markup and content, or None if the template changes the contents
        (trims, cuts, escapes them), so that where each content lies is not known exactly."""
        nonce = secrets.token_hex(8)
        marked = [{**m, "content": f"[lockstep-content:{nonce}:{i}]"} if isinstance(m["content"], str) else m
                  for i, m in enumerate(messages)]
        parts = re.split(rf"\[lockstep-content:{nonce}:(\d+)\]", self.render(marked, extra))
        # re.split with a group alternates: markup, content index, markup, ..., markup
        pieces = [ChatPiece(messages[int(part)]["content"], True) if i % 2 else ChatPiece(part, False)
                  for i, part in enumerate(parts)]
        if "".join(p.text for p in pieces) != self.render(messages, extra):
            return None
        return [p for p in pieces if p.text]

    def _encode_pieces(self, pieces: list[ChatPiece]) -> list[int]:
        whole = self._encode(self._markup, "".join(p.text for p in pieces), "messages", add_special_tokens=False)
        if not self._special_token_in_content(whole, _content_spans(pieces)):
            return whole.ids  # the usual case: exactly what tokenizer.apply_chat_template gives
        logger.info("special-token text inside chat content: encoding it as plain text")
        token_ids = []
        for piece in pieces:
            encoder = self._text if piece.is_content else self._markup
            token_ids += self._encode(encoder, piece.text, "messages", add_special_tokens=False).ids
        return token_ids

    def _encode_unsplit(self, messages: list[dict], contents: list[str], extra: dict) -> list[int]:
        """A template that rewrites contents: safe as one string only if no content holds special-token text."""
        for content in contents:
            self._refuse_special_texts(content, "message content")
        return self._encode(self._markup, self.render(messages, extra), "messages", add_special_tokens=False).ids

    def _refuse_special_texts(self, text: str, what: str) -> None:
        forged = next((s for s in self._special_texts if s in text), None)
        if forged is not None:
            raise InvalidRequest(f"{what} may not contain the special token {forged!r} with this model's chat "
                                 "template", "messages")

    def _special_token_in_content(self, encoding, content_spans: list[tuple[int, int]]) -> bool:
        for index, token_id in enumerate(encoding.ids):
            if token_id in self._special_ids:
                start, end = encoding.token_to_chars(index)
                if any(start < span_end and span_start < end for span_start, span_end in content_spans):
                    return True
        return False

    # -- tokenizing -------------------------------------------------------------------------------------

    @staticmethod
    def _encode(encoder, text: str, param: str, add_special_tokens: bool):
        try:
            return encoder.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises bare Exception/TypeError for text it refuses
            raise InvalidRequest(f"{param} could not be tokenized: {exc}", param) from None


def _contents(messages: list[dict]) -> list[str]:
    """Each message's text; an assistant message that only calls tools has none ("")."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects", "messages")
    if not all(isinstance(m, dict) and (isinstance(m.get("content"), str)
                                        or (m.get("content") is None and m.get("tool_calls"))) for m in messages):
        raise InvalidRequest("each message needs a string content (or tool calls)", "messages")
    return [m["content"] or "" for m in messages]


def _tool_markup(messages: list[dict], tools: list[dict] | None) -> str:
    """What of the tools and the calls a template writes as its own text (JSON: the characters it may hold)."""
    calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
    return json.dumps([tools or [], calls], ensure_ascii=False) if tools or calls else ""


def _content_spans(pieces: list[ChatPiece]) -> list[tuple[int, int]]:
    spans, position = [], 0
    for piece in pieces:
        if piece.is_content:
            spans.append((position, position + len(piece.text)))
        position += len(piece.text)
    return spans


def _private_copy(backend, special_tokens_as_text: bool):
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = special_tokens_as_text
    return copy


def max_chars_per_token(backend) -> int | None:
    """The most characters of input one token can stand for, or None if this tokenizer has no such bound
    (it drops or merges characters, or one unknown token can swallow any run of them).

    Byte-level vocabularies spell each byte as one character, so a token's length is its byte count,
    and a character is at least one byte: len(prompt) <= sum of token lengths <= tokens * longest."""
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    added = spec.get("added_tokens") or []
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _pre_tokenizer_keeps_characters(spec.get("pre_tokenizer")):
        return None
    if model.get("fuse_unk") or any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    vocab = model.get("vocab") or {}
    pieces = vocab.keys() if isinstance(vocab, dict) else (entry[0] for entry in vocab)  # Unigram: [piece, score]
    longest = max((len(p) for p in pieces), default=0)
    longest = max([longest, model.get("max_input_chars_per_word") or 0, *(len(t["content"]) for t in added)])
    return longest * shrink or None


def _normalizer_shrink(part: dict | None) -> int | None:
    if part is None:
        return 1
    if part["type"] == "Sequence":
        factors = [_normalizer_shrink(child) for child in part["normalizers"]]
        return None if None in factors else math.prod(factors)
    if part["type"] == "Replace":  # " " -> "▁" keeps the length; a regex or a shorter content may not
        pattern = part.get("pattern", {})
        keeps_length = "String" in pattern and len(part.get("content", "")) >= len(pattern["String"])
        return 1 if keeps_length else None
    return _NORMALIZER_SHRINK.get(part["type"])


def _pre_tokenizer_keeps_characters(part: dict | None) -> bool:
    if part is None:
        return True
    if part["type"] == "Sequence":
        return all(_pre_tokenizer_keeps_characters(child) for child in part["pretokenizers"])
    if part["type"] == "Split":
        return part.get("behavior") != "Removed"
    return part["type"] in _NON_DROPPING_PRE_TOKENIZERS
