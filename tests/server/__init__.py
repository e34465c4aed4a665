"""The server through its interfaces against live servers: REST, /ws, the OpenAI SDK, OpenAPI, lockstep_client,
gunicorn and nginx as deployed. Marker `server`."""
