"""The prefix cache (engine/backends/prefix_cache.py): a request that starts with a past request's tokens (its
prompt and its answer: the next turn of a chat) prefills only the rest, computes exactly what it would without
the cache (greedy tokens, logprobs), says how many tokens it found, never shares across cache salts, and the pool
stays within its bound."""
import pytest
import torch

from engine import SamplingParams
from engine.backends.prefix_cache import BLOCK_TOKENS, PrefixCache, restore
from engine.errors import InvalidRequest

from ..client import http
from ..conftest import sdk

SYSTEM = ("You are a careful assistant. Answer in short, plain sentences and say so when you are unsure. " * 4)
TURNS = ["What is the tallest mountain in Europe?", "And how high is it, roughly?",
         "Name one more mountain in that range."]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def conversation(engine, turns, salt=None, sampling=GREEDY):
    """A chat as clients send it: every turn resends the whole conversation, answers included."""
    messages, outputs = [{"role": "system", "content": SYSTEM}], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        output = engine.submit(messages=list(messages), sampling=sampling, cache_salt=salt).result(timeout=600)
        messages.append({"role": "assistant", "content": output.text})
        outputs.append(output)
    return outputs


@pytest.fixture(scope="module")
def engines(smol_model_dir):
    """The defaults (the embedded model's 4-bit path, where the cache is on) and the same with it off."""
    from engine import LLMEngine
    from engine.config import EngineConfig

    cached = LLMEngine(EngineConfig(model=smol_model_dir)).start()
    uncached = LLMEngine(EngineConfig(model=smol_model_dir, prefix_cache=False)).start()
    yield cached, uncached
    cached.shutdown()
    uncached.shutdown()


def test_later_turns_reuse_the_conversation_and_compute_the_same_tokens(engines):
    cached, uncached = engines
    with_cache = conversation(cached, TURNS, salt="exactness")
    without = conversation(uncached, TURNS, salt="exactness")
    assert [o.output_token_ids for o in with_cache] == [o.output_token_ids for o in without]
    assert [o.usage.prompt_tokens for o in with_cache] == [o.usage.prompt_tokens for o in without]
    assert with_cache[0].usage.cached_tokens == 0
    for earlier, later in zip(with_cache, with_cache[1:]):
        # the previous prompt and most of its answer (whole blocks; the template around the answer differs)
        assert later.usage.cached_tokens >= (earlier.usage.prompt_tokens // BLOCK_TOKENS) * BLOCK_TOKENS
        assert later.usage.cached_tokens % BLOCK_TOKENS == 0 and later.usage.cached_tokens < later.usage.prompt_tokens
    assert all(o.usage.cached_tokens == 0 for o in without)
    assert with_cache[-1].usage.as_dict()["prompt_tokens_details"] == {"cached_tokens": with_cache[-1].usage.cached_tokens}


def test_a_hit_gives_the_same_logprobs_and_echo_never_skips_the_prompt(engines):
    cached, uncached = engines
    prompt = SYSTEM + " Tell me about bridges."
    warm = SamplingParams(max_tokens=4)
    cached.submit(prompt, warm, cache_salt="logprobs").result(timeout=600)
    sampling = SamplingParams(max_tokens=8, logprobs=3)
    hit = cached.submit(prompt, sampling, cache_salt="logprobs").result(timeout=600)
    miss = uncached.submit(prompt, sampling, cache_salt="logprobs").result(timeout=600)
    assert hit.usage.cached_tokens > 0 and miss.usage.cached_tokens == 0
    assert hit.output_token_ids == miss.output_token_ids and hit.logprobs == miss.logprobs
    echo = SamplingParams(max_tokens=2, logprobs=1, echo=True)
    echoed = cached.submit(prompt, echo, cache_salt="logprobs").result(timeout=600)
    reference = uncached.submit(prompt, echo, cache_salt="logprobs").result(timeout=600)
    assert echoed.usage.cached_tokens == 0  # every prompt position's logits are needed
    assert echoed.prompt_logprobs == reference.prompt_logprobs


def test_different_salts_never_share_and_the_same_salt_does(engines):
    cached, _ = engines
    prompt = SYSTEM + " Which salt is this?"
    assert cached.submit(prompt, GREEDY, cache_salt="alice").result(timeout=600).usage.cached_tokens == 0
    assert cached.submit(prompt, GREEDY, cache_salt="bob").result(timeout=600).usage.cached_tokens == 0
    assert cached.submit(prompt, GREEDY).result(timeout=600).usage.cached_tokens == 0  # no salt is a salt too
    assert cached.submit(prompt, GREEDY, cache_salt="alice").result(timeout=600).usage.cached_tokens > 0
    for bad in ("", "x" * 2000, 7, "\ud800", "ok\udc00"):  # a lone surrogate has no UTF-8 to hash
        with pytest.raises(InvalidRequest):
            cached.submit(prompt, GREEDY, cache_salt=bad)


def test_samples_of_one_request_share_its_cached_prompt(engines):
    cached, _ = engines
    prompt = SYSTEM + " Give me a name for a cat."
    cached.submit(prompt, SamplingParams(max_tokens=2), cache_salt="samples").result(timeout=600)
    output = cached.submit(prompt, SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=3),
                           cache_salt="samples").result(timeout=600)
    assert len(output.samples) == 3 and output.usage.cached_tokens > 0


def _layers(length: int, seed: int, num_layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, length, 8, generator=generator), torch.randn(3, length, 8, generator=generator))
            for _ in range(num_layers)]


def test_the_pool_keeps_its_bound_and_evicts_extensions_before_their_prefixes():
    cache = PrefixCache(max_tokens=4 * BLOCK_TOKENS)
    tokens = list(range(10 * BLOCK_TOKENS))
    layers = _layers(len(tokens), 0)
    cache.insert(tokens[:3 * BLOCK_TOKENS], None, layers)
    assert cache.num_tokens == 3 * BLOCK_TOKENS
    found = cache.lookup(tokens[:3 * BLOCK_TOKENS + 1], None)
    assert len(found) == 3
    target = _layers(3 * BLOCK_TOKENS + 1, 1)
    keys, values = (torch.stack([layer[part] for layer in target]) for part in (0, 1))
    assert restore(found, keys, values) == 3 * BLOCK_TOKENS
    target = list(zip(keys, values))
    assert all(torch.equal(got[:, :3 * BLOCK_TOKENS], kept[:, :3 * BLOCK_TOKENS])
               for restored, inserted in zip(target, layers) for got, kept in zip(restored, inserted))
    # a lookup leaves the last token to compute: an exact 3-block prompt finds 2 blocks
    assert len(cache.lookup(tokens[:3 * BLOCK_TOKENS], None)) == 2
    other = [t + 1 for t in tokens]
    cache.insert(other[:2 * BLOCK_TOKENS], None, _layers(2 * BLOCK_TOKENS, 2))
    assert cache.num_tokens == 4 * BLOCK_TOKENS  # 5 blocks offered, 4 kept: the first chain's last block went
    assert len(cache.lookup(tokens[:4 * BLOCK_TOKENS], None)) == 2
    assert len(cache.lookup(other[:2 * BLOCK_TOKENS + 1], None)) == 2
    for start in range(0, 200 * BLOCK_TOKENS, 5 * BLOCK_TOKENS):  # traffic never grows it
        cache.insert(list(range(start, start + 5 * BLOCK_TOKENS)), None, _layers(5 * BLOCK_TOKENS, start))
        assert cache.num_tokens <= 4 * BLOCK_TOKENS


def test_fit_shrinks_the_pool_to_what_the_rows_leave_and_never_past_its_own_bound():
    cache = PrefixCache(max_tokens=6 * BLOCK_TOKENS)
    tokens = list(range(6 * BLOCK_TOKENS))
    cache.insert(tokens, None, _layers(len(tokens), 0))
    assert cache.fit(2 * BLOCK_TOKENS + 5) == 4 and cache.num_tokens == 2 * BLOCK_TOKENS
    assert len(cache.lookup(tokens, None)) == 2  # the prefix stayed; the blocks that extend it went
    cache.insert(tokens, None, _layers(len(tokens), 0))
    assert cache.num_tokens == 2 * BLOCK_TOKENS  # the squeezed bound holds for new blocks too
    assert cache.fit(-100) == 2 and cache.num_tokens == 0
    cache.fit(100 * BLOCK_TOKENS)  # room again, but only up to the configured bound
    cache.insert(list(range(9 * BLOCK_TOKENS)), None, _layers(9 * BLOCK_TOKENS, 0))
    assert cache.num_tokens == 6 * BLOCK_TOKENS


def test_running_rows_squeeze_the_cache_within_the_one_kv_budget(smol_model_dir):
    """The cache gets what the rows' slots leave of max_batch_kv_tokens: beside a long row a cached prompt finds
    at most that many positions, alone it finds them all."""
    from engine import LLMEngine
    from engine.config import EngineConfig

    budget, long_prompt = 1024, [100 + (i * 7) % 4000 for i in range(420)]
    engine = LLMEngine(EngineConfig(model=smol_model_dir, max_batch_kv_tokens=budget,
                                    prefix_cache_tokens=budget)).start()
    try:
        prompt = SYSTEM * 2 + " Which budget is this?"  # about 190 tokens: 5 whole blocks
        engine.submit(prompt, GREEDY).result(timeout=600)
        alone = engine.submit(prompt, GREEDY).result(timeout=600).usage.cached_tokens
        engine.submit(prompt, GREEDY).result(timeout=600)  # its blocks most recent again
        row = engine.submit(prompt_token_ids=long_prompt, sampling=SamplingParams(max_tokens=500, ignore_eos=True))
        next(row.events())  # the long row runs: it holds 928 positions (its prompt and answer, whole key blocks)
        beside = engine.submit(prompt, GREEDY).result(timeout=600).usage.cached_tokens
        assert row.result(timeout=600).usage.completion_tokens == 500  # it ran past the squeezed request
    finally:
        engine.shutdown()
    assert alone >= 5 * BLOCK_TOKENS
    assert beside <= budget - 928 < alone


def test_a_block_is_keyed_by_everything_before_it():
    cache = PrefixCache(max_tokens=16 * BLOCK_TOKENS)
    first = list(range(2 * BLOCK_TOKENS))
    cache.insert(first, "s", _layers(len(first), 0))
    moved = [9999] * BLOCK_TOKENS + first[BLOCK_TOKENS:]  # the same second block after another first block
    assert cache.lookup(moved + [1], "s") == []
    assert cache.lookup(first + [1], "t") == []
    assert len(cache.lookup(first + [1], "s")) == 2
    assert cache.queried_tokens == 3 * (2 * BLOCK_TOKENS + 1) and cache.hit_tokens == 2 * BLOCK_TOKENS
    empty = PrefixCache(max_tokens=0)
    empty.insert(first, None, _layers(len(first), 0))
    assert empty.num_tokens == 0 and empty.lookup(first + [1], None) == []


# ---- served: the usage fields, cache_salt on the wire, metrics, a Responses socket conversation ---------------

def _metric(server, name: str) -> float:
    _, _, text = http("GET", server.url + "/metrics")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_served_turns_report_cached_tokens_and_count_them_in_metrics(smol_server):
    hits_before = _metric(smol_server, "lockstep:prefix_cache_hits_total")
    queries_before = _metric(smol_server, "lockstep:prefix_cache_queries_total")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "cache_salt": "served"}
    status, _, first = http("POST", smol_server.url + "/v1/chat/completions", body)
    assert status == 200 and first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    messages += [first["choices"][0]["message"], {"role": "user", "content": TURNS[1]}]
    status, _, second = http("POST", smol_server.url + "/v1/chat/completions", {**body, "messages": messages})
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert status == 200 and cached >= first["usage"]["prompt_tokens"] // BLOCK_TOKENS * BLOCK_TOKENS > 0
    completion = {"prompt": [SYSTEM + " Once more:"], "max_tokens": 2, "cache_salt": "served"}
    for expected_hit in (False, True):  # prompts admitted in one step all miss: the second call hits
        status, _, answer = http("POST", smol_server.url + "/v1/completions", completion)
        assert status == 200 and (answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0) == expected_hit
    assert _metric(smol_server, "lockstep:prefix_cache_hits_total") - hits_before >= cached
    assert _metric(smol_server, "lockstep:prefix_cache_queries_total") - queries_before >= \
        first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
    _, _, models = http("GET", smol_server.url + "/v1/models")
    assert models["data"][0]["prefix_cache"] is True and models["data"][0]["kv_per_row"] is True


@pytest.mark.parametrize("salt", ["", "x" * 2000, 7, ["a"]])
def test_a_bad_cache_salt_is_a_clear_400(smol_server, salt):
    status, _, error = http("POST", smol_server.url + "/basic_generate",
                            {"prompt": "Hi", "max_tokens": 2, "cache_salt": salt})
    assert status == 400 and "cache_salt" in error["error"]["message"]


def test_a_responses_socket_conversation_resumes_from_the_cache(smol_server):
    client = sdk(smol_server)
    previous, usages = None, []
    with client.responses.connect() as connection:
        for text in [SYSTEM + " My name is Ada. Say hello.", "What is my name?", "Spell it."]:
            connection.response.create(model="smollm2", input=text, max_output_tokens=8, temperature=0,
                                       previous_response_id=previous)
            while (event := connection.recv()).type not in ("response.completed", "response.incomplete"):
                assert event.type != "error", event
            usages.append(event.response.usage)
            previous = event.response.id
    cached = [usage.input_tokens_details.cached_tokens for usage in usages]
    assert cached[0] == 0 and all(later >= earlier.input_tokens // BLOCK_TOKENS * BLOCK_TOKENS > 0
                                  for earlier, later in zip(usages, cached[1:])), (cached, usages)
