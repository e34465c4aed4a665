"""`make gpu-check` where there is no GPU: one line, exit 0, nothing run; the bundle it brings to an air-gapped GPU
host installs offline into a fresh venv and needs nothing but what such a host has; and its steps (the CUDA tests,
random models, gunicorn, the load, the table) run end to end as a rehearsal on this CPU."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_bundle import HOST_PACKAGES, dependency_closure
from engine.backend_choice import has_cuda_device

REPO = Path(__file__).resolve().parents[2]
# Modules lockstep and the check import from the bundle that load without the host's numpy and torch.
BUNDLED_MODULES_WITHOUT_NUMPY = ("flask", "flask_sock", "simple_websocket", "gunicorn", "llguidance",
                                 "prometheus_client", "tokenizers", "safetensors", "huggingface_hub", "psutil",
                                 "websocket", "tqdm", "yaml")
# In the fresh venv: every requirement of every installed distribution is installed, or is the GPU host's own.
MISSING_REQUIREMENTS = """
import json, sys
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as name
installed = {name(d.metadata["Name"]) for d in metadata.distributions(path=[sys.argv[1]])}
missing = sorted({name(Requirement(r).name) for d in metadata.distributions(path=[sys.argv[1]]) for r in d.requires
                  or () if (Requirement(r).marker is None or Requirement(r).marker.evaluate({"extra": ""}))
                  and name(Requirement(r).name) not in installed})
print(json.dumps(missing))
"""


@pytest.mark.skipif(has_cuda_device(), reason="this host has a GPU: `make gpu-check` would run the check")
def test_without_a_gpu_the_check_says_so_in_one_line_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["make", "--no-print-directory", "gpu-check", f"OUT={out}"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith(("make", "python"))]
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "nothing was run" in lines[0], lines
    assert not out.exists()


def test_the_bundle_installs_offline_into_a_fresh_venv_and_needs_only_the_gpu_hosts_packages(tmp_path):
    python = gpu_check.install_bundle(gpu_check.BUNDLE, tmp_path / "venv")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # Imported from the venv's own site-packages (not this suite's venv), without a network.
    where = subprocess.run([str(python), "-c", "import sys, importlib.util as u; "
                            "[print(u.find_spec(m).origin) for m in sys.argv[1:]]", *BUNDLED_MODULES_WITHOUT_NUMPY],
                           capture_output=True, text=True, check=True).stdout.split()
    assert where and all(path.startswith(site) for path in where), where
    done = subprocess.run([str(python), "-c", f"import {', '.join(BUNDLED_MODULES_WITHOUT_NUMPY)}"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    missing = subprocess.run([sys.executable, "-c", MISSING_REQUIREMENTS, site], capture_output=True, text=True,
                             check=True).stdout
    host = set(dependency_closure(HOST_PACKAGES))  # torch, numpy, pytest and what they need
    assert set(json.loads(missing)) <= host, missing


def test_the_check_rehearsed_on_this_cpu_serves_measures_and_writes_its_table(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--cpu-rehearsal", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "gpu-check.md").read_text()
    cuda_tests = (REPO / "tests" / "backends" / "test_cuda.py").read_text().count("\ndef test_")
    assert f"CUDA tests (tests/backends/test_cuda.py): {cuda_tests} skipped" in table
    assert "SKIPPED [1] tests/backends/test_cuda.py" in (tmp_path / "cuda-tests.log").read_text()
    assert "no CUDA GPU on this host" in (tmp_path / "cuda-tests.log").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| SmolLM2-135M shape | 1 |")]
    assert len(rows) == 1
    completed, failed = (int(n) for n in rows[0].split("|")[3].split("/"))
    assert completed >= 1 and failed == 0 and float(rows[0].split("|")[4]) > 0
