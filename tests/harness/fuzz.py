"""Fuzz a lockstep server from outside while well-formed traffic runs beside it and is checked.

A hostile client must get a documented error, never a 5xx or a silent socket, and must not disturb the answers of
the well-formed clients beside it.

    python -m tests.harness.fuzz --cases 10000 --json /tmp/fuzz.json        # starts its own gunicorn (weights=exact)
    python -m tests.harness.fuzz --url http://127.0.0.1:8311 --cases 10000  # a server that is already running

Cases come from fuzzcases (seeded; one case alone with --only N). Loopback only; bounded by --cases and
--max-seconds. What is generated and what counts as a problem: docs/robustness.md.
"""
import argparse
import json
import re
import logging
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from app.ops.gunicorn_process import ServerUnderTest, start_gunicorn

from . import load
from .fuzzcases import RestCase, WsSession, make_case
from .fuzzexec import PROTOCOLS, CaseResult, run_raw, run_rest, run_ws
from .load import (REFERENCE_PROMPTS, CheckedTraffic, HealthProbe, Loop, References, check_rest_answer,
                   greedy_params, http_call, post_json, stream_greedy, take_references)

logger = logging.getLogger("tests.harness.fuzz")

EXAMPLES_PER_PROBLEM = 3
MINIMIZE_AT_MOST = 40
SOCKET_SURFACES = {protocol.surface for protocol in PROTOCOLS.values()}
PROGRESS_EVERY = 1000  # problem signatures minimized after the run


@dataclass
class Findings:
    """Everything the cases showed, aggregated (thread-safe)."""
    cases: Counter = field(default_factory=Counter)  # by surface
    observed: dict = field(default_factory=lambda: defaultdict(Counter))  # surface -> outcome -> count
    ws_error_codes: Counter = field(default_factory=Counter)
    problems: Counter = field(default_factory=Counter)  # (kind, target) -> count
    examples: dict = field(default_factory=lambda: defaultdict(list))  # (kind, target) -> [(index, desc, detail)]
    failing_cases: dict = field(default_factory=dict)  # (kind, target) -> (index, case)
    http_5xx: int = 0
    closed_without_code: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, index: int, case, result: CaseResult) -> None:
        with self.lock:
            self.cases[result.surface] += 1
            self.observed[result.surface][result.observed] += 1
            self.ws_error_codes.update(result.error_codes)
            self.http_5xx += result.is_5xx
            self.closed_without_code += result.closed_without_code
            for kind, detail in result.problems:
                target = result.target if result.surface not in SOCKET_SURFACES else _detail_class(detail)
                self._add_problem((kind, target), index, case, result.description, detail)

    def _add_problem(self, signature, index, case, description, detail) -> None:
        self.problems[signature] += 1
        if len(self.examples[signature]) < EXAMPLES_PER_PROBLEM:
            self.examples[signature].append({"case": index, "request": description[:600], "observed": detail})
        self.failing_cases.setdefault(signature, (index, case))


def _detail_class(detail: str) -> str:
    """WS sessions mix frames: group their problems by what was observed, not by the mix."""
    return re.sub(r"\d+|'[^']*'", "#", detail)[:60]


def run_case(server: ServerUnderTest, case) -> CaseResult:
    if isinstance(case, RestCase):
        return run_rest(server.host, server.port, case)
    if isinstance(case, WsSession):
        return run_ws(server.ws_url, case)
    return run_raw(server.host, server.port, case)


def run_cases(server: ServerUnderTest, seed: int, count: int, concurrency: int, deadline: float,
              indices=None) -> Findings:
    """Run cases `0..count-1` (or `indices`) on `concurrency` threads until done or `deadline` passes."""
    findings = Findings()
    todo = iter(indices if indices is not None else range(count))
    lock = threading.Lock()

    def worker():
        while time.monotonic() < deadline:
            with lock:
                index = next(todo, None)
            if index is None:
                return
            case = make_case(seed, index)
            findings.add(index, case, run_case(server, case))
            if index and index % PROGRESS_EVERY == 0:
                logger.info("%d cases run; %d HTTP 5xx, %d problem kinds so far", index, findings.http_5xx,
                            len(findings.problems))

    threads = [threading.Thread(target=worker, name=f"fuzz-{i}", daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return findings


# -- minimizing ---------------------------------------------------------------------------------------------------

def minimize(server: ServerUnderTest, findings: Findings) -> dict:
    """For each problem, the smallest replay that still shows it: one mutation (REST) or one frame (WS)."""
    minimized = {}
    for signature, (index, case) in list(findings.failing_cases.items())[:MINIMIZE_AT_MOST]:
        minimized[signature] = _minimize_one(server, signature[0], index, case)
    return minimized


def _minimize_one(server: ServerUnderTest, kind: str, index: int, case) -> str:
    for candidate in _smaller_cases(case):
        result = run_case(server, candidate)
        if any(k == kind for k, _ in result.problems):
            return f"{result.description} -> {result.observed}"
    return f"did not reproduce on replay (case {index}: --only {index} with the same --seed)"


def _smaller_cases(case):
    if isinstance(case, RestCase) and len(case.mutations) > 1:
        for mutation in case.mutations:
            yield RestCase(case.method, case.path, case.base, [mutation], case.raw_body, case.content_type,
                           case.ascii_only)
    elif isinstance(case, WsSession) and len(case.frames) > 1:
        for frame in case.frames:
            yield WsSession([frame], case.protocol)
    yield case


# -- the run ------------------------------------------------------------------------------------------------------

@dataclass
class BesideLoad:
    """Well-formed traffic that must keep working while the fuzz runs."""
    server: ServerUnderTest
    refs: References
    stop: threading.Event = field(default_factory=threading.Event)
    traffic: CheckedTraffic = field(default_factory=CheckedTraffic)
    loops: list = field(default_factory=list)
    health: HealthProbe | None = None

    def start(self) -> "BesideLoad":
        self.health = HealthProbe(self.server.host, self.server.port, self.stop)
        rounds = iter(range(10**9))
        prompts = list(REFERENCE_PROMPTS)

        def stream_round():
            n = next(rounds)
            stream_greedy(self.server.ws_url, [prompts[n % len(prompts)], prompts[(n + 3) % len(prompts)]],
                          self.refs, self.traffic, f"s{n}")

        def rest_round():
            n = next(rounds)
            prompt = prompts[n % len(prompts)]
            check_rest_answer(self.traffic, self.refs, "rest", prompt, post_json(
                self.server.host, self.server.port, "/basic_generate", {"prompt": prompt, **greedy_params()}))

        self.loops = [Loop("beside-stream", stream_round, self.stop, 0.2),
                      Loop("beside-rest", rest_round, self.stop, 0.2), self.health.loop]
        for loop in self.loops:
            loop.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for loop in self.loops:
            loop.join(200)
        for loop in self.loops:
            if loop.crash is not None:
                self.traffic.record_failure(loop.name, f"checker crashed: {loop.crash!r}")


def fuzz(server: ServerUnderTest, cases: int, seed: int, concurrency: int, max_seconds: float,
         do_minimize: bool = True) -> dict:
    """The whole campaign against a ready server; returns the report (a JSON-able dict)."""
    restarts_before = RestartBaseline.of(server)
    log_start = server.log_size()
    server.start_watching()
    before = server.snapshot()
    refs = take_references(server.host, server.port)
    beside = BesideLoad(server, refs).start()
    started = time.monotonic()
    findings = run_cases(server, seed, cases, concurrency, started + max_seconds)
    elapsed = time.monotonic() - started
    beside.finish()
    after = server.snapshot()
    server.stop_watching()
    tracebacks = server.log_tracebacks(log_start)  # before minimizing replays more cases
    minimized = minimize(server, findings) if do_minimize else {}
    result = report(server, findings, beside, before, after, restarts_before, elapsed, minimized, seed)
    result["server_log_tracebacks"] = tracebacks
    return result


@dataclass
class RestartBaseline:
    """Restart counts at the start of a run, from every source the server offers."""
    metric: float | None
    forks: int | None

    @classmethod
    def of(cls, server: ServerUnderTest) -> "RestartBaseline":
        return cls(server.restart_metric(), server.fork_count())


def worker_restarts(server: ServerUnderTest, baseline: RestartBaseline) -> dict:
    """Restarts during the run: the worker_restarts metric; the log's fork lines; else model worker pid changes."""
    counts = {}
    metric = server.restart_metric()
    if baseline.metric is not None and metric is not None:
        counts["metric lockstep:worker_restarts_total"] = int(metric - baseline.metric)
    forks = server.fork_count()
    if baseline.forks is not None and forks is not None:
        counts["'forked model worker' lines in the server log"] = forks - baseline.forks
    if not counts:
        counts["model worker pid changes (sampled every 0.5 s)"] = max(0, server.pids_seen() - 1)
    return {"restarts": max(counts.values()), "source": ", ".join(f"{k}: {v}" for k, v in counts.items())}


def report(server, findings: Findings, beside: BesideLoad, before, after, restarts_before: RestartBaseline, elapsed,
           minimized, seed) -> dict:
    traffic = beside.traffic
    return {
        "seed": seed, "elapsed_s": round(elapsed, 1), "cases": dict(findings.cases),
        "cases_total": sum(findings.cases.values()),
        "observed": {surface: dict(counter.most_common()) for surface, counter in findings.observed.items()},
        "ws_error_codes": dict(findings.ws_error_codes.most_common()),
        "http_5xx": findings.http_5xx, "ws_closed_without_code": findings.closed_without_code,
        "worker": worker_restarts(server, restarts_before),
        "well_formed": {"ok": dict(traffic.done), "failed": len(traffic.failures), "exact_check": beside.refs.exact,
                        "bf16_drift": dict(traffic.drift),
                        "failures": traffic.failures[:20]},
        "health": beside.health.summary(),
        "processes": {"before": before.as_dict(), "after": after.as_dict()},
        "problems": [{"kind": kind, "target": target, "count": count,
                      "examples": findings.examples[(kind, target)],
                      "minimized": minimized.get((kind, target))}
                     for (kind, target), count in findings.problems.most_common()],
    }


# -- output -------------------------------------------------------------------------------------------------------

def format_table(result: dict) -> str:
    lines = [f"fuzz: {result['cases_total']} cases in {result['elapsed_s']} s (seed {result['seed']})", ""]
    for surface, observed in result["observed"].items():
        shown = ", ".join(f"{k}: {v}" for k, v in list(observed.items())[:12])
        lines.append(f"  {surface:<5} {result['cases'][surface]:>6} cases   {shown}")
    before, after = result["processes"]["before"], result["processes"]["after"]
    health = result["health"]
    rows = [
        ("HTTP 5xx (target 0)", result["http_5xx"]),
        ("sockets closed without a close code (0)", result["ws_closed_without_code"]),
        ("model worker restarts (0)", f"{result['worker']['restarts']}  [{result['worker']['source']}]"),
        ("failed well-formed requests (0)", _well_formed_cell(result["well_formed"])),
        ("/health p50 / p95 / p99 / max ms (p99 < 100)", f"{health['p50_ms']} / {health['p95_ms']} / "
                                                         f"{health['p99_ms']} / {health['max_ms']}  "
                                                         f"({health['probes']} probes, {health['over_100ms']} over "
                                                         f"100 ms, failures {health['failures']})"),
    ]
    for role in ("http_worker", "model_worker"):
        b, a = before[role], after[role]
        rows.append((f"{role} RSS MB / threads / fds", f"{b['rss_mb']} / {b['threads']} / {b['fds']}  ->  "
                                                       f"{a['rss_mb']} / {a['threads']} / {a['fds']}"
                                                       f"  (pid {b['pid']} -> {a['pid']})"))
    lines += [""] + [f"  {name:<42} {value}" for name, value in rows]
    tracebacks = result.get("server_log_tracebacks") or {}
    lines += ["", f"  server log: {sum(t['count'] for t in tracebacks.values())} exceptions with a traceback"]
    lines += [f"    {t['count']:>5}  {t['example'][:110]}"
              for t in sorted(tracebacks.values(), key=lambda t: -t["count"])]
    if result["problems"]:
        lines += ["", "  problems (kind, target: count):"]
        lines += [f"    {p['kind']:<28} {p['target'][:40]:<40} {p['count']:>5}" for p in result["problems"]]
    return "\n".join(lines)


def _well_formed_cell(well_formed: dict) -> str:
    drift = "" if well_formed["exact_check"] else f", bf16 drift (not counted): {well_formed['bf16_drift']}"
    return f"{well_formed['failed']} (ok: {well_formed['ok']}{drift})"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start gunicorn on a free loopback port)")
    parser.add_argument("--cases", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", type=int, nargs="*", help="run only these case numbers (replay)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-seconds", type=float, default=1800)
    parser.add_argument("--weights", default="exact",
                        help="LOCKSTEP_WEIGHTS of the server we start (exact: float32, exact greedy checks, the "
                             "prefix cache on)")
    parser.add_argument("--server-log", type=Path, help="log of a --url server, to count worker forks")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/lockstep-fuzz"))
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--no-minimize", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger(load.__name__).setLevel(logging.ERROR)  # failures are in the report
    server = _server_for(args)
    try:
        server.wait_ready()
        if args.only:
            return _replay(server, args)
        result = fuzz(server, args.cases, args.seed, args.concurrency, args.max_seconds, not args.no_minimize)
        result["server"] = {"url": server.url, "started_here": server.process is not None,
                            "model": _model_card(server)}
    finally:
        server.stop()
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


def _server_for(args) -> ServerUnderTest:
    if args.url:
        return ServerUnderTest(args.url, args.server_log)
    return start_gunicorn(args.log_dir / "gunicorn.log", {"LOCKSTEP_WEIGHTS": args.weights,
                                                         "LOCKSTEP_DEFAULT_MAX_TOKENS": "8"})


def _model_card(server: ServerUnderTest) -> dict:
    outcome = http_call(server.host, server.port, "GET", "/v1/models", timeout=10)
    data = (outcome.json() or {}).get("data") or [{}]
    return {k: data[0].get(k) for k in ("id", "backend", "dtype", "max_batch_size", "policy")}


def _replay(server: ServerUnderTest, args) -> int:
    for index in args.only:
        case = make_case(args.seed, index)
        result = run_case(server, case)
        print(f"case {index}: {result.description}\n  -> {result.observed} {result.problems}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
