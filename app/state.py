"""The app's one piece of state: the engine, metrics and server settings, kept in `app.extensions`."""
import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from flask import current_app

from engine import MAX_STOP_LENGTH, EngineConfig, LLMEngine

from .metrics import ServerMetrics
from .response_store import ResponseStore

logger = logging.getLogger(__name__)

EXTENSION_KEY = "lockstep"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


@dataclass
class ServerSettings:
    api_key: str = ""
    allowed_origins: tuple[str, ...] = ()
    host: str = "127.0.0.1"  # the bind address: the default public origin, and the DNS-rebinding check
    port: int = 8000
    max_prompts: int = 32
    max_body_bytes: int = 1 << 20
    max_sockets: int = 256  # open WebSockets per worker; keep it well below the gthread thread budget
    ws_max_message_bytes: int = 256 << 10
    ws_ping_interval_s: float = 25.0
    ws_idle_timeout_s: float = 300.0  # no running request and no client frame for this long: closed (1001)
    ws_auth_timeout_s: float = 10.0  # with an API key, the first frame must be an auth frame within this
    drain_timeout_s: float = 30.0
    trusted_proxies: tuple[str, ...] = ()  # peers whose X-Forwarded-For names the client (fairness per user)
    responses_store_entries: int = 1024  # responses kept for GET /v1/responses/{id} and previous_response_id
    responses_store_bytes: int = 64 << 20  # ... and their bytes (the oldest goes first at either cap)

    @classmethod
    def from_env(cls, environ=os.environ) -> "ServerSettings":
        origins = environ.get("LOCKSTEP_ALLOWED_ORIGINS", "")
        return cls(
            api_key=environ.get("LOCKSTEP_API_KEY", ""),
            allowed_origins=tuple(o.strip().rstrip("/") for o in origins.split(",") if o.strip()),
            host=environ.get("LOCKSTEP_HOST", cls.host),
            port=int(environ.get("LOCKSTEP_PORT", cls.port)),
            max_prompts=int(environ.get("LOCKSTEP_MAX_PROMPTS", cls.max_prompts)),
            max_body_bytes=int(environ.get("LOCKSTEP_MAX_BODY_BYTES", cls.max_body_bytes)),
            max_sockets=int(environ.get("LOCKSTEP_MAX_SOCKETS", cls.max_sockets)),
            ws_idle_timeout_s=float(environ.get("LOCKSTEP_WS_IDLE_TIMEOUT_S", cls.ws_idle_timeout_s)),
            drain_timeout_s=float(environ.get("LOCKSTEP_DRAIN_TIMEOUT_S", cls.drain_timeout_s)),
            trusted_proxies=tuple(p.strip() for p in environ.get("LOCKSTEP_TRUSTED_PROXIES", "").split(",")
                                  if p.strip()),
            responses_store_entries=int(environ.get("LOCKSTEP_RESPONSES_STORE_ENTRIES", cls.responses_store_entries)),
            responses_store_bytes=int(environ.get("LOCKSTEP_RESPONSES_STORE_BYTES", cls.responses_store_bytes)),
        )

    @property
    def is_loopback_bind(self) -> bool:
        return is_loopback_host(self.host)

    @property
    def public_origins(self) -> tuple[str, ...]:
        """Origins allowed to open the socket and read REST answers: the bind address itself (for a loopback
        bind also localhost and 127.0.0.1 at that port), plus LOCKSTEP_ALLOWED_ORIGINS. Never the Host header."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        hosts = {host, *LOOPBACK_NAMES} if self.is_loopback_bind else {host}
        return tuple(f"http://{h}:{self.port}" for h in sorted(hosts)) + self.allowed_origins


def is_loopback_host(host: str) -> bool:
    """A loopback name or address (no port); `[::1]` may keep its brackets."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SocketBudget:
    """Counts open WebSockets so that a socket beyond the cap is refused before the upgrade."""

    def __init__(self, limit: int):
        self.limit = limit
        self.num_open = 0
        self._lock = threading.Lock()

    def try_acquire(self) -> bool:
        with self._lock:
            if self.num_open >= self.limit:
                return False
            self.num_open += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.num_open -= 1


@dataclass
class AppState:
    engine: LLMEngine
    metrics: ServerMetrics
    settings: ServerSettings
    created: int = field(default_factory=lambda: int(time.time()))
    is_draining: bool = False
    sockets: SocketBudget = field(init=False)
    responses: ResponseStore = field(init=False)

    def __post_init__(self):
        self.sockets = SocketBudget(self.settings.max_sockets)
        self.responses = ResponseStore(self.settings.responses_store_entries, self.settings.responses_store_bytes)

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests (503), let running ones finish; idle sockets close themselves."""
        if not self.is_draining:
            logger.info("draining: new requests get 503, running ones finish")
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
                "weights": info.weights if info else None, "compute": info.compute if info else None,
                "compute_reason": info.compute_reason if info else None,
                "prefix_cache": info.prefix_cache if info else None,
                "max_model_len": engine.max_model_len or None, "max_batch_size": engine.config.max_batch_size,
                "policy": engine.config.policy, "ready": engine.is_ready,
                # Limits a client should know, served so that the page does not repeat them.
                "max_stop_strings": engine.config.max_stop_strings, "max_stop_length": MAX_STOP_LENGTH,
                "max_prompts": self.settings.max_prompts,
                "max_request_timeout_s": engine.config.request_timeout_s}


def lockstep() -> AppState:
    return current_app.extensions[EXTENSION_KEY]
