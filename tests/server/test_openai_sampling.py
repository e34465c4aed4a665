"""Logprobs, echo, penalties, logit_bias, min_tokens, n and best_of through the official `openai` SDK against the
live server, on both backends (the numbers are the worker's: the model's own distribution, the same on both)."""
import math

import openai
import pytest

from ..conftest import sdk

CAPITAL = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_logprobs_in_openais_shape(sdk_server):
    reply = sdk(sdk_server).chat.completions.create(model="m", messages=QUESTION, max_tokens=12, temperature=0,
                                                logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens - (choice.finish_reason == "stop")  # EOS not shown
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the top one
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    plain = sdk(sdk_server).chat.completions.create(model="m", messages=QUESTION, max_tokens=12, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content


def score(sdk_server, continuation: str) -> float:
    """lm-evaluation-harness's log-likelihood request: echo the prompt with its logprobs, generate one token."""
    reply = sdk(sdk_server).completions.create(model="m", prompt=CAPITAL + continuation, max_tokens=1, temperature=0,
                                           logprobs=1, echo=True)
    logprobs = reply.choices[0].logprobs
    assert reply.choices[0].text.startswith(CAPITAL + continuation)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert len(logprobs.tokens) == reply.usage.prompt_tokens + 1
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert all(len(top) >= 1 for top in logprobs.top_logprobs[1:])
    context_tokens = len(sdk(sdk_server).completions.create(model="m", prompt=CAPITAL, max_tokens=1, logprobs=0,
                                                        echo=True).choices[0].logprobs.tokens) - 1
    return sum(logprobs.token_logprobs[context_tokens:-1])


def test_echo_scores_continuations_as_evaluation_harnesses_do(sdk_server):
    paris, london = score(sdk_server, " Paris"), score(sdk_server, " London")
    assert paris > london and paris > math.log(0.05)


def test_echo_of_a_prompt_longer_than_a_prefill_chunk(sdk_server):
    prompt = " ".join(f"item {i}," for i in range(60))  # ~180 tokens: several prefill chunks on both backends
    reply = sdk(sdk_server).completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0, logprobs=0,
                                           echo=True)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == reply.usage.prompt_tokens + 1 > 150
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert sum(logprobs.token_logprobs[-40:-1]) > -20  # the pattern is easy to predict once it is set


def test_completion_logprobs_k_and_greedy_tokens(sdk_server):
    reply = sdk(sdk_server).completions.create(model="m", prompt=CAPITAL, max_tokens=6, temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text
    for token, token_logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert max(top, key=top.get) == token and top[token] == pytest.approx(token_logprob)


def test_completion_logprobs_of_tokens_inside_a_character_keep_their_own_keys(sdk_server):
    """Emoji are 4 bytes, spread over byte tokens: each is keyed by its bytes, as OpenAI does, not by one shared
    U+FFFD (which kept one entry of several, and gave the chosen token another's number); offsets stay in the
    text, a split character's at the token that completes it."""
    prompt = "Emoji list: \U0001F600 \U0001F603 \U0001F604 \U0001F601"
    reply = sdk(sdk_server).completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, logprobs=5,
                                               echo=True)
    choice = reply.choices[0]
    logprobs = choice.logprobs
    split = [token for token in logprobs.tokens if token.startswith("bytes:")]
    assert len(split) >= 2 and all(len(top) >= 5 for top in logprobs.top_logprobs[1:])
    for token, token_logprob, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert top[token] == pytest.approx(token_logprob)
    spelled = b"".join(bytes.fromhex(token[6:].replace("\\x", "")) if token.startswith("bytes:")
                       else token.encode() for token in logprobs.tokens)
    assert spelled.decode("utf-8", errors="replace") == choice.text
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[-1] <= len(choice.text)
    assert all(choice.text.index(emoji) in logprobs.text_offset for emoji in prompt.split()[2:])


def test_n_samples_and_best_of(sdk_server):
    client = sdk(sdk_server)
    reply = client.completions.create(model="m", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5,
                                      n=3, logprobs=0, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2] and len({c.text for c in reply.choices}) > 1
    assert reply.usage.completion_tokens == 24
    best = client.completions.create(model="m", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5,
                                     n=2, best_of=3, logprobs=0, extra_body={"ignore_eos": True})
    totals = {c.text: sum(c.logprobs.token_logprobs) for c in reply.choices}
    assert [c.text for c in best.choices] == sorted(totals, key=totals.get, reverse=True)[:2]  # same seeds
    assert best.usage.completion_tokens == 24  # every sample generated counts
    chat = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=10, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy samples agree


def test_logit_bias_and_penalties(sdk_server):
    client = sdk(sdk_server)
    token_id = sdk_server.state.engine.encode(prompt=" banana")[0]
    forced = client.completions.create(model="m", prompt=CAPITAL, max_tokens=4, temperature=0,
                                       logit_bias={str(token_id): 100})
    assert forced.choices[0].text == " banana" * 4
    once = client.completions.create(model="m", prompt=CAPITAL, max_tokens=4, temperature=0,
                                     logit_bias={str(token_id): 100}, frequency_penalty=2.0,
                                     extra_body={"repetition_penalty": 100.0})
    assert once.choices[0].text.startswith(" banana") and once.choices[0].text.count(" banana") == 1
    counting = "1, 1, 1, 1, 1, 1, 1, 1,"
    plain = client.completions.create(model="m", prompt=counting, max_tokens=8, temperature=0)
    penalised = client.completions.create(model="m", prompt=counting, max_tokens=8, temperature=0,
                                          presence_penalty=2.0, frequency_penalty=2.0)
    assert plain.choices[0].text.count("1") > penalised.choices[0].text.count("1")


def test_min_tokens_holds_back_eos(sdk_server):
    client = sdk(sdk_server)
    short = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=40, temperature=0)
    assert short.choices[0].finish_reason == "stop"
    at_least = short.usage.completion_tokens + 5
    longer = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=60, temperature=0,
                                            extra_body={"min_tokens": at_least})
    assert longer.usage.completion_tokens >= at_least


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": 1, "05": 1}}, "logit_bias"),  # one token twice
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"n": 2, "extra_body": {"best_of": 1}}, "best_of"),
    ({"n": 100}, "n"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_tokens": 9, "max_tokens": 3}}, "min_tokens"),
])
def test_bad_values_are_400_naming_the_field(sdk_server, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(sdk_server).chat.completions.create(model="m", messages=QUESTION, max_tokens=3, **fields)
    assert refused.value.body["param"] == param


def test_echo_with_max_tokens_0_gives_the_prompt_and_its_logprobs_alone(sdk_server):
    """OpenAI's way to score a text: nothing generated, the prompt's logprobs those of a one-token answer."""
    prompt = CAPITAL + " Paris."
    scored = sdk(sdk_server).completions.create(model="m", prompt=prompt, max_tokens=0, logprobs=2, echo=True)
    answered = sdk(sdk_server).completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0, logprobs=2,
                                                  echo=True)
    choice, logprobs = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and len(logprobs.tokens) == scored.usage.prompt_tokens
    assert "".join(logprobs.tokens) == prompt and logprobs.token_logprobs[0] is None
    expected = answered.choices[0].logprobs
    assert logprobs.token_logprobs == expected.token_logprobs[:-1]
    assert logprobs.top_logprobs == expected.top_logprobs[:-1]
    samples = sdk(sdk_server).completions.create(model="m", prompt=prompt, max_tokens=0, echo=True, n=2, best_of=3)
    assert [choice.text for choice in samples.choices] == [prompt, prompt] and samples.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(sdk_server).completions.create(model="m", prompt=prompt, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"
