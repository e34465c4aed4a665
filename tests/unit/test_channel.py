"""The pipes to the model worker (engine/channel.py): whole messages both ways, every wait bounded."""
import multiprocessing
import os
import pickle
import signal

import pytest

from engine import channel as channel_module
from engine.channel import HEADER, ChannelBroken, ChannelClosed, pipe_pair
from engine.messages import NewRequest, StepTask, WorkerSampling


def echo_until_closed(channel, parent_end):
    parent_end.close()  # the fork copied it: kept, the parent's close would never read as EOF here
    try:
        while True:
            channel.send(channel.receive(10.0), 10.0)
    except ChannelClosed:
        return


@pytest.fixture
def echo_child():
    parent, child = pipe_pair()
    process = multiprocessing.get_context("fork").Process(target=echo_until_closed, args=(child, parent))
    process.start()
    child.close()
    yield parent, process
    parent.close()
    process.join(10)
    if process.is_alive():
        process.kill()


@pytest.fixture
def pair():
    """Both ends in this process (a test writes or reads the other end's descriptors itself)."""
    parent, child = pipe_pair()
    yield parent, child
    parent.close()
    child.close()


def big_task(tokens: int) -> StepTask:
    return StepTask(7, new_requests=(NewRequest("r", tuple(range(tokens)), WorkerSampling()),))


def test_messages_cross_whole_and_in_order(echo_child):
    parent, _ = echo_child
    for call_id in range(50):
        parent.send(StepTask(call_id, finished_ids=(f"r{call_id}",)), 5.0)
        assert parent.receive(5.0) == StepTask(call_id, finished_ids=(f"r{call_id}",))


def test_a_message_larger_than_the_pipe_is_written_as_the_reader_takes_it(echo_child):
    parent, _ = echo_child
    task = big_task(200_000)  # ~1 MB pickled: 16 pipes' worth
    parent.send(task, 30.0)
    assert parent.receive(30.0) == task


def test_a_reader_that_stopped_cannot_hold_the_writer(echo_child):
    parent, process = echo_child
    os.kill(process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError):
            parent.send(big_task(200_000), 0.5)
    finally:
        os.kill(process.pid, signal.SIGCONT)
    # Part of that message is in the pipe: a next one would be read as its rest, so the channel is done.
    with pytest.raises(ChannelBroken, match="cut off"):
        parent.send(StepTask(8), 5.0)


def test_a_message_that_comes_in_parts_is_kept_until_it_is_whole(pair):
    parent, child = pair
    data = pickle.dumps(StepTask(3))
    framed = HEADER.pack(len(data)) + data
    os.write(child.write_fd, framed[:5])
    with pytest.raises(TimeoutError):
        parent.receive(0.05)
    os.write(child.write_fd, framed[5:])
    assert parent.receive(1.0) == StepTask(3)


def test_a_writer_that_is_gone_reads_as_closed_not_as_a_wait(pair):
    parent, child = pair
    child.close()  # the other end, closed in the only process that had it
    with pytest.raises(ChannelClosed):
        parent.receive(5.0)
    with pytest.raises(ChannelClosed):
        parent.send(StepTask(1), 5.0)


def test_a_stream_out_of_step_is_broken_not_allocated(pair):
    parent, child = pair
    os.write(child.write_fd, b"\xff" * HEADER.size)  # a "message" of 2**64 - 1 bytes
    with pytest.raises(ChannelBroken):
        parent.receive(1.0)


def test_a_receive_waits_without_spinning(pair):
    parent, _ = pair
    before = os.times()
    with pytest.raises(TimeoutError):
        parent.receive(0.5)
    used = (os.times().user - before.user) + (os.times().system - before.system)
    assert used < 0.1  # 0.5 s of waiting on poll, not of reading an empty pipe over and over


class FailsToLoadIn:
    """Pickles anywhere, loads anywhere but in the process `pid` (there: a result that cannot be read)."""

    def __init__(self, pid: int):
        self.pid = pid

    def __reduce__(self):
        return (_load_unless_in, (self.pid,))


def _load_unless_in(pid: int) -> "FailsToLoadIn":
    if os.getpid() == pid:
        raise MemoryError("cannot rebuild the message here")
    return FailsToLoadIn(pid)


def test_a_message_that_does_not_load_breaks_the_channel_and_is_not_read_again(pair):
    parent, child = pair
    child.send(FailsToLoadIn(os.getpid()), 1.0)
    child.send(StepTask(2), 1.0)
    with pytest.raises(ChannelBroken, match="does not load"):
        parent.receive(1.0)
    # The message after it cannot be trusted to be the one the reader waits for: nothing is read any more.
    with pytest.raises(ChannelBroken):
        parent.receive(1.0)


def test_a_message_too_large_for_the_channel_is_refused_before_a_byte_is_written(pair, monkeypatch):
    parent, child = pair
    monkeypatch.setattr(channel_module, "MAX_MESSAGE_BYTES", 1000)
    with pytest.raises(ValueError, match="larger than the channel takes"):
        child.send(big_task(1000), 1.0)
    child.send(StepTask(4), 1.0)
    assert parent.receive(1.0) == StepTask(4)
