"""gunicorn settings for lockstep (`gunicorn -c gunicorn.conf.py wsgi:app`).

gthread workers: every open WebSocket holds one thread for its whole life, so `threads`
bounds concurrent sockets plus in-flight REST calls. Each gunicorn worker builds its own
engine (and forks its own model worker) when it imports wsgi.py: never in the master,
so no `preload_app`. SIGTERM drains: new requests are refused, running ones finish
(up to graceful_timeout), then the engine and its model worker are shut down.
"""
import logging
import os
import signal

bind = f"{os.environ.get('LOCKSTEP_HOST', '127.0.0.1')}:{os.environ.get('LOCKSTEP_PORT', '8000')}"
workers = int(os.environ.get("LOCKSTEP_WORKERS", "1"))  # one model copy each
worker_class = "gthread"
threads = int(os.environ.get("LOCKSTEP_HTTP_THREADS", "64"))
timeout = 120  # the worker heartbeat; WebSocket threads keep it alive, long generations are fine
graceful_timeout = int(os.environ.get("LOCKSTEP_DRAIN_TIMEOUT_S", "30"))
keepalive = 5
preload_app = False
# One control socket path per user is shared by every gunicorn; two servers (or a test beside `make serve`) collide.
control_socket_disable = True
accesslog = "-"
loglevel = os.environ.get("LOCKSTEP_LOG_LEVEL", "info")
# gunicorn configures only its own loggers; lockstep's (app.*, engine.*) log through the root logger.
logging.basicConfig(level=loglevel.upper(), format="%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s")


def _state(worker):
    app = getattr(worker, "wsgi", None)
    return getattr(app, "extensions", {}).get("lockstep")


def post_worker_init(worker):
    """Chain SIGTERM: first stop taking new requests, then let gunicorn wait for the running ones."""
    previous = signal.getsignal(signal.SIGTERM)

    def drain_then_exit(signum, frame):
        state = _state(worker)
        if state is not None:
            state.begin_drain()
        previous(signum, frame)

    signal.signal(signal.SIGTERM, drain_then_exit)


def worker_exit(server, worker):
    state = _state(worker)
    if state is not None:
        state.shutdown()
