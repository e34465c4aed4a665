"""A container's limits are cgroup limits. Its CPU limit (Docker's `--cpus`, a Kubernetes CPU limit) is a quota, not
an affinity: the process still sees every core, and lockstep computes on no more threads than the quota's whole CPUs
(engine/hardware.py, `available_cores`), and says so in /v1/models. Its memory limit must hold the server: on the
4-bit path the model worker never holds a float32 copy of the projections (engine/backends/q4.py,
`empty_model`), so the whole server peaked at 727 MB in its cgroup where it took 1,379 MB; and its keys and
values must stay within what the limit leaves once the model is loaded (the KV budget and the context follow it:
`memory_headroom`, `kv_budget_within`).

The parsing runs on cgroup trees written here (cgroup v2 and v1, nested limits, a container's namespaced root, memory
limits and what their cgroups hold); the end-to-end tests put a real gunicorn in a real cgroup (a 1.5-CPU quota; a
1 GiB memory limit, then filled with long prompts) where this process may make one."""
import os
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from engine import EngineConfig
from engine.backends.kv_cache import KV_MEMORY_RESERVE, KV_MEMORY_RESERVE_SHARE, MIN_CONTEXT, KVBudget, kv_budget_within
from engine.hardware import available_cores, cgroups, cores_within, cpu_quota, memory_headroom

from ..client import http
from .test_edge_gunicorn import Gunicorn


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


MB = 1 << 20
KV_BYTES_PER_POSITION = 23040  # the embedded model's keys and values in float16: 30 layers x 3 heads x 64 x 2 x 2


def proc_with(tmp_path: Path, cgroup_lines: str, mount_lines: str) -> str:
    proc = tmp_path / "proc"
    write(proc / "cgroup", cgroup_lines)
    write(proc / "mountinfo", mount_lines)
    return str(proc)


def test_v2_the_least_quota_on_the_path_up_to_the_mount_counts(tmp_path):
    mount = tmp_path / "cgroup2"
    write(mount / "kubepods" / "cpu.max", "400000 100000\n")
    write(mount / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")
    write(mount / "kubepods" / "pod1" / "ctr" / "cpu.max", "max 100000\n")
    proc = proc_with(tmp_path, "0::/kubepods/pod1/ctr\n",
                     f"30 1 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    (cgroup,) = cgroups("cpu", proc)
    assert (cgroup.directory, cgroup.version) == (str(mount / "kubepods" / "pod1" / "ctr"), 2)
    assert cpu_quota(proc) == 1.5


def test_v1_a_containers_namespaced_root_is_its_own_cgroup(tmp_path):
    """Docker without a cgroup namespace: /proc/self/cgroup names the host's path, the mount's root is that path."""
    cpu, memory = tmp_path / "cpu,cpuacct", tmp_path / "memory"
    write(cpu / "cpu.cfs_quota_us", "50000\n")
    write(cpu / "cpu.cfs_period_us", "100000\n")
    write(memory / "cpu.cfs_quota_us", "1\n")  # not the cpu hierarchy: never read
    proc = proc_with(tmp_path, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n",
                     f"40 31 0:37 /docker/abc {cpu} rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
                     f"41 31 0:38 /docker/abc {memory} rw,relatime - cgroup cgroup rw,memory\n"
                     f"42 31 0:39 /docker/abc {tmp_path / 'cpuset'} rw,relatime - cgroup cgroup rw,cpuset\n")
    assert [(c.directory, c.version) for c in cgroups("cpu", proc)] == [(str(cpu), 1)]
    assert cpu_quota(proc) == 0.5


def test_no_limit_anywhere_is_none(tmp_path):
    v1, v2 = tmp_path / "cpu", tmp_path / "unified"
    write(v1 / "user" / "cpu.cfs_quota_us", "-1\n")
    write(v1 / "user" / "cpu.cfs_period_us", "100000\n")
    write(v2 / "user" / "cpu.max", "max 100000\n")
    proc = proc_with(tmp_path, "3:cpu:/user\n0::/user\n",
                     f"32 31 0:29 / {v1} rw - cgroup cgroup rw,cpu\n33 31 0:30 / {v2} rw - cgroup2 cgroup2 rw\n")
    assert len(cgroups("cpu", proc)) == 2
    assert cpu_quota(proc) is None


def test_unreadable_or_odd_files_mean_no_limit(tmp_path):
    mount = tmp_path / "cgroup2"
    write(mount / "a" / "cpu.max", "lots 100000\n")
    write(mount / "cpu.max", "100000 0\n")  # a zero period: not a limit
    assert cpu_quota(proc_with(tmp_path, "0::/a\n", f"30 1 0:26 / {mount} rw - cgroup2 cgroup2 rw\n")) is None
    assert cpu_quota(str(tmp_path / "no-such-proc")) is None
    garbled = proc_with(tmp_path / "garbled", "0::/a\n\n:::\n", f"- {mount} x\n1 2 3 - cgroup2\n\n")
    assert cgroups("cpu", garbled) == [] and cpu_quota(garbled) is None
    binary = tmp_path / "binary"
    write(binary / "mountinfo", "")
    (binary / "cgroup").write_bytes(b"\xff\xfe0::/a\n")
    assert cpu_quota(str(binary)) is None


def test_escaped_mount_points_and_paths_outside_a_namespaces_root(tmp_path):
    """mountinfo writes a space as \\040; `0::/../sibling` is a cgroup outside the namespace's root (the mount is all
    this process sees of it); an empty path or an absurd number is no limit, never an exception."""
    mount = tmp_path / "my cg"
    write(mount / "a" / "cpu.max", "50000 100000\n")
    write(mount / "cpu.max", "200000 100000\n")
    escaped = str(mount).replace(" ", "\\040")
    line = f"30 1 0:26 / {escaped} rw - cgroup2 cgroup2 rw\n"
    assert cpu_quota(proc_with(tmp_path / "spaced", "0::/a\n", line)) == 0.5
    assert cpu_quota(proc_with(tmp_path / "outside", "0::/../sibling\n", line)) == 2.0
    assert cpu_quota(proc_with(tmp_path / "no-path", "0::\n", line)) is None
    write(mount / "huge" / "cpu.max", "1" + "0" * 400 + " 1\n")
    assert cpu_quota(proc_with(tmp_path / "huge", "0::/huge\n", line)) == 2.0  # the parent's limit still counts


def meminfo_with(tmp_path: Path, available_mb: int) -> str:
    path = tmp_path / "meminfo"
    write(path, f"MemTotal:       25165824 kB\nMemFree:  1024 kB\nMemAvailable:   {available_mb * 1024} kB\n")
    return str(path)


def test_v2_memory_headroom_is_the_least_limit_less_what_its_cgroup_holds(tmp_path):
    """What a cgroup holds counts without its inactive file pages (the kernel drops them before it kills); v2's
    `memory.high` binds like `memory.max`; a parent's limit holds its children too."""
    mount = tmp_path / "cgroup2"
    pod, ctr = mount / "kubepods" / "pod1", mount / "kubepods" / "pod1" / "ctr"
    write(mount / "kubepods" / "memory.max", "max\n")
    write(mount / "kubepods" / "memory.current", f"{9000 * MB}\n")
    for name, value in {"memory.max": 2048 * MB, "memory.current": 1536 * MB}.items():
        write(pod / name, f"{value}\n")
    write(pod / "memory.high", "max\n")
    write(pod / "memory.stat", f"anon {1000 * MB}\nactive_file {36 * MB}\ninactive_file {400 * MB}\n")
    for name, value in {"memory.max": 1024 * MB, "memory.high": 900 * MB, "memory.current": 300 * MB}.items():
        write(ctr / name, f"{value}\n")
    write(ctr / "memory.stat", f"anon {200 * MB}\ninactive_file {100 * MB}\n")
    proc = proc_with(tmp_path, "0::/kubepods/pod1/ctr\n", f"30 1 0:26 / {mount} rw - cgroup2 cgroup2 rw\n")
    assert memory_headroom(proc, meminfo_with(tmp_path, 8000)) == 700 * MB  # the container's memory.high
    write(pod / "memory.current", f"{1900 * MB}\n")  # the pod's other containers grew: 2048 - (1900 - 400)
    assert memory_headroom(proc, meminfo_with(tmp_path, 8000)) == 548 * MB
    assert memory_headroom(proc, meminfo_with(tmp_path, 300)) == 300 * MB  # the machine has less
    # weights mapped from a file: MemAvailable counts their pages as droppable page cache, the cgroup as held
    assert memory_headroom(proc, meminfo_with(tmp_path, 800), mapped=200 * MB) == 548 * MB
    assert memory_headroom(proc, meminfo_with(tmp_path, 600), mapped=200 * MB) == 400 * MB
    assert memory_headroom(proc, meminfo_with(tmp_path, 100), mapped=200 * MB) == 0
    write(ctr / "memory.current", f"{5000 * MB}\n")  # past its limit (as reported): none left, never negative
    assert memory_headroom(proc, meminfo_with(tmp_path, 8000)) == 0


def test_v1_memory_headroom_reads_no_limit_as_none(tmp_path):
    """cgroup v1 writes "no limit" as 9223372036854771712; its usage is the hierarchy's, so is total_inactive_file."""
    memory = tmp_path / "memory"
    write(memory / "memory.limit_in_bytes", "9223372036854771712\n")
    write(memory / "memory.usage_in_bytes", f"{20000 * MB}\n")
    write(memory / "docker" / "abc" / "memory.limit_in_bytes", f"{1024 * MB}\n")
    write(memory / "docker" / "abc" / "memory.usage_in_bytes", f"{700 * MB}\n")
    write(memory / "docker" / "abc" / "memory.stat",
          f"cache {300 * MB}\ninactive_file {10 * MB}\ntotal_inactive_file {200 * MB}\n")
    mounts = f"41 31 0:38 / {memory} rw,relatime - cgroup cgroup rw,memory\n"
    proc = proc_with(tmp_path, "9:memory:/docker/abc\n", mounts)
    assert memory_headroom(proc, meminfo_with(tmp_path, 8000)) == 524 * MB
    unlimited = proc_with(tmp_path / "unlimited", "9:memory:/\n", mounts)
    assert memory_headroom(unlimited, meminfo_with(tmp_path, 8000)) == 8000 * MB  # only the machine's
    assert memory_headroom(unlimited, str(tmp_path / "no-meminfo")) is None
    write(tmp_path / "garbled", "MemAvailable: lots\n")
    assert memory_headroom(unlimited, str(tmp_path / "garbled")) is None


def test_memory_high_alone_or_files_a_process_may_not_read(tmp_path):
    """A level with only `memory.high` (v2's throttling limit) binds; a missing `memory.stat` costs only the
    inactive-page adjustment, not the limit; a level whose usage cannot be read is skipped."""
    mount = tmp_path / "cgroup2"
    ctr = mount / "ctr"
    write(ctr / "memory.max", "max\n")
    write(ctr / "memory.high", f"{286 * MB}\n")
    write(ctr / "memory.current", f"{100 * MB}\n")
    proc = proc_with(tmp_path, "0::/ctr\n", f"30 1 0:26 / {mount} rw - cgroup2 cgroup2 rw\n")
    assert memory_headroom(proc, meminfo_with(tmp_path, 8000)) == 186 * MB
    (ctr / "memory.high").unlink()
    write(ctr / "memory.max", f"{512 * MB}\n")
    assert memory_headroom(proc, meminfo_with(tmp_path, 8000)) == 412 * MB  # no memory.stat here
    (ctr / "memory.current").unlink()
    assert memory_headroom(proc, meminfo_with(tmp_path, 8000)) == 8000 * MB


def test_the_kv_budget_fits_what_memory_leaves():
    """The batch's keys and values and one whole context (a joining prompt's copy) within the headroom less a
    reserve; as configured where that fits or nothing is known."""
    assert kv_budget_within(None, KV_BYTES_PER_POSITION, 32768, 8192) == KVBudget(32768, 8192)
    assert kv_budget_within(16 << 30, KV_BYTES_PER_POSITION, 32768, 8192) == KVBudget(32768, 8192)
    headroom = 400 * MB
    tight = kv_budget_within(headroom, KV_BYTES_PER_POSITION, 32768, 8192)
    fit = (headroom - KV_MEMORY_RESERVE - headroom // KV_MEMORY_RESERVE_SHARE) // KV_BYTES_PER_POSITION
    assert tight.context == fit // 2 < 8192 and tight.context <= tight.positions <= fit - tight.context
    assert "memory leaves 400 MB beside the model" in tight.reason and "may kill" not in tight.reason
    ample_context = kv_budget_within(headroom, KV_BYTES_PER_POSITION, 32768, 2048)  # a short context keeps its own
    assert ample_context.context == 2048 and ample_context.positions == fit - 2048
    starved = kv_budget_within(70 * MB, KV_BYTES_PER_POSITION, 32768, 8192)
    assert starved.positions == starved.context == MIN_CONTEXT and "may throttle or kill" in starved.reason
    # never more than configured: a short context, a small budget
    assert kv_budget_within(headroom, KV_BYTES_PER_POSITION, 32768, 256).context == 256
    assert kv_budget_within(70 * MB, KV_BYTES_PER_POSITION, 32768, 256).context == 256
    assert kv_budget_within(headroom, KV_BYTES_PER_POSITION, 1024, 8192).positions == 1024
    # decode padded to two rows: a request alone holds two slots of its context, and the prompt's copy
    padded = kv_budget_within(headroom, KV_BYTES_PER_POSITION, 32768, 8192, lone_slots=2)
    assert padded.context == fit // 3 and 2 * padded.context <= padded.positions <= fit - padded.context


@pytest.mark.parametrize("cores, quota, threads", [(2, None, 2), (2, 1.5, 1), (2, 0.5, 1), (2, 4.0, 2),
                                                   (64, 2.9, 2), (1, 1e-300, 1)])
def test_threads_are_the_quotas_whole_cpus_within_the_affinity(cores, quota, threads):
    assert cores_within(cores, quota) == threads


def writable_cgroup(controller: str, limits: dict[int, dict[str, str]]) -> Path | None:
    """A child of this process's cgroup with `limits[version]` written, in v1's hierarchy of `controller` or in v2's
    where the controller is delegated; None where this process may make none."""
    for cgroup in cgroups(controller):
        controls = Path(cgroup.directory) / "cgroup.subtree_control"
        if cgroup.version == 2 and (not controls.exists() or controller not in controls.read_text().split()):
            continue
        child = Path(cgroup.directory) / f"lockstep-test-{uuid.uuid4().hex[:8]}"
        try:
            child.mkdir()
        except OSError:
            continue
        try:
            for name, value in limits[cgroup.version].items():
                (child / name).write_text(value)
            return child
        except OSError:
            child.rmdir()
    return None


@pytest.fixture
def quota_cgroup():
    if available_cores() < 2:
        pytest.skip(f"this host has {available_cores()} core: a quota of 1.5 CPUs takes none away")
    child = writable_cgroup("cpu", {1: {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "150000"},
                                    2: {"cpu.max": "150000 100000"}})
    if child is None:
        pytest.skip("no cgroup cpu controller this process may write (cgroup v1 `cpu`, or v2 with `cpu` delegated: "
                    "root or a delegated subtree)")
    yield child
    remove(child)


@pytest.fixture
def memory_cgroup():
    limit = str(2**30)
    child = writable_cgroup("memory", {1: {"memory.limit_in_bytes": limit}, 2: {"memory.max": limit}})
    if child is None:
        pytest.skip("no cgroup memory controller this process may write (cgroup v1 `memory`, or v2 with `memory` "
                    "delegated: root or a delegated subtree)")
    yield child
    remove(child)


def remove(cgroup: Path) -> None:
    """The test's cgroup, and whatever a server that failed to start left in it."""
    left = in_cgroup(cgroup)
    for process in left:
        process.kill()
    psutil.wait_procs(left, timeout=30)
    cgroup.rmdir()


def stop_every_process_in(cgroup: Path, live: Gunicorn) -> list[psutil.Process]:
    """SIGTERM to the server's group; returns the processes of the cgroup still alive a minute later (killed)."""
    os.killpg(live.process.pid, signal.SIGTERM)
    _, alive = psutil.wait_procs(in_cgroup(cgroup), timeout=60)
    for straggler in alive:
        straggler.kill()
    live.stop()
    return alive


def completes(url: str, model: str) -> bool:
    status, _, answer = http("POST", url + "/v1/completions", {"model": model, "prompt": "The capital of France is",
                                                             "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    return status == 200 and answer["usage"]["completion_tokens"] == 8


def test_a_server_in_a_cpu_quota_computes_on_its_whole_cpus(quota_cgroup, smol_model_dir, tmp_path):
    live = Gunicorn(tmp_path, quota_cgroup, LOCKSTEP_HTTP_THREADS=16)
    try:
        status, _, models = http("GET", live.url + "/v1/models")
        assert status == 200
        (model,) = models["data"]
        assert "1 cores (a cgroup CPU quota of 1.5)" in model["compute_reason"]
        if "lockstep's 4-bit kernels" in model["compute"]:  # a helper thread per core beside the caller
            assert ", 1 threads" in model["compute"]
        assert completes(live.url, model["id"])
        assert "a cgroup CPU quota of 1.5" in live.log_text()  # the start log says it too
    finally:
        alive = stop_every_process_in(quota_cgroup, live)
    assert not alive, f"processes left after SIGTERM: {alive}"


def test_the_server_serves_a_batch_of_long_prompts_in_a_1_gib_memory_limit(memory_cgroup, smol_model_dir, tmp_path):
    """It peaked at 1,379 MB here while the worker loaded the safetensors as float32 and kept that copy: in 1.2 GiB the
    kernel killed the model worker at load. Now 727 MB. Then a batch of long prompts grew keys and values past the
    limit (16 prompts of 3,500 tokens: the model worker killed twice, every request a 503): now the KV budget and the
    context are what the limit leaves once the model is loaded, /v1/models says so, and long prompts take turns."""
    live = Gunicorn(tmp_path, memory_cgroup, LOCKSTEP_HTTP_THREADS=16)
    try:
        (model,) = http("GET", live.url + "/v1/models")[2]["data"]
        assert "memory leaves" in model["kv_budget_reason"]
        # the budget cut to what the limit leaves (the context too, where even one context would not fit beside it)
        assert model["max_batch_kv_tokens"] < min(EngineConfig().max_batch_kv_tokens, 4 * model["max_model_len"])
        context = model["max_model_len"]
        status, _, refused = http("POST", live.url + "/v1/completions",
                                  {"model": model["id"], "prompt": [200] * context, "max_tokens": 1})
        assert status == 400 and refused["error"]["code"] == "context_length_exceeded"
        with ThreadPoolExecutor(8) as pool:  # together, 4x the budget's keys and values
            answers = list(pool.map(lambda i: http("POST", live.url + "/v1/completions", {
                "model": model["id"], "prompt": [100 + i] + [200 + n % 500 for n in range(context // 2)],
                "max_tokens": 32, "temperature": 0, "ignore_eos": True}, timeout=600), range(8)))
        assert [status for status, _, _ in answers] == [200] * 8, answers[0][2]
        assert all(answer["usage"]["completion_tokens"] == 32 for _, _, answer in answers)
        assert oom_kills(memory_cgroup) == 0 and "died" not in live.log_text()
        assert completes(live.url, model["id"])
    finally:
        alive = stop_every_process_in(memory_cgroup, live)
    assert not alive, f"processes left after SIGTERM: {alive}"


def oom_kills(cgroup: Path) -> int:
    """Processes the kernel's OOM killer took in the cgroup (v1 `memory.oom_control`, v2 `memory.events`)."""
    for name in ("memory.events", "memory.oom_control"):
        if (cgroup / name).exists():
            counters = dict(line.split() for line in (cgroup / name).read_text().splitlines())
            return int(counters.get("oom_kill", 0))
    raise AssertionError(f"no OOM counter in {cgroup}")


def in_cgroup(cgroup: Path) -> list[psutil.Process]:
    processes = []
    for pid in (cgroup / "cgroup.procs").read_text().split():
        try:
            processes.append(psutil.Process(int(pid)))
        except psutil.NoSuchProcess:
            pass
    return processes


def test_the_4_bit_paths_empty_model_given_the_blocks_is_from_pretrained_given_them(smol_model_dir):
    """The worker's model on the 4-bit path is never read from the safetensors: once given the GGUF's numbers it has
    what `from_pretrained` + the same gift has, parameter for parameter, buffer for buffer, tied as it is."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine import EngineConfig
    from engine.backends.gguf_weights import empty_model
    from engine.backends.q4 import Q4Weights
    from engine.model_store import gguf_of

    loaded = AutoModelForCausalLM.from_pretrained(smol_model_dir, dtype=torch.float32).eval()
    empty = empty_model(smol_model_dir)
    weights = Q4Weights.from_gguf(gguf_of(smol_model_dir, EngineConfig()), loaded.config)
    for model in (loaded, empty):
        weights.give_model_the_same_weights(model)
    assert dict(loaded.named_parameters()).keys() == dict(empty.named_parameters()).keys()
    for (name, expected), (_, given) in zip(loaded.named_parameters(), empty.named_parameters()):
        assert torch.equal(expected, given), name
    for (name, expected), (_, computed) in zip(loaded.named_buffers(), empty.named_buffers()):
        assert expected.dtype == computed.dtype and torch.equal(expected, computed), name
    assert (empty.lm_head.weight is empty.model.embed_tokens.weight) == (
        loaded.lm_head.weight is loaded.model.embed_tokens.weight)
    assert empty.generation_config.to_dict() == loaded.generation_config.to_dict()
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, empty(ids).logits)


def test_a_gguf_that_leaves_a_parameter_unwritten_is_refused(smol_model_dir):
    """An empty model's parameter that the GGUF does not give would hold whatever its memory held."""
    import torch

    from engine import EngineConfig
    from engine.backends.gguf_weights import empty_model
    from engine.backends.q4 import Q4Weights
    from engine.model_store import gguf_of

    model = empty_model(smol_model_dir)
    model.model.layers[0].mlp.down_proj.bias = torch.nn.Parameter(torch.empty(model.config.hidden_size))
    weights = Q4Weights.from_gguf(gguf_of(smol_model_dir, EngineConfig()), model.config)
    with pytest.raises(ValueError, match=r"no values for model\.layers\.0\.mlp\.down_proj\.bias"):
        weights.give_model_the_same_weights(model)
