"""Request hooks: Host (DNS rebinding), Origin (CORS and WebSocket), drain, API key, one log line per request."""
import hashlib
import hmac
import logging
import time
import uuid
from urllib.parse import urlsplit

from flask import g, request

from .errors import INVALID_API_KEY, ApiError, error_response
from .settings import is_loopback_host
from .state import lockstep

logger = logging.getLogger(__name__)

OPS_ENDPOINTS = {"ops.health", "ops.ready", "ops.metrics"}  # still answered during a drain
OPEN_ENDPOINTS = OPS_ENDPOINTS | {"pages.index", "static"}  # answered without an API key
FIRST_FRAME_AUTH_ENDPOINT = "ws.chat_socket"  # browsers cannot set headers: /ws may authenticate in a frame
SOCKET_ENDPOINTS = {FIRST_FRAME_AUTH_ENDPOINT, "responses_ws.responses_socket"}


def register_guards(app) -> None:
    app.before_request(_start_timer)
    app.before_request(_check_host)
    app.before_request(_check_origin)
    app.before_request(_refuse_while_draining)
    app.before_request(_check_api_key)
    app.after_request(_add_cors_headers)
    app.after_request(_log_request)


def _start_timer():
    g.started = time.perf_counter()
    g.request_id = request.headers.get("X-Request-Id", "")[:64] or uuid.uuid4().hex[:16]


def _check_host():
    """A server bound to loopback answers only loopback names: a page on evil.example that re-binds its name to
    127.0.0.1 still sends `Host: evil.example`."""
    if not lockstep().settings.is_loopback_bind:
        return None
    hostname = _hostname(request.headers.get("Host", ""))
    if hostname is not None and is_loopback_host(hostname):
        return None
    return error_response(ApiError(421, "this server answers only to a loopback Host name", "misdirected_request"))


def _hostname(host_header: str) -> str | None:
    try:
        return urlsplit(f"//{host_header}").hostname
    except ValueError:
        return None


def _check_origin():
    origin = request.headers.get("Origin")
    if origin is None or request.endpoint not in SOCKET_ENDPOINTS or is_allowed_origin(origin):
        return None  # REST: the browser enforces CORS; we only leave out the allow header
    return error_response(ApiError(403, f"origin {origin} is not allowed", "origin_not_allowed"))


def _refuse_while_draining():
    if lockstep().is_draining and request.endpoint not in OPS_ENDPOINTS:
        return error_response(ApiError(503, "the server is shutting down; retry on another instance",
                                       "shutting_down", type_="server_error"))
    return None


def _check_api_key():
    """REST needs `Authorization: Bearer <key>`. The socket may send it on the handshake too; browsers cannot,
    so without the header /ws authenticates with its first frame (app/sockets/ws_session.py). The Responses socket takes
    the key from the handshake only, as OpenAI's SDK sends it."""
    key = lockstep().settings.api_key
    g.is_authenticated = not key
    if request.method == "OPTIONS" or not key or request.endpoint in OPEN_ENDPOINTS:
        return None
    header = request.headers.get("Authorization")
    if header is None and request.endpoint == FIRST_FRAME_AUTH_ENDPOINT:
        return None
    if header is not None and keys_match(bearer_token(header), key):
        g.is_authenticated = True
        return None
    return error_response(ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                                   INVALID_API_KEY, type_="authentication_error"))


def bearer_token(header: str) -> str | None:
    """`Bearer <token>` with the scheme in any case (RFC 9110); anything else, a bare key included, is None."""
    parts = header.split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    return parts[1]


def keys_match(given: str | None, key: str) -> bool:
    """Constant time: digests have equal lengths, so neither the key's length nor its prefix leaks."""
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(_digest(given), _digest(key))


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def is_allowed_origin(origin: str) -> bool:
    allowed = lockstep().settings.public_origins
    return "*" in allowed or origin.rstrip("/").lower() in {o.lower() for o in allowed}


def _add_cors_headers(response):
    origin = request.headers.get("Origin")
    if origin and is_allowed_origin(origin):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
        response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"  # DELETE: a stored response
        response.headers["Vary"] = "Origin"
    return response


def _log_request(response):
    """One line per request, never the prompt text nor the query string (it may carry a secret)."""
    elapsed_ms = (time.perf_counter() - g.get("started", time.perf_counter())) * 1000
    request_id = g.get("request_id", "-")
    response.headers["X-Request-Id"] = request_id
    if request.endpoint not in SOCKET_ENDPOINTS:
        logger.info("request %s %s %s status=%d tokens=%d duration=%.0fms", request_id, request.method,
                    request.path, response.status_code, g.get("completion_tokens", 0), elapsed_ms)
    return response
