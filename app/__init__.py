"""The Flask application factory: settings, engine, blueprints, error handlers, request hooks."""
import logging

from flask import Flask

from engine import EngineConfig, LLMEngine

from . import api, ops, pages, ws
from .errors import register_error_handlers
from .guards import register_guards
from .metrics import ServerMetrics
from .state import EXTENSION_KEY, AppState, ServerSettings

logger = logging.getLogger(__name__)


def create_app(config: dict | None = None) -> Flask:
    """Build the app. `config` may set ENGINE (EngineConfig), SETTINGS (ServerSettings), START_ENGINE and
    WAIT_FOR_MODEL (tests wait; gunicorn does not, so /ready says 503 while the model loads)."""
    app = Flask(__name__, template_folder="../templates", static_folder="../static")
    app.config.from_mapping(START_ENGINE=True, WAIT_FOR_MODEL=False)
    app.config.update(config or {})
    engine_config = app.config.get("ENGINE") or EngineConfig.from_env()
    settings = app.config.get("SETTINGS") or ServerSettings.from_env()
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config["SOCK_SERVER_OPTIONS"] = ws.socket_options(settings)

    metrics = ServerMetrics()
    engine = LLMEngine(engine_config, observer=metrics)
    metrics.bind(engine)
    app.extensions[EXTENSION_KEY] = AppState(engine, metrics, settings)

    register_error_handlers(app)
    register_guards(app)
    for module in (api, ops, pages, ws):
        app.register_blueprint(module.bp)
    if app.config["START_ENGINE"]:
        engine.start(wait=app.config["WAIT_FOR_MODEL"])
    return app
