"""OpenAI's Responses API: over REST (rest.py) and in WebSocket mode (the route: ws.py; its events: ws_session.py),
with the output items both build (output.py) and the bounded store of past responses (store.py)."""
