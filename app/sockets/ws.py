"""WebSocket /ws: the route. Its protocol is app/sockets/ws_session.py's; the socket's upgrade, loop and transport are
app/sockets/upgrade.py's, app/sockets/session.py's and app/sockets/transport.py's."""
from flask import Blueprint, g
from simple_websocket import Server

from ..rest.api import client_address
from .upgrade import serve_socket, sock
from .ws_session import ChatSession

bp = Blueprint("ws", __name__)


@sock.route("/ws", bp=bp)
def chat_socket(ws: Server):
    is_authenticated = g.get("is_authenticated", False)  # the guards checked a key on the handshake, if any
    client = client_address()
    serve_socket(ws, lambda transport, state: ChatSession(transport, state, client, is_authenticated))
