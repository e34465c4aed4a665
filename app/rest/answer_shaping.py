"""Shaping answers: choices (n samples per prompt) and log-probabilities in OpenAI's shapes, from the engine's
outputs.

Chat:        choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
Completions: choices[i].logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}
The numbers are the model's own distribution (see engine/backends/sampler.py). A token that ends inside a
UTF-8 character shows U+FFFD in the chat shape's `token`, its `bytes` exact; the completions shape, whose
`top_logprobs` are keyed by the token, spells it by its bytes as OpenAI does ("bytes:\\xf0\\x9f").
"""
import codecs
import itertools
from collections.abc import Iterable

from engine import RequestOutput, SamplingParams
from engine import TokenLogprob, TokenTexts
from engine.answer_stream import (AnswerShape, ArgumentsDelta, CallStart, ContentDelta, Part, ReasoningDelta,
                                  SplitAnswer)
from engine.tool_calls import ToolCall


def chat_choices(output: RequestOutput, sampling: SamplingParams, texts: TokenTexts,
                 shape: AnswerShape | None = None) -> list[dict]:
    return [{"index": choice.index, **_chat_answer(choice.text, choice.finish_reason.value, shape),
             "logprobs": chat_logprobs(choice.logprobs, texts) if sampling.logprobs is not None else None}
            for choice in output.choices]


def _chat_answer(text: str, finish_reason: str, shape: AnswerShape | None) -> dict:
    """The message and finish reason: the reasoning and the calls taken out of the text where there are any."""
    if shape is None or shape.is_plain:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    answer = shape.split(text)
    message = {"role": "assistant", "content": answer.content, **reasoning_fields(answer)}
    if answer.calls:
        message["tool_calls"] = [call_object(call) for call in answer.calls]
    return {"message": message, "finish_reason": calls_finish_reason(finish_reason, answer)}


def reasoning_fields(answer: SplitAnswer) -> dict:
    """The reasoning under both names clients read: `reasoning_content` (DeepSeek's, vLLM's) and `reasoning`."""
    return {} if answer.reasoning is None else {"reasoning_content": answer.reasoning, "reasoning": answer.reasoning}


def call_object(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def streamed_parts(parts: list[Part]) -> dict:
    """A /ws delta frame's fields for what the splitter told apart: `text` (the answer's), `reasoning`, and
    `tool_calls` as OpenAI's streamed chunks carry them (the first of a call with its id and name, then pieces of
    its arguments)."""
    fields = {"text": "".join(part.text for part in parts if isinstance(part, ContentDelta))}
    reasoning = "".join(part.text for part in parts if isinstance(part, ReasoningDelta))
    if reasoning:
        fields["reasoning"] = reasoning
    calls = []
    for part in parts:
        match part:
            case CallStart(index, call_id, name):
                calls.append({"index": index, "id": call_id, "type": "function",
                              "function": {"name": name, "arguments": ""}})
            case ArgumentsDelta(index, text):
                calls.append({"index": index, "function": {"arguments": text}})
    if calls:
        fields["tool_calls"] = calls
    return fields


def calls_finish_reason(finish_reason: str, answer: SplitAnswer) -> str:
    """An answer that ended with its calls finished for them ("tool_calls"), as OpenAI says."""
    return "tool_calls" if answer.calls and finish_reason == "stop" else finish_reason


def completion_choices(outputs: list[RequestOutput], prompts: list, sampling: SamplingParams,
                       texts: TokenTexts) -> list[dict]:
    """Prompt i's sample j is choice i * n + j, as OpenAI numbers them."""
    choices = []
    for output, prompt in zip(outputs, prompts):
        for choice in output.choices:
            prefix = _prompt_text(prompt, choice, texts) if sampling.echo else ""
            choices.append({"index": len(choices), "text": prefix + choice.text,
                            "logprobs": _completion_logprobs_of(choice, sampling, texts),
                            "finish_reason": choice.finish_reason.value})
    return choices


def sample_choices(output: RequestOutput, sampling: SamplingParams, texts: TokenTexts) -> list[dict]:
    """/basic_generate and /generate: each sample's text, finish reason and (when asked) chat-shaped logprobs."""
    return [{"index": choice.index, "text": choice.text, "finish_reason": choice.finish_reason.value,
             "logprobs": chat_logprobs(choice.logprobs, texts) if sampling.logprobs is not None else None}
            for choice in output.choices]


def chat_logprobs(entries: tuple[TokenLogprob, ...] | None, texts: TokenTexts) -> dict:
    return {"content": [_chat_entry(e.token_id, e.logprob, texts) | {"top_logprobs": [
        _chat_entry(token_id, logprob, texts) for token_id, logprob in e.top]} for e in entries or ()]}


def _chat_entry(token_id: int, logprob: float, texts: TokenTexts) -> dict:
    return {"token": texts.text(token_id), "logprob": logprob, "bytes": list(texts.token_bytes(token_id))}


def chat_logprob_content(entries: tuple[TokenLogprob, ...], texts: TokenTexts) -> list[dict]:
    """The entries of a WebSocket delta frame."""
    return chat_logprobs(entries, texts)["content"]


def completion_logprobs(token_ids: list[int], entries: Iterable[TokenLogprob | None], texts: TokenTexts) -> dict:
    """`text_offset` counts characters from the start of the choice's text (the prompt's, with echo): a character
    split over tokens starts at the token that completes it, as the text gets it."""
    tokens, token_logprobs, top_logprobs, text_offset, offset = [], [], [], [], 0
    characters = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token_id, entry in zip(token_ids, entries):
        text = _completion_token(token_id, texts)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(characters.decode(texts.token_bytes(token_id)))
        if entry is None:  # the prompt's first token: nothing before it predicts it
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top = {_completion_token(top_id, texts): logprob for top_id, logprob in entry.top}
        top.setdefault(text, entry.logprob)  # the chosen token is always listed, as vLLM does
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def _completion_token(token_id: int, texts: TokenTexts) -> str:
    """A token's text, or where its bytes are not whole UTF-8 characters its bytes: U+FFFD for every such token
    would give them one key in `top_logprobs`, and the chosen token another's number."""
    raw = texts.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def _completion_logprobs_of(choice: RequestOutput, sampling: SamplingParams, texts: TokenTexts) -> dict | None:
    if sampling.logprobs is None:
        return None
    token_ids, entries = list(choice.output_token_ids), list(choice.logprobs or ())
    if sampling.echo:
        token_ids = list(choice.prompt_token_ids) + token_ids
        entries = itertools.chain(choice.prompt_logprobs or [None] * len(choice.prompt_token_ids), entries)
    return completion_logprobs(token_ids, entries, texts)


def _prompt_text(prompt, choice: RequestOutput, texts: TokenTexts) -> str:
    if isinstance(prompt, str):
        return prompt
    return texts.tokenizer.decode(list(choice.prompt_token_ids))
