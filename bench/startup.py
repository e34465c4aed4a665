"""Time to ready and resident memory of each server on one GGUF file, started in turn on this host:

    python -m bench.startup --model FILE [--servers lockstep,llama-server] [--port PORT] [--ready-timeout 900]
        [--out-dir .cache/bench/startup]

Each server is started as bench compare starts it (bench/peers.py: lockstep as gunicorn with LOCKSTEP_MODEL=FILE,
llama.cpp's llama-server on the file with `-t <cores> -np 16 -c 32768`), in its own process group. Time to ready:
seconds from the spawn until it answers ready (lockstep: GET /ready, llama-server: GET /health, 200), polled every
0.1 s; lockstep's includes preparing the file into its cache where that is not done yet. Then one completion of 16
tokens, greedy, shows it serves. Resident memory: the sum of RSS over the server's process tree, sampled every
0.2 s from the spawn until after that completion (peak), and once after it; a file the server maps counts as far
as its pages are resident, and pages shared between processes of a tree count once per process. Then SIGTERM to
the group. A server named twice runs twice (the second run finds the file in the page cache). GB: 10^9 bytes.
"""
import argparse
import json
import logging
import os
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from .peers import ProcessServer, llama_server_command
from app.ops.gunicorn_process import REPO, free_port, http_status, start_gunicorn

logger = logging.getLogger(__name__)

SERVERS = ("lockstep", "llama-server")
READY_PATHS = {"lockstep": "/ready", "llama-server": "/health"}
READY_POLL_S = 0.1
RSS_SAMPLE_S = 0.2
PROMPT = "The capital of France is"
OUTPUT_TOKENS = 16
DEFAULT_OUT_DIR = REPO / ".cache" / "bench" / "startup"
GB = 1e9


@dataclass
class StartupResult:
    label: str
    ready_s: float | None = None
    completion_s: float | None = None
    completion_tokens: int | None = None
    peak_rss: int = 0
    peak_largest: int = 0  # the largest one process's RSS: lockstep's model worker, llama-server itself
    rss_after: int | None = None
    failed: str = ""


class TreeRss:
    """Samples the summed RSS of a process and its descendants every RSS_SAMPLE_S on a thread; keeps the peak, and
    the peak of the largest one process's."""

    def __init__(self, pid: int):
        self.pid = pid
        self.peak = self.peak_largest = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def now(self) -> int:
        try:
            root = psutil.Process(self.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        sizes = []
        for process in processes:
            try:
                sizes.append(process.memory_info().rss)
            except psutil.Error:  # ended between the listing and the reading
                pass
        total = sum(sizes)
        self.peak, self.peak_largest = max(self.peak, total), max([self.peak_largest, *sizes])
        return total

    def _run(self) -> None:
        while True:
            self.now()
            if self._stop.wait(RSS_SAMPLE_S):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def start(kind: str, model: Path, port: int, log_path: Path, ready_timeout: float):
    """The server (bench/peers.py's ways of starting them) with `url`, `process` and `stop()`."""
    if kind == "lockstep":
        # Below our own limit: a load that hangs is ended, and said so in its log, by lockstep's executor first.
        return start_gunicorn(log_path, {"LOCKSTEP_MODEL": str(model),
                                         "LOCKSTEP_LOAD_TIMEOUT_S": str(max(int(ready_timeout) - 60, 60))}, port)
    return ProcessServer(llama_server_command(str(model), port), port, log_path, {})


def wait_ready(server, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"exited during start-up (code {server.process.returncode})")
        if http_status(server.url + path) == 200:
            return
        time.sleep(READY_POLL_S)  # nothing to wait on but the port
    raise RuntimeError(f"not ready within {timeout:.0f} s")


def complete(url: str) -> tuple[int | None, str]:
    """One greedy completion of OUTPUT_TOKENS tokens, by the OpenAI route both servers have: (tokens, text)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": OUTPUT_TOKENS, "temperature": 0.0}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    return answer.get("usage", {}).get("completion_tokens"), answer["choices"][0]["text"]


def measure(kind: str, label: str, model: Path, port: int, out_dir: Path, ready_timeout: float) -> StartupResult:
    result = StartupResult(label)
    log_path = out_dir / "logs" / f"{label.replace(' ', '_')}.log"
    spawned = time.monotonic()
    server = start(kind, model, port, log_path, ready_timeout)
    rss = TreeRss(server.process.pid)
    try:
        wait_ready(server, READY_PATHS[kind], ready_timeout)
        result.ready_s = time.monotonic() - spawned
        logger.info("%s: ready in %.1f s (RSS %.2f GB)", label, result.ready_s, rss.now() / GB)
        asked = time.monotonic()
        result.completion_tokens, text = complete(server.url)
        result.completion_s = time.monotonic() - asked
        result.rss_after = rss.now()
        logger.info("%s: %s tokens in %.1f s: %r", label, result.completion_tokens, result.completion_s, text)
    except (RuntimeError, OSError, KeyError, ValueError) as exc:  # it did not start or serve: the others still run
        result.failed = str(exc).splitlines()[0][:200]
        logger.error("%s: %s; its log's end:\n%s", label, result.failed, server.log_tail(2000))
    finally:
        rss.stop()
        result.peak_rss, result.peak_largest = rss.peak, rss.peak_largest
        server.stop()
    return result


def table(results: list[StartupResult], file_size: int) -> str:
    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| server | time to ready (s) | peak RSS, all its processes (GB) | peak RSS, its largest process (GB) | "
             f"RSS after the completion (GB) | file size (GB) | {OUTPUT_TOKENS}-token completion (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        ready = f"failed: {r.failed}" if r.failed and r.ready_s is None else number(r.ready_s, 1)
        lines.append(f"| {r.label} | {ready} | {number(r.peak_rss / GB, 2)} | {number(r.peak_largest / GB, 2)} | "
                     f"{number(None if r.rss_after is None else r.rss_after / GB, 2)} | {file_size / GB:.2f} | "
                     f"{number(r.completion_s, 1)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a GGUF file both servers serve")
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"comma list of {', '.join(SERVERS)}, run "
                                                                     "in this order (a name twice runs twice)")
    parser.add_argument("--port", type=int, default=0, help="the port every server binds in turn (0: a free one "
                                                            "each)")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="s a server has to become ready")
    parser.add_argument("--out-dir", default=str(DEFAULT_OUT_DIR), help="where the servers' logs go")
    args = parser.parse_args(argv)
    kinds = [name.strip() for name in args.servers.split(",") if name.strip()]
    if not kinds or any(kind not in SERVERS for kind in kinds):
        parser.error(f"--servers takes a comma list of {', '.join(SERVERS)}")
    model = Path(args.model).resolve()
    if not model.is_file():
        parser.error(f"no such file: {model}")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in (__name__, "bench.peers", "app.ops.gunicorn_process"):
        logging.getLogger(name).setLevel(logging.INFO)
    results = []
    for index, kind in enumerate(kinds):
        runs = kinds[:index + 1].count(kind)
        label = kind if runs == 1 else f"{kind} (run {runs})"
        results.append(measure(kind, label, model, args.port or free_port(), Path(args.out_dir), args.ready_timeout))
    logger.info("%s: %s\n%s", model, f"{model.stat().st_size / GB:.2f} GB", table(results, model.stat().st_size))


if __name__ == "__main__":
    main()
