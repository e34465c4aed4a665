"""Soak: mixed load on the real gunicorn with a CPU burner on every core, every greedy answer checked.

It looks for what only a busy day shows: a cross-delivered or lost answer, a worker restart, memory that grows.

    python -m tests.harness.soak --minutes 10 --json /tmp/soak.json
    python -m tests.harness.soak --minutes 1 --long-tokens 1500         # the short mode the test suite runs

The server runs with LOCKSTEP_WEIGHTS=exact, where a greedy answer does not depend on the batch it shared or the
cached prefix it resumed from, so every answer must equal its prompt's answer taken alone. The load and the
report: docs/robustness.md.
"""
import argparse
import itertools
import json
import logging
import random
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.ops.gunicorn_process import ServerUnderTest, start_gunicorn

from . import load
from .fuzz import Findings, RestartBaseline, run_case, worker_restarts
from .fuzzcases import make_case
from .load import (CHAT_REFERENCE, CHECKED_CLIENT_ADDRESS, REFERENCE_PROMPTS, RESPONSES_PROMPTS, CheckedTraffic,
                   CpuBurner, HealthProbe, Loop, References, check_rest_answer, close_quietly, greedy_params, ms,
                   post_json, responses_rest_conversation, responses_socket_conversation, take_references,
                   take_responses_references, texts_and_finals, ws_connect, ws_read_until)

logger = logging.getLogger("tests.harness.soak")

LONG_MAX_TOKENS = 4
RSS_TOLERANCE = 0.10  # end RSS within 10% of the warmed-up start
RSS_SLACK_MB = 40.0  # allocator noise on small processes
SAMPLE_EVERY_S = 5.0


@dataclass
class SoakConfig:
    minutes: float = 10.0
    long_tokens: int = 7500
    long_every_s: float = 120.0
    streamers: int = 2
    odd_pause_s: float = 0.1
    seed: int = 7
    burn: bool = True


@dataclass
class Samples:
    """RSS / threads / fds of both processes every few seconds."""
    rows: list = field(default_factory=list)

    def take(self, server: ServerUnderTest) -> None:
        self.rows.append({"t": round(time.monotonic(), 1), **server.snapshot().as_dict()})

    def peak_rss(self, role: str) -> float | None:
        values = [row[role]["rss_mb"] for row in self.rows if row[role]["rss_mb"] is not None]
        return max(values, default=None)


class Soak:
    def __init__(self, server: ServerUnderTest, config: SoakConfig):
        self.server, self.config = server, config
        self.stop = threading.Event()
        self.traffic = CheckedTraffic()
        self.odd = Findings()
        self.samples = Samples()
        self.counter = itertools.count()
        self.rng_lock = threading.Lock()
        self.rng = random.Random(config.seed)
        self.refs: References | None = None
        self.long_prompt = ""
        self.long_reference = ""
        self.events = {"cancelled": 0, "abrupt_disconnects": 0, "long_prompts": 0}

    # -- set-up ---------------------------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """References alone (short prompts, chat, Responses turns, the long prompt), before any load."""
        self.refs = take_references(self.server.host, self.server.port)
        take_responses_references(self.server.host, self.server.port, self.refs)
        if self.config.long_tokens:
            self.long_prompt = self._long_prompt(self.config.long_tokens)
            outcome = post_json(self.server.host, self.server.port, "/basic_generate",
                                {"prompt": self.long_prompt, **greedy_params(LONG_MAX_TOKENS)}, timeout=600)
            if outcome.status != 200:
                raise RuntimeError(f"the long prompt alone failed: {outcome.status} {outcome.body[:300]!r}")
            self.long_reference = outcome.json()["generated_text"]

    def _long_prompt(self, tokens: int) -> str:
        """A prose-like prompt of about `tokens` tokens, sized with the server's own /tokenize."""
        sentence = "The quick brown fox jumps over the lazy dog near the quiet river bank. "
        count = self._token_count(sentence * 10) / 10
        prompt = sentence * max(1, int(tokens / count))
        return prompt + "In one word, the animal that jumps is the"

    def _token_count(self, text: str) -> int:
        outcome = post_json(self.server.host, self.server.port, "/tokenize", {"prompt": text})
        return outcome.json()["count"]

    # -- one round of each kind of load -----------------------------------------------------------------------------

    def _pick(self, k: int, prompts=REFERENCE_PROMPTS) -> list[str]:
        with self.rng_lock:
            return self.rng.sample(prompts, k)

    def _roll(self) -> float:
        with self.rng_lock:
            return self.rng.random()

    def stream_round(self) -> None:
        prompts = self._pick(3)
        roll = self._roll()
        mode = "cancel" if roll < 0.25 else "drop" if roll < 0.4 else "collect"
        tag = f"s{next(self.counter)}"
        ids = {f"{tag}-{i}": p for i, p in enumerate(prompts)}
        ws = ws_connect(self.server.ws_url, timeout=300, source=CHECKED_CLIENT_ADDRESS)
        try:
            started = time.perf_counter()
            for request_id, prompt in ids.items():
                ws.send(json.dumps({"type": "generate", "id": request_id, "prompt": prompt, **greedy_params()}))
            if mode == "drop":
                self._drop_after_first_delta(ws)
                return
            victim = f"{tag}-0" if mode == "cancel" else None
            self._collect(ws, ids, victim, started)
        finally:
            close_quietly(ws)

    def _drop_after_first_delta(self, ws) -> None:
        """Vanish without a close frame: RST (linger 0) or a plain FIN, chosen at random."""
        ws_read_until(ws, lambda m: m.get("type") == "delta", 120)
        if self._roll() < 0.5:
            ws.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        ws.sock.close()
        self.events["abrupt_disconnects"] += 1

    def _collect(self, ws, ids: dict, victim: str | None, started: float) -> None:
        pending = set(ids)
        cancel_sent = False

        def on_message(message: dict) -> bool:
            nonlocal cancel_sent
            if victim and not cancel_sent and message.get("type") == "delta" and message.get("id") == victim:
                ws.send(json.dumps({"type": "cancel", "id": victim}))
                cancel_sent = True
            if message.get("type") in ("done", "error"):
                pending.discard(message.get("id"))
            return not pending

        result = ws_read_until(ws, on_message, 300)
        self._judge_streams(result, ids, victim, started)

    def _judge_streams(self, result, ids: dict, victim: str | None, started: float) -> None:
        texts, finals = texts_and_finals(result, ids, self.traffic)
        for request_id, prompt in ids.items():
            final = finals.get(request_id)
            if final is None:
                self.traffic.record_failure("ws", f"lost: no done for {request_id} (socket {result.ended})")
            elif final["type"] == "error":
                self.traffic.record_failure("ws", f"error {final.get('code')}: {final.get('message', '')[:200]}")
            elif request_id == victim and final.get("finish_reason") == "abort":
                self._judge_cancelled(prompt, texts[request_id])
            else:
                self.traffic.record_answer("ws", self.refs.verdict(prompt, texts[request_id]),
                                           time.perf_counter() - started, f"{prompt!r} got {texts[request_id]!r}")

    def _judge_cancelled(self, prompt: str, text: str) -> None:
        self.events["cancelled"] += 1
        if self.refs.by_prompt[prompt].startswith(text):
            self.traffic.record_ok("ws_cancelled", None)
        elif self.refs.exact:
            self.traffic.record_failure("ws_cancelled", f"mismatch: partial {text!r} is not a prefix of "
                                                        f"{self.refs.by_prompt[prompt]!r}")

    def basic_round(self) -> None:
        prompt = self._pick(1)[0]
        outcome = post_json(self.server.host, self.server.port, "/basic_generate",
                            {"prompt": prompt, **greedy_params()}, timeout=300)
        check_rest_answer(self.traffic, self.refs, "basic_generate", prompt, outcome)

    def batch_round(self) -> None:
        prompts = self._pick(4)
        outcome = post_json(self.server.host, self.server.port, "/generate", {"prompts": prompts, **greedy_params()},
                            timeout=300)
        if outcome.status != 200:
            self.traffic.record_failure("generate", f"status {outcome.status or outcome.failure}: "
                                                    f"{outcome.body[:200]!r}")
            return
        for prompt, text in zip(prompts, outcome.json()["generated_texts"]):
            self.traffic.record_answer("generate", self.refs.verdict(prompt, text), outcome.elapsed_s,
                                       f"{prompt!r} got {text!r}")

    def chat_round(self) -> None:
        outcome = post_json(self.server.host, self.server.port, "/v1/chat/completions",
                            {"messages": CHAT_REFERENCE, **greedy_params()}, timeout=300)
        if outcome.status != 200:
            self.traffic.record_failure("chat", f"status {outcome.status or outcome.failure}: {outcome.body[:200]!r}")
            return
        text = outcome.json()["choices"][0]["message"]["content"]
        verdict = self.refs.verdict("chat", text, {"chat": self.refs.chat})
        self.traffic.record_answer("chat", verdict, outcome.elapsed_s, f"chat got {text!r}")

    def responses_round(self) -> None:
        responses_rest_conversation(self.server.host, self.server.port, self._pick(1, RESPONSES_PROMPTS)[0],
                                    self.refs, self.traffic)

    def responses_socket_round(self) -> None:
        responses_socket_conversation(self.server.ws_url, self._pick(2, RESPONSES_PROMPTS), self.refs, self.traffic)

    def long_round(self) -> None:
        self.events["long_prompts"] += 1
        outcome = post_json(self.server.host, self.server.port, "/basic_generate",
                            {"prompt": self.long_prompt, **greedy_params(LONG_MAX_TOKENS)}, timeout=600)
        if outcome.status != 200:
            self.traffic.record_failure("long", f"status {outcome.status or outcome.failure}: {outcome.body[:200]!r}")
            return
        text = outcome.json()["generated_text"]
        verdict = "ok" if text == self.long_reference else "mismatch" if self.refs.exact else "drift"
        self.traffic.record_answer("long", verdict, outcome.elapsed_s, f"long prompt got {text!r}")

    def odd_round(self) -> None:
        index = next(self.counter)
        case = make_case(self.config.seed, index)
        self.odd.add(index, case, run_case(self.server, case))

    # -- the run -------------------------------------------------------------------------------------------------------

    def loops(self) -> list[Loop]:
        loops = [Loop(f"stream-{i}", self.stream_round, self.stop, 0.1) for i in range(self.config.streamers)]
        loops += [Loop("basic", self.basic_round, self.stop, 0.2), Loop("batch", self.batch_round, self.stop, 0.5),
                  Loop("chat", self.chat_round, self.stop, 0.5), Loop("odd", self.odd_round, self.stop,
                                                                       self.config.odd_pause_s),
                  Loop("responses", self.responses_round, self.stop, 0.5),
                  Loop("responses-ws", self.responses_socket_round, self.stop, 0.2),
                  Loop("sampler", lambda: self.samples.take(self.server), self.stop, SAMPLE_EVERY_S)]
        if self.config.long_tokens:
            loops.append(Loop("long", self.long_round, self.stop, self.config.long_every_s))
        return loops

    def run(self) -> dict:
        restarts_before = RestartBaseline.of(self.server)
        self.warm_up()
        start = self.server.snapshot()
        health = HealthProbe(self.server.host, self.server.port, self.stop, interval_s=0.5)
        loops = self.loops() + [health.loop]
        started = time.monotonic()
        with CpuBurner() if self.config.burn else _Nothing():
            for loop in loops:
                loop.start()
            self.stop.wait(self.config.minutes * 60)
            self.stop.set()
            for loop in loops:
                loop.join(600)
        end = self.server.snapshot()
        for loop in loops:
            if loop.crash is not None:
                self.traffic.record_failure(loop.name, f"checker crashed: {loop.crash!r}")
        return self.report(time.monotonic() - started, restarts_before, start, end, health)

    def report(self, elapsed: float, restarts_before: RestartBaseline, start, end, health: HealthProbe) -> dict:
        kinds = self.traffic.failure_kinds()
        start_d, end_d = start.as_dict(), end.as_dict()
        return {
            "minutes": round(elapsed / 60, 2), "cpu_burner": self.config.burn, "config": self.config.__dict__,
            "requests_ok": dict(self.traffic.done), "requests_ok_total": sum(self.traffic.done.values()),
            "errors_by_kind": dict(kinds),
            "cross_delivered": sum(n for k, n in kinds.items() if k.endswith("cross_delivered")),
            "lost": sum(n for k, n in kinds.items() if k.endswith("lost")),
            "mismatched": sum(n for k, n in kinds.items() if k.endswith("mismatch")),
            "failed_well_formed": len(self.traffic.failures), "failures": self.traffic.failures[:30],
            "exact_check": self.refs.exact, "bf16_drift": dict(self.traffic.drift),
            "worker": worker_restarts(self.server, restarts_before), "events": self.events,
            "latency": self.traffic.latency_summary(),
            "max_inter_token_gap_ms": ms(self.traffic.max_inter_token_gap_s), "health": health.summary(),
            "odd_inputs": {"cases": sum(self.odd.cases.values()), "http_5xx": self.odd.http_5xx,
                           "ws_closed_without_code": self.odd.closed_without_code,
                           "problems": {f"{k} {t}": n for (k, t), n in self.odd.problems.most_common(15)}},
            "processes": {"start": start_d, "end": end_d,
                          "peak_rss_mb": {role: self.samples.peak_rss(role) for role in start_d}},
            "rss_flat": {role: rss_is_flat(start_d[role]["rss_mb"], end_d[role]["rss_mb"]) for role in start_d},
        }


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def rss_is_flat(start_mb: float | None, end_mb: float | None) -> bool:
    if start_mb is None or end_mb is None:
        return False
    return end_mb <= start_mb * (1 + RSS_TOLERANCE) + RSS_SLACK_MB


# -- output -------------------------------------------------------------------------------------------------------

def format_table(result: dict) -> str:
    start, end = result["processes"]["start"], result["processes"]["end"]
    rows = [
        ("minutes (CPU burner on every core)", f"{result['minutes']} ({result['cpu_burner']})"),
        ("requests ok", f"{result['requests_ok_total']}  {result['requests_ok']}"),
        ("errors by kind", result["errors_by_kind"] or "none"),
        ("cross-delivered / lost / mismatched (0)", f"{result['cross_delivered']} / {result['lost']} / "
                                                    f"{result['mismatched']}"),
        ("failed well-formed requests (0)", result["failed_well_formed"]),
        ("model worker restarts (0)", f"{result['worker']['restarts']}  [{result['worker']['source']}]"),
        ("cancels / abrupt disconnects / long prompts", f"{result['events']['cancelled']} / "
                                                        f"{result['events']['abrupt_disconnects']} / "
                                                        f"{result['events']['long_prompts']}"),
        ("longest inter-token gap ms", result["max_inter_token_gap_ms"]),
        ("/health p50 / p99 / max ms", f"{result['health']['p50_ms']} / {result['health']['p99_ms']} / "
                                       f"{result['health']['max_ms']}"),
        ("odd inputs: cases / 5xx / closed without code", f"{result['odd_inputs']['cases']} / "
                                                           f"{result['odd_inputs']['http_5xx']} / "
                                                           f"{result['odd_inputs']['ws_closed_without_code']}"),
    ]
    rows += [(f"latency {kind} p50 / p99 ms (n)", f"{v['p50_ms']} / {v['p99_ms']} ({v['n']})")
             for kind, v in result["latency"].items()]
    for role in ("http_worker", "model_worker"):
        s, e = start[role], end[role]
        rows.append((f"{role} RSS MB / threads / fds", f"{s['rss_mb']} / {s['threads']} / {s['fds']}  ->  "
                                                       f"{e['rss_mb']} / {e['threads']} / {e['fds']}  (peak "
                                                       f"{result['processes']['peak_rss_mb'][role]}, flat: "
                                                       f"{result['rss_flat'][role]})"))
    return "soak\n" + "\n".join(f"  {name:<46} {value}" for name, value in rows)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--long-tokens", type=int, default=7500, help="size of the long prompt (0: none)")
    parser.add_argument("--long-every-s", type=float, default=120.0)
    parser.add_argument("--streamers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-burn", action="store_true", help="no CPU burner")
    parser.add_argument("--weights", default="exact", help="LOCKSTEP_WEIGHTS of the server")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/lockstep-soak"))
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def run_soak(config: SoakConfig, log_dir: Path, weights: str = "exact", env: dict | None = None) -> dict:
    server = start_gunicorn(log_dir / "gunicorn.log", {"LOCKSTEP_WEIGHTS": weights, **(env or {})})
    try:
        server.wait_ready()
        result = Soak(server, config).run()
    finally:
        server.stop()
    result["server_log"] = str(log_dir / "gunicorn.log")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger(load.__name__).setLevel(logging.ERROR)
    config = SoakConfig(args.minutes, args.long_tokens, args.long_every_s, args.streamers, seed=args.seed,
                        burn=not args.no_burn)
    result = run_soak(config, args.log_dir, args.weights)
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
