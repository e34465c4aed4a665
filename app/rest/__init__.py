"""REST: the original endpoints and the OpenAI-compatible ones (api.py, described by openapi.py), and what every
interface shares with them: reading a request body (request_parsing.py), a chat request's parts (chat_request.py),
and an answer in OpenAI's shapes (answer_shaping.py)."""
