"""WebSocket: what every socket route shares (the upgrade: upgrade.py; the session loop: session.py; sending and
closing: transport.py) and lockstep's own streaming protocol, /ws (the route: ws.py; its frames: ws_session.py)."""
