"""Operations: liveness, readiness (a real round-trip to the worker) and Prometheus metrics."""
from flask import Blueprint, Response, jsonify

from .state import lockstep

bp = Blueprint("ops", __name__)


@bp.get("/health")
def health():
    return jsonify(status="ok")


@bp.get("/ready")
def ready():
    engine = lockstep().engine
    if engine.check_worker():
        return jsonify(status="ready", model=lockstep().model_name)
    reason = engine.load_error or "the model worker is loading or restarting"
    response = jsonify(status="not_ready", reason=reason)
    response.status_code = 503
    response.headers["Retry-After"] = "1"
    return response


@bp.get("/metrics")
def metrics():
    return Response(lockstep().metrics.render(), mimetype="text/plain; version=0.0.4")
