"""A request's samples (n > 1, best_of) in the parent: queued, admitted and sent to the worker as one group,
cancelled and failed together, and ranked by cumulative logprob for best_of (scripted worker)."""
import pickle
import queue

import pytest

from engine import FinishReason, Overloaded
from engine.engine_core import EngineCore
from engine.messages import NewRequest, PromptLogprobs, StepOutput, StepResult, TokenLogprob, WorkerSampling
from engine.output_processor import RequestState
from engine.outputs import RequestOutput
from engine.sample_group import SampleGroup
from engine.sequence import Sequence

from .test_scheduler import make_core, make_seq, make_state


class Group:
    """A request's samples as Engine.submit queues them: their states, and the SampleGroup they share as a sink."""

    def __init__(self, request_id: str, num_samples: int, n: int | None = None, max_tokens: int = 3):
        self.sink = SampleGroup(request_id, n or num_samples, queue.Queue())
        self.states: list[RequestState] = [
            make_state(Sequence(f"{request_id}#{i}", [65, 66], WorkerSampling(max_tokens=max_tokens),
                                group_id=request_id, sample_index=i), self.sink) for i in range(num_samples)]
        self.sink.sequences = self.sequences

    @property
    def sequences(self) -> list[Sequence]:
        return [state.seq for state in self.states]


def make_group(request_id: str, num_samples: int, n: int | None = None, max_tokens: int = 3) -> Group:
    return Group(request_id, num_samples, n, max_tokens)


def final(group: Group) -> RequestOutput:
    events = []
    while not group.sink.sink.empty():
        events.append(group.sink.sink.get())
    outputs = [e for e in events if isinstance(e, RequestOutput)]
    assert len(outputs) == 1
    return outputs[0]


def step(manager: EngineCore, tokens: dict[str, int], logprobs: dict[str, float] | None = None):
    plan = manager.schedule(timeout=0)
    entries = {i: (TokenLogprob(tokens[i], lp),) for i, lp in (logprobs or {}).items()}
    manager.process(StepOutput({i: (t,) for i, t in tokens.items()}, logprobs=entries))
    return plan


def test_a_group_is_one_new_request_with_every_sample_id():
    manager = make_core(max_batch_size=4)
    group = make_group("g", 3)
    manager.add_states(group.states)
    plan = manager.schedule(timeout=0)
    assert plan.new_requests == (NewRequest("g", (65, 66), WorkerSampling(max_tokens=3), ("g#0", "g#1", "g#2")),)
    assert manager.scheduler.num_running == 3


def test_a_group_waits_until_all_its_samples_fit():
    manager = make_core(max_batch_size=3)
    manager.add_states([make_seq("solo", max_tokens=2)])
    manager.schedule(timeout=0)
    group = make_group("g", 3)
    manager.add_states(group.states)
    assert manager.schedule(timeout=0).new_requests == ()  # 1 running + 3 > 3
    manager.process(StepOutput({"solo": (120,)}))
    manager.process(StepOutput({"solo": (121,)}))  # solo is done (max_tokens 2)
    assert [r.request_id for r in manager.schedule(timeout=0).new_requests] == ["g"]


def test_a_group_is_queued_all_or_none():
    manager = make_core(max_batch_size=1, max_queue=4)
    manager.add_states(make_group("a", 3).states)
    with pytest.raises(Overloaded):
        manager.add_states(make_group("b", 2).states)
    assert manager.scheduler.num_waiting == 3


def test_cancel_by_the_request_id_stops_every_sample():
    manager = make_core(max_batch_size=4)
    group = make_group("g", 2, max_tokens=10)
    manager.add_states(group.states)
    step(manager, {"g#0": 120, "g#1": 121})
    assert manager.abort("g")
    plan = manager.schedule(timeout=0)
    assert sorted(plan.finished_ids) == ["g#0", "g#1"]
    output = final(group)
    assert output.request_id == "g" and output.finish_reason is FinishReason.ABORT and len(output.samples) == 2


def test_one_failed_sample_fails_the_request_and_stops_the_others():
    manager = make_core(max_batch_size=4)
    group = make_group("g", 2, max_tokens=10)
    manager.add_states(group.states)
    manager.schedule(timeout=0)
    manager.process(StepOutput({"g#1": (120,)}, failed={"g#0": "RuntimeError: nan"}))
    assert group.sequences[1].is_abort_requested
    manager.schedule(timeout=0)
    output = final(group)
    assert output.request_id == "g" and output.finish_reason is FinishReason.ERROR and "nan" in output.error


def test_best_of_returns_the_n_most_likely_samples_best_first():
    manager = make_core(max_batch_size=4)
    group = make_group("g", 3, n=2, max_tokens=2)
    manager.add_states(group.states)
    step(manager, {"g#0": 120, "g#1": 121, "g#2": 122}, {"g#0": -3.0, "g#1": -0.5, "g#2": -1.0})
    step(manager, {"g#0": 0, "g#1": 121, "g#2": 122}, {"g#0": -0.1, "g#1": -0.5, "g#2": -1.0})
    output = final(group)
    assert [(c.index, c.text) for c in output.choices] == [(0, "yy"), (1, "zz")]  # -1.0, -2.0; not -3.1
    assert output.text == "yy" and output.usage.completion_tokens == 6  # every generated token counts


def test_new_messages_survive_pickling():
    result = StepResult(1, StepOutput({"r": (5,)}, logprobs={"r": (TokenLogprob(5, -0.25, ((5, -0.25), (7, -2.0))),)},
                                      prompt_logprobs={"r": PromptLogprobs.of((None, TokenLogprob(3, -1.5, ((3, -1.5),))))}))
    request = NewRequest("g", (1, 2), WorkerSampling(logit_bias=((3, 1.0),), logprobs=2), ("g#0", "g#1"))
    assert pickle.loads(pickle.dumps(result)) == result and pickle.loads(pickle.dumps(request)) == request
