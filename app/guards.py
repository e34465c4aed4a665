"""Request hooks: API key, allowed origins (CORS and WebSocket), one log line per request."""
import hmac
import logging
import time
import uuid
from urllib.parse import urlsplit

from flask import g, request

from .errors import ApiError, error_response
from .state import lockstep

logger = logging.getLogger(__name__)

OPEN_ENDPOINTS = {"ops.health", "ops.ready", "ops.metrics", "pages.index", "static"}


def register_guards(app) -> None:
    app.before_request(_start_timer)
    app.before_request(_check_origin)
    app.before_request(_check_api_key)
    app.after_request(_add_cors_headers)
    app.after_request(_log_request)


def _start_timer():
    g.started = time.perf_counter()
    g.request_id = request.headers.get("X-Request-Id", "")[:64] or uuid.uuid4().hex[:16]


def _check_origin():
    origin = request.headers.get("Origin")
    if not origin or _is_allowed_origin(origin):
        return None
    if request.endpoint == "ws.chat_socket":
        return error_response(ApiError(403, f"origin {origin} is not allowed", "origin_not_allowed"))
    return None  # REST: the browser enforces CORS; we just do not add the allow header


def _check_api_key():
    key = lockstep().settings.api_key
    if request.method == "OPTIONS" or not key or request.endpoint in OPEN_ENDPOINTS:
        return None
    given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    given = given or request.args.get("api_key", "")  # browsers cannot set headers on a WebSocket
    if not hmac.compare_digest(given.encode(), key.encode()):
        return error_response(ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                                       "invalid_api_key", type_="authentication_error"))
    return None


def _is_allowed_origin(origin: str) -> bool:
    if urlsplit(origin).netloc == request.host:
        return True
    allowed = lockstep().settings.allowed_origins
    return "*" in allowed or origin.rstrip("/") in allowed


def _add_cors_headers(response):
    origin = request.headers.get("Origin")
    if origin and _is_allowed_origin(origin) and urlsplit(origin).netloc != request.host:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
        response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
        response.headers["Vary"] = "Origin"
    return response


def _log_request(response):
    """One line per request, never the prompt text."""
    elapsed_ms = (time.perf_counter() - g.get("started", time.perf_counter())) * 1000
    request_id = g.get("request_id", "-")
    response.headers["X-Request-Id"] = request_id
    if request.endpoint != "ws.chat_socket":
        logger.info("request %s %s %s status=%d tokens=%d duration=%.0fms", request_id, request.method,
                    request.path, response.status_code, g.get("completion_tokens", 0), elapsed_ms)
    return response
