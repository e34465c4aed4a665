"""A container's CPU limit (Docker's `--cpus`, a Kubernetes CPU limit) is a cgroup quota, not an affinity: the
process still sees every core. lockstep computes on no more threads than the quota's whole CPUs
(engine/hardware.py, `available_cores`), and says so in /v1/models.

The parsing runs on cgroup trees written here (cgroup v2 and v1, nested limits, a container's namespaced root); the
end-to-end test puts a real gunicorn in a real cgroup with a 1.5-CPU quota where this process may make one."""
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from engine.hardware import available_cores, cores_within, cpu_cgroups, cpu_quota

from .client import http
from .test_gunicorn import REPO, free_port, wait_ready


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


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
    (cgroup,) = cpu_cgroups(proc)
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
    assert [(c.directory, c.version) for c in cpu_cgroups(proc)] == [(str(cpu), 1)]
    assert cpu_quota(proc) == 0.5


def test_no_limit_anywhere_is_none(tmp_path):
    v1, v2 = tmp_path / "cpu", tmp_path / "unified"
    write(v1 / "user" / "cpu.cfs_quota_us", "-1\n")
    write(v1 / "user" / "cpu.cfs_period_us", "100000\n")
    write(v2 / "user" / "cpu.max", "max 100000\n")
    proc = proc_with(tmp_path, "3:cpu:/user\n0::/user\n",
                     f"32 31 0:29 / {v1} rw - cgroup cgroup rw,cpu\n33 31 0:30 / {v2} rw - cgroup2 cgroup2 rw\n")
    assert len(cpu_cgroups(proc)) == 2
    assert cpu_quota(proc) is None


def test_unreadable_or_odd_files_mean_no_limit(tmp_path):
    mount = tmp_path / "cgroup2"
    write(mount / "a" / "cpu.max", "lots 100000\n")
    write(mount / "cpu.max", "100000 0\n")  # a zero period: not a limit
    assert cpu_quota(proc_with(tmp_path, "0::/a\n", f"30 1 0:26 / {mount} rw - cgroup2 cgroup2 rw\n")) is None
    assert cpu_quota(str(tmp_path / "no-such-proc")) is None


@pytest.mark.parametrize("cores, quota, threads", [(2, None, 2), (2, 1.5, 1), (2, 0.5, 1), (2, 4.0, 2),
                                                   (64, 2.9, 2), (1, 1e-300, 1)])
def test_threads_are_the_quotas_whole_cpus_within_the_affinity(cores, quota, threads):
    assert cores_within(cores, quota) == threads


def writable_cpu_cgroup() -> Path | None:
    """A cgroup this process may make with a CPU quota in it: v1's cpu hierarchy, or v2 where `cpu` is delegated."""
    for cgroup in cpu_cgroups():
        controls = Path(cgroup.directory) / "cgroup.subtree_control"
        if cgroup.version == 2 and (not controls.exists() or "cpu" not in controls.read_text().split()):
            continue
        child = Path(cgroup.directory) / f"lockstep-test-{uuid.uuid4().hex[:8]}"
        try:
            child.mkdir()
        except OSError:
            continue
        try:
            if cgroup.version == 2:
                (child / "cpu.max").write_text("150000 100000")
            else:
                (child / "cpu.cfs_period_us").write_text("100000")
                (child / "cpu.cfs_quota_us").write_text("150000")
            return child
        except OSError:
            child.rmdir()
    return None


@pytest.fixture
def quota_cgroup():
    if available_cores() < 2:
        pytest.skip(f"this host has {available_cores()} core: a quota of 1.5 CPUs takes none away")
    child = writable_cpu_cgroup()
    if child is None:
        pytest.skip("no cgroup cpu controller this process may write (cgroup v1 `cpu`, or v2 with `cpu` delegated: "
                    "root or a delegated subtree)")
    yield child
    child.rmdir()  # its processes are gone: the test waited for them


def test_a_server_in_a_cpu_quota_computes_on_its_whole_cpus(quota_cgroup, smol_model_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "LOCKSTEP_PORT": str(port), "LOCKSTEP_HTTP_THREADS": "16"}
    env.pop("LOCKSTEP_THREADS", None)
    with open(tmp_path / "gunicorn.log", "w+") as log:
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "gunicorn"), "-c", "gunicorn.conf.py", "wsgi:app"], cwd=REPO, env=env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=lambda: (quota_cgroup / "cgroup.procs").write_text(str(os.getpid())))
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, process)
            status, _, models = http("GET", url + "/v1/models")
            assert status == 200
            (model,) = models["data"]
            assert "1 cores (a cgroup CPU quota of 1.5)" in model["compute_reason"]
            if "lockstep's 4-bit kernels" in model["compute"]:  # a helper thread per core beside the caller
                assert ", 1 threads" in model["compute"]
            status, _, answer = http("POST", url + "/v1/completions",
                                  {"model": model["id"], "prompt": "The capital of France is", "max_tokens": 8,
                                   "temperature": 0, "ignore_eos": True})
            assert status == 200 and answer["usage"]["completion_tokens"] == 8
            log.seek(0)
            assert "a cgroup CPU quota of 1.5" in log.read()  # the start log says it too
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            _, alive = psutil.wait_procs(in_cgroup(quota_cgroup), timeout=60)
            for straggler in alive:
                straggler.kill()
            process.wait(10)
    assert not alive, f"processes left after SIGTERM: {alive}"


def in_cgroup(cgroup: Path) -> list[psutil.Process]:
    processes = []
    for pid in (cgroup / "cgroup.procs").read_text().split():
        try:
            processes.append(psutil.Process(int(pid)))
        except psutil.NoSuchProcess:
            pass
    return processes
