"""The pipes to the model worker (engine/channel.py): whole messages both ways, every wait bounded."""
import multiprocessing
import os
import pickle
import signal

import pytest

from engine.channel import HEADER, ChannelClosed, pipe_pair
from engine.messages import NewRequest, StepTask, WorkerSampling

PIPE_BYTES = 64 * 1024  # Linux's default pipe buffer


def echo_until_closed(channel):
    channel.close_peer()
    try:
        while True:
            channel.send(channel.receive(10.0), 10.0)
    except ChannelClosed:
        return


@pytest.fixture
def echo_child():
    parent, child = pipe_pair()
    process = multiprocessing.get_context("fork").Process(target=echo_until_closed, args=(child,))
    process.start()
    parent.close_peer()
    yield parent, process
    parent.close()
    process.join(10)
    if process.is_alive():
        process.kill()


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


def test_a_message_that_comes_in_parts_is_kept_until_it_is_whole():
    parent, child = pipe_pair()
    try:
        data = pickle.dumps(StepTask(3))
        framed = HEADER.pack(len(data)) + data
        os.write(child.write_fd, framed[:5])
        with pytest.raises(TimeoutError):
            parent.receive(0.05)
        os.write(child.write_fd, framed[5:])
        assert parent.receive(1.0) == StepTask(3)
    finally:
        parent.close()  # and the other end's descriptors, which this process holds too


def test_a_writer_that_is_gone_reads_as_closed_not_as_a_wait():
    parent, _ = pipe_pair()
    parent.close_peer()  # the other end's descriptors, closed in the only process that had them
    try:
        with pytest.raises(ChannelClosed):
            parent.receive(5.0)
        with pytest.raises(ChannelClosed):
            parent.send(StepTask(1), 5.0)
    finally:
        parent.close()


def test_a_stream_out_of_step_is_closed_not_allocated():
    parent, child = pipe_pair()
    try:
        os.write(child.write_fd, b"\xff" * HEADER.size)  # a "message" of 2**64 - 1 bytes
        with pytest.raises(ChannelClosed):
            parent.receive(1.0)
    finally:
        parent.close()  # and the other end's descriptors, which this process holds too


def test_a_receive_waits_without_spinning():
    parent, child = pipe_pair()
    try:
        before = os.times()
        with pytest.raises(TimeoutError):
            parent.receive(0.5)
        used = (os.times().user - before.user) + (os.times().system - before.system)
        assert used < 0.1  # 0.5 s of waiting on poll, not of reading an empty pipe over and over
    finally:
        parent.close()  # and the other end's descriptors, which this process holds too
