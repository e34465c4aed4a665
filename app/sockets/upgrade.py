"""What every WebSocket route shares before and around its session: the upgrade's refusals and its slot.

The routes are flask-sock's (`@sock.route(path, bp=bp)`): flask-sock upgrades with simple_websocket's Server,
built from the request's environ and SOCK_SERVER_OPTIONS (ping interval, frame limit), and calls the route
with it. What must happen before the upgrade is a `before_request` hook here, the last one (after Host,
Origin, drain and key): a broken handshake (400/426) or a socket over the cap (503) is refused with a JSON
body, and an accepted one holds a socket slot that `teardown_request` gives back. The same hook puts a
GuardedSocket in the environ, so the Server flask-sock builds sends under one lock and closes lingering.
A route's body is `serve_socket`: its session (app/sockets/session.py) speaks through a SocketTransport
(app/sockets/transport.py) until the socket closes.
"""
import logging
from typing import Callable

from flask import Response, current_app, g, request
from flask_sock import Sock
from simple_websocket import Server
from werkzeug.exceptions import HTTPException, MethodNotAllowed
from werkzeug.routing import WebsocketMismatch

from ..errors import ApiError, error_response, http_error
from ..guards import SOCKET_ENDPOINTS
from ..state import AppState, lockstep
from .session import SocketSession
from .transport import GuardedSocket, SocketTransport

logger = logging.getLogger(__name__)

WEBSOCKET_VERSION = "13"
CONNECTION_KEYS = ("gunicorn.socket", "werkzeug.socket")  # where simple_websocket finds the connection
INVALID_HANDSHAKE = "invalid_handshake"

sock = Sock()  # stateless until init_app: the routes are registered on their blueprints


def init_app(app) -> None:
    """flask-sock's options and the upgrade's hooks. Call after register_guards: this hook must run last."""
    app.config["SOCK_SERVER_OPTIONS"] = socket_options(app.extensions["lockstep"].settings)
    app.before_request(_prepare_upgrade)
    app.teardown_request(_release_socket_slot)
    for routing_error in (WebsocketMismatch, MethodNotAllowed):
        app.register_error_handler(routing_error, _not_an_upgrade)
    sock.init_app(app)


def serve_socket(ws: Server, make_session: Callable[[SocketTransport, AppState], SocketSession]) -> None:
    """A flask-sock route's body: run the session to its end, then close the socket cleanly."""
    transport = SocketTransport(ws)
    try:
        make_session(transport, lockstep()).run()
    except Exception:  # noqa: BLE001 - past the upgrade no HTTP error may follow: the connection is the socket's
        logger.exception("socket session failed")
    finally:
        transport.finish()


def _prepare_upgrade() -> Response | None:
    if request.endpoint not in SOCKET_ENDPOINTS:
        return None
    refusal = check_handshake(lockstep())
    if refusal is not None:
        return refusal
    g.holds_socket_slot = True
    for key in CONNECTION_KEYS:
        if key in request.environ:
            request.environ[key] = GuardedSocket(request.environ[key])
    return None


def _not_an_upgrade(exc: HTTPException) -> Response:
    """A plain GET on a socket's path: werkzeug says 400 Bad Request (/ws) or 405 (/v1/responses, whose POST is
    REST); say what the path is instead, as a broken handshake does."""
    if request.method == "GET" and _is_socket_path(request.path):
        return error_response(ApiError(400, f"GET {request.path} is a WebSocket endpoint: it needs an upgrade "
                                            "(Connection: Upgrade, Upgrade: websocket)", INVALID_HANDSHAKE))
    return http_error(exc)


def _is_socket_path(path: str) -> bool:
    return any(rule.websocket and rule.rule == path for rule in current_app.url_map.iter_rules())


def _release_socket_slot(_error=None) -> None:
    if g.pop("holds_socket_slot", False):
        lockstep().sockets.release()


def check_handshake(state: AppState) -> Response | None:
    """Refuse before the upgrade, with a JSON body: a broken handshake (400/426), too many sockets (503).
    On None a socket slot is held: teardown releases it."""
    if not request.headers.get("Sec-WebSocket-Key"):
        return error_response(ApiError(400, "a WebSocket upgrade needs Sec-WebSocket-Key", INVALID_HANDSHAKE))
    if request.headers.get("Sec-WebSocket-Version") != WEBSOCKET_VERSION:
        response = error_response(ApiError(426, "only WebSocket version 13 is supported", INVALID_HANDSHAKE))
        response.headers["Sec-WebSocket-Version"] = WEBSOCKET_VERSION
        return response
    if not state.sockets.try_acquire():
        logger.warning("refused a socket: %d are open (LOCKSTEP_MAX_SOCKETS)", state.sockets.limit)
        return error_response(ApiError(503, f"too many open sockets (at most {state.sockets.limit}); retry shortly",
                                       "too_many_sockets", type_="server_error"))
    return None


def socket_options(settings) -> dict:
    return {"ping_interval": settings.ws_ping_interval_s, "max_message_size": settings.ws_max_message_bytes}
