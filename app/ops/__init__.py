"""Operations: /health, /ready and /metrics (routes.py, metrics.py), the gunicorn worker that serves the app
(gunicorn_worker.py), and the real gunicorn seen from outside, started and watched by the benchmark and the tests
(gunicorn_process.py)."""
