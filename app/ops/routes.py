"""Operations: liveness, readiness and Prometheus metrics."""
from flask import Blueprint, Response, jsonify

from ..state import lockstep

bp = Blueprint("ops", __name__)


@bp.get("/health")
def health():
    return jsonify(status="ok")


@bp.get("/ready")
def ready():
    """200 when this instance should get traffic: accepting (not draining) and the worker answered recently
    or is busy in a step younger than the step timeout (the engine decides, without queueing behind a step)."""
    state = lockstep()
    is_ready, reason = state.engine.readiness()  # a drain stops the engine accepting: that is "not ready" too
    if is_ready:
        return jsonify(status="ready", model=state.model_name)
    response = jsonify(status="not_ready", reason=reason)
    response.status_code = 503
    response.headers["Retry-After"] = "1"
    return response


@bp.get("/metrics")
def metrics():
    return Response(lockstep().metrics.render(), mimetype="text/plain; version=0.0.4")
