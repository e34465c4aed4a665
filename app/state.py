"""The app's one piece of state: the engine, metrics and server settings, kept in `app.extensions`."""
import os
import time
from dataclasses import dataclass, field

from flask import current_app

from engine import EngineConfig, LLMEngine

from .metrics import ServerMetrics

EXTENSION_KEY = "lockstep"


@dataclass
class ServerSettings:
    api_key: str = ""
    allowed_origins: tuple[str, ...] = ()
    max_prompts: int = 32
    max_body_bytes: int = 1 << 20
    ws_max_message_bytes: int = 256 << 10
    ws_ping_interval_s: float = 25.0
    drain_timeout_s: float = 30.0

    @classmethod
    def from_env(cls, environ=os.environ) -> "ServerSettings":
        origins = environ.get("LOCKSTEP_ALLOWED_ORIGINS", "")
        return cls(
            api_key=environ.get("LOCKSTEP_API_KEY", ""),
            allowed_origins=tuple(o.strip().rstrip("/") for o in origins.split(",") if o.strip()),
            max_prompts=int(environ.get("LOCKSTEP_MAX_PROMPTS", cls.max_prompts)),
            max_body_bytes=int(environ.get("LOCKSTEP_MAX_BODY_BYTES", cls.max_body_bytes)),
            drain_timeout_s=float(environ.get("LOCKSTEP_DRAIN_TIMEOUT_S", cls.drain_timeout_s)),
        )


@dataclass
class AppState:
    engine: LLMEngine
    metrics: ServerMetrics
    settings: ServerSettings
    created: int = field(default_factory=lambda: int(time.time()))
    is_draining: bool = False

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests, let running ones finish; idle sockets close themselves."""
        self.is_draining = True
        self.engine.stop_accepting()

    def shutdown(self) -> None:
        self.begin_drain()
        self.engine.shutdown(drain_timeout=self.settings.drain_timeout_s)

    @property
    def model_name(self) -> str:
        config: EngineConfig = self.engine.config
        return config.model

    @property
    def max_prompts(self) -> int:
        return self.settings.max_prompts

    def model_card(self) -> dict:
        engine = self.engine
        info = engine.info
        backend, reason = engine.backend_choice or (engine.config.backend, "")
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lockstep",
                "backend": info.backend if info else backend, "backend_reason": reason,
                "dtype": info.dtype if info else engine.config.dtype, "device": info.device if info else None,
                "max_model_len": engine.max_model_len or None, "max_batch_size": engine.config.max_batch_size,
                "policy": engine.config.policy, "ready": engine.is_ready}


def lockstep() -> AppState:
    return current_app.extensions[EXTENSION_KEY]
