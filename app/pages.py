"""The chat page. What the page needs to know of the server (its limits, what its error codes mean to a user, the
socket's close code for a refused key) is rendered into the page from here, so static/ repeats none of it."""
from flask import Blueprint, render_template
from wsproto.frame_protocol import CloseReason

from engine import (BackendUnavailable, DeadlineExceeded, NotReady, Overloaded, RequestFailed, ShuttingDown, WorkerBusy,
                    WorkerFailed)

from . import errors
from .state import lockstep

bp = Blueprint("pages", __name__)

# The model card's limits that the page checks before it sends; it reads the card again once the model is ready.
PAGE_LIMITS = ("max_model_len", "max_stop_strings", "max_stop_length", "max_prompts")
# Errors about the request itself (a limit, a bad value): the page shows the server's own message.
USER_MESSAGE_CODES = (errors.MISSING_FIELD, errors.INVALID_VALUE, errors.UNSUPPORTED_FIELD,
                      errors.CONTEXT_LENGTH_EXCEEDED)
NEEDS_API_KEY_TEXT = "The server needs an API key: enter it under Settings."
# Every other error gets a plain sentence: its message is written for operators and can carry internals.
ERROR_TEXTS = {
    Overloaded.code: "The server is busy with other requests. Try again in a moment.",
    NotReady.code: "The model is still loading. Try again when the badge says connected.",
    ShuttingDown.code: "The server is restarting. Try again when the badge says connected.",
    WorkerFailed.code: "The model stopped unexpectedly and is being restarted. Try again in a moment.",
    WorkerBusy.code: "The model is busy. Try again in a moment.",
    BackendUnavailable.code: "This server cannot run its model backend.",
    DeadlineExceeded.code: "The answer took too long and was cut off.",
    RequestFailed.code: "The answer failed on the server. Try again.",
    errors.AUTH_REQUIRED: NEEDS_API_KEY_TEXT,
    errors.INVALID_API_KEY: "The API key was not accepted: check it under Settings.",
    "unauthorized": NEEDS_API_KEY_TEXT,  # werkzeug's 401
}
# After these the model may be gone for a while: the page asks GET /ready again before it unlocks Send.
RECHECK_READY_CODES = (NotReady.code, ShuttingDown.code, WorkerFailed.code, WorkerBusy.code)


@bp.get("/")
def index():
    return render_template("index.html", page=page_config())


def page_config() -> dict:
    card = lockstep().model_card()
    return {"limits": {name: card[name] for name in PAGE_LIMITS}, "user_message_codes": USER_MESSAGE_CODES,
            "error_texts": ERROR_TEXTS, "recheck_ready_codes": RECHECK_READY_CODES,
            "auth_close_code": int(CloseReason.POLICY_VIOLATION)}
