"""WebSocket /v1/responses (OpenAI's Responses API in WebSocket mode): the route. Its protocol is
app/responses/ws_session.py's; the socket's upgrade, loop and transport are shared with /ws (app/sockets/upgrade.py)."""
from flask import Blueprint
from simple_websocket import Server

from ..rest.api import client_address
from ..sockets.upgrade import serve_socket, sock
from .ws_session import ResponsesSession

bp = Blueprint("responses_ws", __name__)


@sock.route("/v1/responses", bp=bp)
def responses_socket(ws: Server):
    client = client_address()
    serve_socket(ws, lambda transport, state: ResponsesSession(transport, state, client))
