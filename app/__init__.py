"""The Flask application factory: settings, engine, blueprints, error handlers, request hooks.

The app's parts, one folder per interface: rest/ (the REST endpoints, and how every interface reads a request and
shapes an answer), sockets/ (the WebSocket machinery and /ws), responses/ (OpenAI's Responses API over REST and
WebSocket), ops/ (health, metrics, the gunicorn worker). What they all share stays here: settings.py, state.py,
errors.py, guards.py (the hooks on every request), and pages.py (the chat page).
"""
import logging
from typing import Callable, TypeVar

from flask import Flask

from engine import BackendUnavailable, EngineConfig, LLMEngine, WorkerFailed
from engine import ModelNotFound, UnsupportedModel

from . import pages
from .errors import register_error_handlers
from .guards import register_guards
from .ops import routes as ops_routes
from .ops.metrics import ServerMetrics
from .responses import rest as responses_rest
from .responses import ws as responses_ws
from .rest import api, openapi
from .settings import ServerSettings
from .sockets import upgrade, ws
from .state import EXTENSION_KEY, AppState

logger = logging.getLogger(__name__)

T = TypeVar("T")

STARTUP_FAILURE_EXIT_CODE = 3  # gunicorn's "worker failed to boot": the master stops instead of respawning


def create_app(config: dict | None = None) -> Flask:
    """Build the app. `config` may set ENGINE (EngineConfig), SETTINGS (ServerSettings), START_ENGINE and
    WAIT_FOR_MODEL (tests wait; gunicorn does not, so /ready says 503 while the model loads)."""
    app = Flask(__name__, template_folder="../templates", static_folder="../static")
    app.config.from_mapping(START_ENGINE=True, WAIT_FOR_MODEL=False)
    app.config.update(config or {})
    settings = app.config.get("SETTINGS") or settings_from_env()
    # each gunicorn worker loads its own model: they share the memory a limit leaves
    engine_config = app.config.get("ENGINE") or _configured(
        lambda: EngineConfig.from_env(model_copies=settings.workers))
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes + 1  # read_json_body refuses the extra byte

    metrics = ServerMetrics()
    engine = LLMEngine(engine_config, observer=metrics)
    metrics.bind(engine)
    app.extensions[EXTENSION_KEY] = AppState(engine, metrics, settings)

    register_error_handlers(app)
    register_guards(app)
    upgrade.init_app(app)  # after the guards: the upgrade's refusals come last, as the route's did
    for module in (api, openapi, ops_routes, pages, responses_rest, responses_ws, ws):
        app.register_blueprint(module.bp)
    if app.config["START_ENGINE"]:
        try:
            engine.start(wait=app.config["WAIT_FOR_MODEL"])
        # WorkerFailed: the model did not load
        except (BackendUnavailable, ModelNotFound, UnsupportedModel, WorkerFailed) as exc:
            raise _startup_failure(str(exc)) from None
    return app


def settings_from_env() -> ServerSettings:
    """The HTTP side's settings (gunicorn.conf.py reads them too); a bad value stops the server with one line."""
    return _configured(ServerSettings.from_env)


def _configured(read_settings: Callable[[], T]) -> T:
    try:
        return read_settings()
    except ValueError as exc:
        raise _startup_failure(f"bad configuration: {exc}") from None


def _startup_failure(message: str) -> SystemExit:
    """A mis-set server stops at start with one clear line, not a traceback (or a respawn loop)."""
    logger.critical("lockstep cannot start: %s", message)
    return SystemExit(STARTUP_FAILURE_EXIT_CODE)
