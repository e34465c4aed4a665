"""gunicorn settings for lockstep (`gunicorn -c gunicorn.conf.py wsgi:app`).

gthread workers (app/gunicorn_worker.py adds read deadlines and JSON error replies). Every
open WebSocket holds one thread for its whole life; gthread creates threads lazily, so the
thread budget is set far above the socket cap (LOCKSTEP_MAX_SOCKETS): REST calls, /health
and /ready always find a thread. Each gunicorn worker builds its own engine (and forks its
own model worker) when it imports wsgi.py: never in the master, so no `preload_app`.
SIGTERM drains: the worker keeps accepting but answers new requests 503, running ones
finish (up to LOCKSTEP_DRAIN_TIMEOUT_S), then gunicorn's own graceful stop runs.
"""
import logging
import os
import signal
import threading

bind = f"{os.environ.get('LOCKSTEP_HOST', '127.0.0.1')}:{os.environ.get('LOCKSTEP_PORT', '8000')}"
workers = int(os.environ.get("LOCKSTEP_WORKERS", "1"))  # one model copy each
worker_class = "app.gunicorn_worker.LockstepWorker"
threads = int(os.environ.get("LOCKSTEP_HTTP_THREADS", "1024"))
worker_connections = max(1000, 2 * threads)  # room for kept-alive connections beside busy threads
MAX_SOCKETS = int(os.environ.get("LOCKSTEP_MAX_SOCKETS", "256"))
SPARE_THREADS = 32  # REST calls, /health and /ready must find a thread with every socket open
timeout = 120  # the worker heartbeat; WebSocket threads keep it alive, long generations are fine
DRAIN_TIMEOUT_S = float(os.environ.get("LOCKSTEP_DRAIN_TIMEOUT_S", "30"))
graceful_timeout = int(DRAIN_TIMEOUT_S) + 10  # the master waits this long after the drain started
keepalive = 5
preload_app = False
# One control socket path per user is shared by every gunicorn; two servers (or a test beside `make serve`) collide.
control_socket_disable = True
accesslog = "-"
# The path without its query string and no Referer: either may carry an API key (never log a secret).
access_log_format = '%(h)s %(t)s "%(m)s %(U)s %(H)s" %(s)s %(b)s %(D)sus "%(a)s"'
loglevel = os.environ.get("LOCKSTEP_LOG_LEVEL", "info")
# gunicorn configures only its own loggers; lockstep's (app.*, engine.*) log through the root logger.
logging.basicConfig(level=loglevel.upper(), format="%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s")
if MAX_SOCKETS > threads - SPARE_THREADS:
    logging.getLogger("lockstep.config").warning(
        "LOCKSTEP_MAX_SOCKETS=%d leaves fewer than %d of LOCKSTEP_HTTP_THREADS=%d for REST and probes",
        MAX_SOCKETS, SPARE_THREADS, threads)


def post_fork(server, worker):
    """Two malloc arenas instead of 8 per core: request threads tokenizing big prompts otherwise each keep
    a private high-water mark (measured, 5 bursts of 32 long /tokenize calls: RSS after them 534-579 MB with
    glibc's default, 407-419 MB flat with 2)."""
    from engine.memory import limit_malloc_arenas  # imported here: the master needs none of the engine

    limit_malloc_arenas(2)


def _state(worker):
    app = getattr(worker, "wsgi", None)
    app = getattr(app, "__wrapped__", app)
    return getattr(app, "extensions", {}).get("lockstep")


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
    if not state.engine.wait_idle(DRAIN_TIMEOUT_S):
        logging.getLogger("lockstep.drain").warning("drain timeout: stopping with requests still running")
    gunicorn_stop(signum, None)


def worker_exit(server, worker):
    state = _state(worker)
    if state is not None:
        state.shutdown()
