"""The engine's error hierarchy; the server maps each class to a status and a WebSocket code."""


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""

    code = "internal_error"


class InvalidRequest(EngineError):
    """The request itself is wrong (bad field, prompt too long, ...)."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidRequest):
    code = "context_length_exceeded"


class Overloaded(EngineError):
    """The waiting queue is full; the caller should retry later."""

    code = "overloaded"


class NotReady(EngineError):
    """The model worker is loading or restarting."""

    code = "not_ready"


class ShuttingDown(NotReady):
    """The server stops (SIGTERM past its drain, or the engine's shutdown): what still runs ends with this."""

    code = "shutting_down"

    def __init__(self, message: str = "the server is shutting down"):
        super().__init__(message)


class WorkerFailed(EngineError):
    """The model worker died, hung or reported an error; in-flight requests fail with this."""

    code = "worker_failed"


class WorkerBusy(EngineError):
    """Another round-trip held the worker longer than a caller was willing to wait (the worker is fine)."""

    code = "worker_busy"


class CorrelationMismatch(EngineError):
    """A worker result answered another call: a broken round-trip invariant, never a silent swap."""

    code = "internal_error"


class BackendUnavailable(EngineError):
    """The requested backend cannot run here (e.g. vLLM is not installed)."""

    code = "backend_unavailable"


class DeadlineExceeded(EngineError):
    """The request ran past its deadline (the server's `request_timeout_s` or the request's own `timeout`)."""

    code = "deadline_exceeded"


class RequestFailed(EngineError):
    """The worker could not compute this one request (the batch and the worker went on)."""

    code = "request_failed"


def describe(exc: BaseException) -> str:
    """An exception in one line for a log or an error message: its type and text."""
    return f"{type(exc).__name__}: {exc}"
