"""The original failure mode, end to end: streams and REST calls at once while a CPU burner saturates the cores."""
import multiprocessing
import os
import threading

import pytest

from ..client import WsClient, http

PROMPTS = ["Hello", "Tell me about the moon", "1, 2, 3, 4", "A long time ago in a galaxy", "Why is the sky blue?"]
ROUNDS = 3


def burn_cpu(stop):
    while not stop.is_set():
        sum(i * i for i in range(10000))


@pytest.fixture
def cpu_burner():
    context = multiprocessing.get_context("spawn")  # not forked from the test process that holds engines
    stop = context.Event()
    burners = [context.Process(target=burn_cpu, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 2)]
    for burner in burners:
        burner.start()
    yield
    stop.set()
    for burner in burners:
        burner.join(10)


def test_every_answer_belongs_to_its_own_prompt_under_cpu_saturation(make_server_for, tiny_model_dir, cpu_burner):
    server = make_server_for(tiny_model_dir)
    params = {"max_tokens": 10, "ignore_eos": True}
    alone = {p: http("POST", server.url + "/basic_generate", {"prompt": p, **params})[2]["generated_text"]
             for p in PROMPTS}
    failures = []

    def check(what, got, want):
        if got != want:
            failures.append((what, got, want))

    def streamer(index):
        ws = WsClient(server.ws_url)
        for r in range(ROUNDS):
            ids = [f"{index}-{r}-{i}" for i in range(len(PROMPTS))]
            for request_id, prompt in zip(ids, PROMPTS):
                ws.generate(request_id, prompt=prompt, **params)
            results = ws.collect(ids)
            for request_id, prompt in zip(ids, PROMPTS):
                check(("ws", request_id), results[request_id]["text"], alone[prompt])
        ws.close()

    def rest_single():
        for _ in range(ROUNDS):
            for prompt in PROMPTS:
                status, _, body = http("POST", server.url + "/basic_generate", {"prompt": prompt, **params})
                check(("basic", prompt, status), body.get("generated_text"), alone[prompt])

    def rest_batch():
        for _ in range(ROUNDS):
            status, _, body = http("POST", server.url + "/generate", {"prompts": PROMPTS, **params})
            check(("batch", status), body.get("generated_texts"), [alone[p] for p in PROMPTS])

    threads = [threading.Thread(target=streamer, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=rest_single) for _ in range(2)] + [threading.Thread(target=rest_batch)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    _, _, metrics = http("GET", server.url + "/metrics")
    assert 'finished_reason="error"' not in metrics
