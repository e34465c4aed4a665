"""OpenAI's Responses API against live servers, over REST and in WebSocket mode (the SDK, openai-agents). Marker
`responses`."""
