"""gunicorn settings for lockstep (`gunicorn -c gunicorn.conf.py wsgi:app`).

gthread workers (app/ops/gunicorn_worker.py adds read deadlines and JSON error replies). Every
open WebSocket holds one thread for its whole life; gthread creates threads lazily, so the
thread budget is set far above the socket cap (LOCKSTEP_MAX_SOCKETS): REST calls, /health
and /ready always find a thread. Each gunicorn worker builds its own engine when it imports
wsgi.py: never in the master, so no `preload_app`. The engine starts a fork server (a fresh
Python, engine/fork_server.py) that forks the model worker: the gunicorn worker's threads
never meet a fork.
SIGTERM drains: the worker keeps accepting but answers new requests 503, running ones
finish (up to LOCKSTEP_DRAIN_TIMEOUT_S; past it they end with a 503 `shutting_down` their
clients read), then gunicorn's own graceful stop runs.
"""
import logging
import os
import resource
import signal
import threading

from app import settings_from_env
from app.ops.gunicorn_worker import FD_RESERVE, MAX_LINGERING

SETTINGS = settings_from_env()  # the LOCKSTEP_* variables, read as the app reads them (app/settings.py)
bind = f"{SETTINGS.host}:{SETTINGS.port}"
workers = SETTINGS.workers  # one model copy each
worker_class = "app.ops.gunicorn_worker.LockstepWorker"
threads = SETTINGS.http_threads
worker_connections = max(1000, 2 * threads)  # room for kept-alive connections beside busy threads
SPARE_THREADS = 32  # REST calls, /health and /ready must find a thread with every socket open
timeout = 120  # the worker heartbeat; WebSocket threads keep it alive, long generations are fine
graceful_timeout = int(SETTINGS.drain_timeout_s) + 10  # the master waits this long after the drain started
keepalive = 5
preload_app = False
# One control socket path per user is shared by every gunicorn; two servers (or a test beside `make serve`) collide.
control_socket_disable = True
accesslog = "-"
# The path without its query string and no Referer: either may carry an API key (never log a secret).
access_log_format = '%(h)s %(t)s "%(m)s %(U)s %(H)s" %(s)s %(b)s %(D)sus "%(a)s"'
loglevel = SETTINGS.log_level
# gunicorn configures only its own loggers; lockstep's (app.*, engine.*) log through the root logger.
logging.basicConfig(level=loglevel.upper(), format="%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s")


def raise_open_file_limit(wanted: int) -> None:
    """systemd gives a service 1024 descriptors (its soft limit): past them accept() fails (EMFILE) and the
    worker dies, its model with it. Raised toward the hard limit for every connection, thread and lingering close
    (the workers inherit it); where the hard limit is lower, said at start."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    raised = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    if raised < wanted:
        logging.getLogger("lockstep.config").warning(
            "the open-file limit %d (hard) is below the %d descriptors %d connections and %d threads may need: "
            "raise it (LimitNOFILE=, ulimit -n) or lower LOCKSTEP_HTTP_THREADS", hard, wanted, worker_connections,
            threads)


raise_open_file_limit(worker_connections + threads + MAX_LINGERING + FD_RESERVE)
if SETTINGS.max_sockets > threads - SPARE_THREADS:
    logging.getLogger("lockstep.config").warning(
        "LOCKSTEP_MAX_SOCKETS=%d leaves fewer than %d of LOCKSTEP_HTTP_THREADS=%d for REST and probes",
        SETTINGS.max_sockets, SPARE_THREADS, threads)


MALLOC_ARENAS = 2


def post_fork(server, worker):
    """Two malloc arenas instead of 8 per core: request threads tokenizing big prompts otherwise each keep
    a private high-water mark (measured, 5 bursts of 32 long /tokenize calls: RSS after them 534-579 MB with
    glibc's default, 407-419 MB flat with 2). Blocks from 4 MiB on unmapped when freed (engine/memory.py).
    The fork server is a new program, which no mallopt reaches: glibc reads its cap from the environment (the
    model worker forked from it gets the same cap as when it was forked from here)."""
    from engine.memory import limit_malloc_arenas, unmap_large_blocks_when_freed  # per process: in each worker

    limit_malloc_arenas(MALLOC_ARENAS)
    os.environ.setdefault("MALLOC_ARENA_MAX", str(MALLOC_ARENAS))
    unmap_large_blocks_when_freed()


def _state(worker):
    return getattr(worker, "app_state", None)  # None until the worker has loaded the app


def post_worker_init(worker):
    """SIGTERM starts the drain at once and hands over to gunicorn's own stop once the engine is idle."""
    gunicorn_stop = signal.getsignal(signal.SIGTERM)
    started = threading.Event()  # the master forwards a process-group SIGTERM a second time

    def drain_then_stop(signum, frame):
        state = _state(worker)
        if state is None:
            gunicorn_stop(signum, frame)
            return
        state.begin_drain()
        if not started.is_set():
            started.set()
            threading.Thread(target=_stop_when_idle, args=(state, gunicorn_stop, signum), name="lockstep-drain",
                             daemon=True).start()

    signal.signal(signal.SIGTERM, drain_then_stop)


def _stop_when_idle(state, gunicorn_stop, signum):
    try:
        if not state.engine.wait_idle(state.settings.drain_timeout_s):
            # Ended here, each with an error its client reads (503 shutting_down), so that their sockets close
            # cleanly before gunicorn's graceful timeout would cut them off mid-stream. The model worker stops
            # later, in worker_exit.
            logging.getLogger("lockstep.drain").warning("drain timeout: ending the requests still running")
            state.engine.end_running()
    finally:
        gunicorn_stop(signum, None)


def worker_exit(server, worker):
    state = _state(worker)
    if state is not None:
        state.shutdown()
