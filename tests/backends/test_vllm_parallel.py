"""vLLM with more than one worker process, for real on CPU: pipeline parallel 2 on the embedded model, tensor
parallel 2 on a tiny Llama (4 heads), each worker pinned to one core. Greedy tokens equal a single process's
(transformers' float32 forward of the same weights), and no vLLM process outlives any way the model worker can end:
shutdown, SIGKILL of the worker, death of the server process. Plus the start-up errors for layouts that cannot work
(no vLLM start needed)."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from app import STARTUP_FAILURE_EXIT_CODE, create_app
from engine import BackendUnavailable, EngineConfig, SamplingParams
from engine import parallel_layout as layout
from engine.backend_choice import choose_backend
from engine.backends.vllm import _engine_args, split_cores

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["1, 2, 3, 4,", "The capital of France is", "Tell me a story about dragons."]
GREEDY_16 = SamplingParams(max_tokens=16, ignore_eos=True)
ONE_CORE_EACH = "0|1"


# A random-weight Llama vLLM's CPU attention takes (head size 32; tests.torch_jobs' tiny Llama has 16) with 4
# heads and 2 key/value heads, so tensor parallel 2 splits both. Built in a child: this process forks workers.
BUILD_TINY_LLAMA = textwrap.dedent("""
    import sys
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    target, tokenizer_dir = sys.argv[1:]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                         tie_word_embeddings=False, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    LlamaForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
""")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, smol_model_dir) -> str:
    target = str(tmp_path_factory.mktemp("tiny-llama-tp"))
    subprocess.run([sys.executable, "-c", BUILD_TINY_LLAMA, target, smol_model_dir], check=True, timeout=300)
    return target


@pytest.fixture
def pinned_workers(monkeypatch):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two vLLM workers need two cores")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", ONE_CORE_EACH)


def greedy_tokens(engine) -> list[tuple[int, ...]]:
    return [output.output_token_ids for output in engine.generate(PROMPTS, GREEDY_16, timeout=300)]


def worker_tree(engine) -> list[psutil.Process]:
    """The model worker and every process below it (vLLM's workers, multiprocessing's resource tracker)."""
    model_worker = psutil.Process(engine.executor.pid)
    return [model_worker, *model_worker.children(recursive=True)]


def still_running(processes: list[psutil.Process], timeout: float = 20.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while True:
        running = [p for p in processes if _is_running(p)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


def _is_running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_parallel_tree(tree: list[psutil.Process], num_vllm_workers: int) -> None:
    """vLLM started its workers below our model worker, all in the model worker's own process group."""
    names = [p.name() for p in tree]
    assert sum("VLLM::Worker" in name for name in names) == num_vllm_workers, names
    assert {os.getpgid(p.pid) for p in tree} == {tree[0].pid}
    assert os.getpgid(tree[0].pid) != os.getpgid(0)  # a group SIGTERM for the server does not reach them


def test_pipeline_parallel_2_gives_the_single_worker_tokens_and_shutdown_reaps(make_engine, smol_model_dir,
                                                                               pinned_workers):
    # The single-worker reference: transformers' float32 forward (tests/server/test_backends.py holds the two backends'
    # float32 greedy tokens equal; a vLLM start less)
    single = make_engine(smol_model_dir, backend="hf")
    expected = greedy_tokens(single)
    single.shutdown()

    started = time.monotonic()
    engine = make_engine(smol_model_dir, backend="vllm", pipeline_parallel_size=2)
    print(f"pipeline parallel 2 ready in {time.monotonic() - started:.1f} s")
    tree = worker_tree(engine)
    assert_parallel_tree(tree, 2)
    assert greedy_tokens(engine) == expected

    engine.shutdown()  # ShutdownTask -> backend.close() -> vLLM stops its workers
    assert still_running(tree) == []


def test_tensor_parallel_2_gives_the_single_process_tokens_and_a_killed_worker_leaves_no_orphans(
        make_engine, tiny_model_dir, pinned_workers):
    # The single-process reference: transformers' float32 forward of the same float32 weights (a vLLM start less)
    expected = greedy_tokens(make_engine(tiny_model_dir, backend="hf"))
    assert len({token for tokens in expected for token in tokens}) > 8  # not a degenerate repeat

    engine = make_engine(tiny_model_dir, backend="vllm", tensor_parallel_size=2)
    tree = worker_tree(engine)
    assert_parallel_tree(tree, 2)
    assert greedy_tokens(engine) == expected

    tree[0].kill()  # the model worker alone, as the OOM killer would
    assert still_running(tree) == []
    engine.shutdown()  # also ends the replacement the engine may be starting


PARENT_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import psutil
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=sys.argv[1], backend="vllm", dtype="float32",
                                    tensor_parallel_size=2)).start()
    engine.generate(["Hello"], SamplingParams(max_tokens=2))
    worker = psutil.Process(engine.executor.pid)
    print("PIDS", *(p.pid for p in [worker, *worker.children(recursive=True)]), flush=True)
    time.sleep(600)
""")


def test_vllm_workers_die_with_the_server_process(tiny_model_dir, pinned_workers):
    server = subprocess.Popen([sys.executable, "-c", PARENT_SCRIPT, tiny_model_dir], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        pids = [int(pid) for pid in _pids_line(server.stdout).split()[1:]]
        assert len(pids) >= 3, "the server process did not start its vLLM workers"
        tree = [psutil.Process(pid) for pid in pids]
        server.kill()  # no shutdown, no atexit: only the kernel and the pipes are left to end them
        server.wait(10)
        assert still_running(tree) == []
    finally:
        if server.poll() is None:
            server.kill()


def _pids_line(stdout) -> str:
    """The script's PIDS line; vLLM logs to stdout too."""
    for line in stdout:
        if line.startswith("PIDS "):
            return line
    return ""


# -- impossible layouts, refused at start with what to change -------------------------------------------


def test_heads_not_divisible_by_the_tensor_parallel_size(smol_model_dir):
    with pytest.raises(BackendUnavailable, match=r"9 attention heads.*LOCKSTEP_TENSOR_PARALLEL_SIZE to a divisor "
                                                 r"of 9 \(1, 3, 9\).*LOCKSTEP_PIPELINE_PARALLEL_SIZE"):
        layout.check_layout(EngineConfig(model=smol_model_dir, tensor_parallel_size=2), "vllm", False)
    layout.check_layout(EngineConfig(model=smol_model_dir, pipeline_parallel_size=2), "vllm", False)


def test_more_workers_than_cores_or_gpus(monkeypatch, tiny_model_dir):
    config = EngineConfig(model=tiny_model_dir, tensor_parallel_size=2, pipeline_parallel_size=4)
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(BackendUnavailable, match=f"8 vLLM workers, but only {cores} CPU cores"):
        layout.check_layout(config, "vllm", False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(BackendUnavailable, match="only 4 GPUs .*at most 4"):
        layout.check_layout(config, "vllm", True)
    ray = EngineConfig(model=tiny_model_dir, tensor_parallel_size=2, pipeline_parallel_size=4,
                       distributed_executor="ray")
    layout.check_layout(ray, "vllm", True)  # a Ray cluster may have the GPUs on other nodes
    with pytest.raises(BackendUnavailable, match="CPU build does not support Ray.*LOCKSTEP_DISTRIBUTED_EXECUTOR=mp"):
        layout.check_layout(ray, "vllm", False)
    with pytest.raises(BackendUnavailable, match="CPU build does not support Ray"):  # vLLM starts Ray for one too
        layout.check_layout(EngineConfig(model=tiny_model_dir, distributed_executor="ray"), "vllm", False)


def test_a_thread_binding_must_name_one_core_group_per_worker(monkeypatch, tiny_model_dir):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    with pytest.raises(BackendUnavailable, match="names 1 core group.*for 2 vLLM workers.*\"0|1\""):
        layout.check_layout(EngineConfig(model=tiny_model_dir, tensor_parallel_size=2), "vllm", False)


def test_parallel_layouts_need_the_vllm_backend(tiny_model_dir):
    with pytest.raises(BackendUnavailable, match="needs the vLLM backend.*LOCKSTEP_BACKEND=vllm"):
        choose_backend(EngineConfig(model=tiny_model_dir, backend="hf", pipeline_parallel_size=2))


def test_the_app_stops_with_one_line_for_an_impossible_layout(smol_model_dir, caplog):
    with pytest.raises(SystemExit) as info:
        create_app({"ENGINE": EngineConfig(model=smol_model_dir, backend="vllm", tensor_parallel_size=2)})
    assert info.value.code == STARTUP_FAILURE_EXIT_CODE
    [line] = [r.message for r in caplog.records if r.levelname == "CRITICAL"]
    assert line.startswith("lockstep cannot start: the model has 9 attention heads")


# -- vLLM's arguments ---------------------------------------------------------------------------------------


def test_cores_are_split_evenly_between_workers():
    assert split_cores([0, 1], 2) == "0|1"
    assert split_cores([0, 1, 2, 3, 4], 2) == "0,1|2,3"


def test_eager_only_on_cpu_unless_told(tiny_model_dir):
    config = EngineConfig(model=tiny_model_dir, gpu_memory_utilization=0.5, distributed_executor="ray",
                          tensor_parallel_size=2)
    on_cuda = _engine_args(config, tiny_model_dir, "cuda")
    assert on_cuda["enforce_eager"] is False and on_cuda["gpu_memory_utilization"] == 0.5
    assert on_cuda["distributed_executor_backend"] == "ray" and on_cuda["tensor_parallel_size"] == 2
    on_cpu = _engine_args(config, tiny_model_dir, "cpu")
    assert on_cpu["enforce_eager"] is True and "gpu_memory_utilization" not in on_cpu
    eager = EngineConfig.from_env({"LOCKSTEP_ENFORCE_EAGER": "true", "LOCKSTEP_DISTRIBUTED_EXECUTOR": "mp"})
    assert _engine_args(eager, "m", "cuda")["enforce_eager"] is True
    assert _engine_args(eager, "m", "cuda")["distributed_executor_backend"] == "mp"
    assert "distributed_executor_backend" not in _engine_args(EngineConfig(), "m", "cuda")
