"""A request's samples (n > 1, best_of) in the parent: queued, admitted and sent to the worker as one group,
cancelled and failed together, and ranked by cumulative logprob for best_of (scripted worker)."""
import pickle
import queue

import pytest

from engine import FinishReason, Overloaded
from engine.detokenizer import IncrementalDetokenizer
from engine.messages import NewRequest, StepOutput, StepResult, TokenLogprob, WorkerSampling
from engine.scheduler import Scheduler
from engine.sequence import RequestOutput, SampleGroup, Sequence

from .test_scheduler import CharTokenizer, make_seq


def make_group(request_id: str, num_samples: int, n: int | None = None, max_tokens: int = 3) -> SampleGroup:
    sink = queue.Queue()
    group = SampleGroup(request_id, n or num_samples, sink)
    group.sequences = [Sequence(f"{request_id}#{i}", [65, 66], WorkerSampling(max_tokens=max_tokens),
                                IncrementalDetokenizer(CharTokenizer()), group, frozenset({0}),
                                group_id=request_id, sample_index=i) for i in range(num_samples)]
    return group


def final(group: SampleGroup) -> RequestOutput:
    events = []
    while not group.sink.empty():
        events.append(group.sink.get())
    outputs = [e for e in events if isinstance(e, RequestOutput)]
    assert len(outputs) == 1
    return outputs[0]


def step(manager: Scheduler, tokens: dict[str, int], logprobs: dict[str, float] | None = None):
    plan = manager.schedule(timeout=0)
    entries = {i: (TokenLogprob(tokens[i], lp),) for i, lp in (logprobs or {}).items()}
    manager.postprocess(StepOutput({i: (t,) for i, t in tokens.items()}, logprobs=entries))
    return plan


def test_a_group_is_one_new_request_with_every_sample_id():
    manager = Scheduler(max_batch_size=4)
    group = make_group("g", 3)
    manager.add_group(group.sequences)
    plan = manager.schedule(timeout=0)
    assert plan.new_requests == (NewRequest("g", (65, 66), WorkerSampling(max_tokens=3), ("g#0", "g#1", "g#2")),)
    assert manager.num_running == 3


def test_a_group_waits_until_all_its_samples_fit():
    manager = Scheduler(max_batch_size=3)
    manager.add(make_seq("solo", max_tokens=2))
    manager.schedule(timeout=0)
    group = make_group("g", 3)
    manager.add_group(group.sequences)
    assert manager.schedule(timeout=0).new_requests == ()  # 1 running + 3 > 3
    manager.postprocess(StepOutput({"solo": (120,)}))
    manager.postprocess(StepOutput({"solo": (121,)}))  # solo is done (max_tokens 2)
    assert [r.request_id for r in manager.schedule(timeout=0).new_requests] == ["g"]


def test_a_group_is_queued_all_or_none():
    manager = Scheduler(max_batch_size=1, max_queue=4)
    manager.add_group(make_group("a", 3).sequences)
    with pytest.raises(Overloaded):
        manager.add_group(make_group("b", 2).sequences)
    assert manager.num_waiting == 3


def test_cancel_by_the_request_id_stops_every_sample():
    manager = Scheduler(max_batch_size=4)
    group = make_group("g", 2, max_tokens=10)
    manager.add_group(group.sequences)
    step(manager, {"g#0": 120, "g#1": 121})
    assert manager.abort("g")
    plan = manager.schedule(timeout=0)
    assert sorted(plan.finished_ids) == ["g#0", "g#1"]
    output = final(group)
    assert output.request_id == "g" and output.finish_reason is FinishReason.ABORT and len(output.samples) == 2


def test_one_failed_sample_fails_the_request_and_stops_the_others():
    manager = Scheduler(max_batch_size=4)
    group = make_group("g", 2, max_tokens=10)
    manager.add_group(group.sequences)
    manager.schedule(timeout=0)
    manager.postprocess(StepOutput({"g#1": (120,)}, failed={"g#0": "RuntimeError: nan"}))
    assert group.sequences[1].is_abort_requested
    manager.schedule(timeout=0)
    output = final(group)
    assert output.request_id == "g" and output.finish_reason is FinishReason.ERROR and "nan" in output.error


def test_best_of_returns_the_n_most_likely_samples_best_first():
    manager = Scheduler(max_batch_size=4)
    group = make_group("g", 3, n=2, max_tokens=2)
    manager.add_group(group.sequences)
    step(manager, {"g#0": 120, "g#1": 121, "g#2": 122}, {"g#0": -3.0, "g#1": -0.5, "g#2": -1.0})
    step(manager, {"g#0": 0, "g#1": 121, "g#2": 122}, {"g#0": -0.1, "g#1": -0.5, "g#2": -1.0})
    output = final(group)
    assert [(c.index, c.text) for c in output.choices] == [(0, "yy"), (1, "zz")]  # -1.0, -2.0; not -3.1
    assert output.text == "yy" and output.usage.completion_tokens == 6  # every generated token counts


def test_new_messages_survive_pickling():
    result = StepResult(1, StepOutput({"r": (5,)}, logprobs={"r": (TokenLogprob(5, -0.25, ((5, -0.25), (7, -2.0))),)},
                                      prompt_logprobs={"r": (None, TokenLogprob(3, -1.5))}))
    request = NewRequest("g", (1, 2), WorkerSampling(logit_bias=((3, 1.0),), logprobs=2), ("g#0", "g#1"))
    assert pickle.loads(pickle.dumps(result)) == result and pickle.loads(pickle.dumps(request)) == request
