"""One error shape for REST and WebSocket, and the one place engine errors become statuses and codes."""
import logging

from flask import jsonify, request
from gunicorn.http.errors import ParseException as GunicornParseError
from werkzeug.exceptions import ClientDisconnected, HTTPException, MethodNotAllowed, NotFound

from engine import (BackendUnavailable, DeadlineExceeded, EngineError, InvalidRequest, NotReady, Overloaded,
                    RequestFailed, ShuttingDown, WorkerBusy, WorkerFailed)

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
# Reading a request body: a broken connection, or chunked encoding that does not parse (werkzeug reports it as a
# ClientDisconnected, gunicorn raises its own ParseException).
BODY_READ_ERRORS = (OSError, ClientDisconnected, GunicornParseError)

# Request validation answers 400 (as OpenAI and vLLM do) with one of these codes, on REST and WS alike; `param`
# names the field. A wrong JSON type is a bad value too.
MISSING_FIELD = "missing_field"  # a required field is absent (or null)
INVALID_VALUE = "invalid_value"  # a field of the wrong type, out of range, empty, unknown role...
UNSUPPORTED_FIELD = "unsupported_field"  # a field this server does not implement (refused, never ignored)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the prompt (plus max_tokens) does not fit the context
# Authentication answers 401 with one of these: no key where one is required, or a wrong one.
AUTH_REQUIRED = "auth_required"  # a /ws socket's first frame is not an auth frame
INVALID_API_KEY = "invalid_api_key"
# A bug answers 500 with this code and message, never more (the details go to the log).
INTERNAL_ERROR, INTERNAL_ERROR_MESSAGE = "internal_error", "internal server error"
FAILED_OUTPUT_MESSAGE = "generation failed"  # an output the engine failed without saying why
# The engine's generic InvalidRequest code, as the app answers it.
_VALIDATION_CODES = {"invalid_request": INVALID_VALUE}

# status, OpenAI error type; the first matching class wins
_STATUS = [
    (InvalidRequest, 400, "invalid_request_error"),
    (Overloaded, 429, "rate_limit_error"),
    (ShuttingDown, 503, "server_error"),
    (NotReady, 503, "server_error"),
    (WorkerFailed, 503, "server_error"),
    (WorkerBusy, 503, "server_error"),
    (BackendUnavailable, 503, "server_error"),
    (DeadlineExceeded, 504, "server_error"),
    (RequestFailed, 500, "server_error"),
]
_STATUS_BY_CODE = {cls.code: status for cls, status, _ in _STATUS if cls is not InvalidRequest}
# After these the request body may still be on the wire: closing is the only clean way to keep HTTP framing.
CLOSE_AFTER = (408, 413)


class ApiError(Exception):
    """A REST/WS error raised by the app itself (malformed body, auth, unknown message type...)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_


def from_engine_error(exc: EngineError) -> ApiError:
    status, type_ = next(((s, t) for cls, s, t in _STATUS if isinstance(exc, cls)), (500, "server_error"))
    return ApiError(status, str(exc), _VALIDATION_CODES.get(exc.code, exc.code), getattr(exc, "param", None), type_)


def missing_field(name: str, message: str | None = None) -> ApiError:
    return ApiError(400, message or f"{name} is required", MISSING_FIELD, name)


def invalid_value(name: str, message: str) -> ApiError:
    return ApiError(400, message, INVALID_VALUE, name)


def unsupported_field(name: str, message: str | None = None) -> ApiError:
    return ApiError(400, message or f"{name} is not supported by this server", UNSUPPORTED_FIELD, name)


def from_failed_output(output) -> ApiError:
    """A request the engine finished with `error` (worker failure, deadline, shutdown): the same error on REST and
    WS, its status chosen by the output's error code."""
    code = output.error_code or "worker_failed"
    status = _STATUS_BY_CODE.get(code, 500)
    return ApiError(status, output.error or FAILED_OUTPUT_MESSAGE, code, type_="server_error")


def error_response(error: ApiError):
    body = {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
    response = jsonify(body)
    response.status_code = error.status
    if error.status in (429, 503):
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    if error.status in CLOSE_AFTER:
        response.headers["Connection"] = "close"
    return response


def ws_error(client_id, error: ApiError) -> dict:
    # `param`: the field at fault, null when none is, as REST's error and the Responses socket's
    return {"type": "error", "id": client_id, "code": error.code, "message": error.message, "param": error.param}


def register_error_handlers(app) -> None:
    app.register_error_handler(ApiError, error_response)
    app.register_error_handler(EngineError, lambda exc: error_response(from_engine_error(exc)))
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(500, _internal_error)


def http_error(exc: HTTPException):
    code = (exc.name or "error").lower().replace(" ", "_")
    type_ = "server_error" if (exc.code or 500) >= 500 else "invalid_request_error"
    message = exc.description or exc.name
    if isinstance(exc, NotFound):  # e.g. an OpenAI route this server does not serve (a handler: in a request)
        message = f"{request.method} {request.path[:200]} is not served here (its routes: /openapi.json)"
    response = error_response(ApiError(exc.code or 500, message, code, type_=type_))
    if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
        response.headers["Allow"] = ", ".join(sorted(exc.valid_methods))
    return response


def _internal_error(exc):
    original = getattr(exc, "original_exception", exc)
    logger.error("unhandled error: %r", original, exc_info=original)
    return error_response(ApiError(500, INTERNAL_ERROR_MESSAGE, INTERNAL_ERROR, type_="server_error"))
