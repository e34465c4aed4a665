"""ServerSettings: every setting of the HTTP side (the app, its gunicorn worker and gunicorn.conf.py) in one
dataclass, read from LOCKSTEP_<FIELD> variables as EngineConfig reads the engine's."""
import ipaddress
import os
from dataclasses import dataclass

from engine.config import check_at_least, check_seconds, dataclass_from_env, variable

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # gunicorn's


@dataclass
class ServerSettings:
    api_key: str = ""
    allowed_origins: tuple[str, ...] = ()  # a comma list; `*` allows any
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
    # gunicorn's: its processes and threads (gunicorn.conf.py) and its worker's read deadlines (gunicorn_worker.py)
    workers: int = 1  # one model copy each
    http_threads: int = 1024
    log_level: str = "info"
    header_timeout_s: float = 10.0  # a request's headers must arrive within this of its first byte (else 408)
    body_timeout_s: float = 30.0  # ... and its body within this of its headers

    def __post_init__(self):
        self.allowed_origins = tuple(origin.rstrip("/") for origin in self.allowed_origins)
        check_at_least(self, ("max_prompts", "max_body_bytes", "max_sockets", "ws_max_message_bytes",
                              "responses_store_entries", "responses_store_bytes", "workers", "http_threads"))
        if not 1 <= self.port <= 65535:  # not 0: the origins allowed name the port, and a random one is unknown
            raise ValueError(f"{variable('port')} must be 1..65535, got {self.port}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"{variable('log_level')} must be one of {', '.join(LOG_LEVELS)}; got {self.log_level!r}")
        if any(c.isspace() for c in self.api_key):
            raise ValueError(f"{variable('api_key')} must not contain whitespace (a Bearer header cannot carry it)")
        check_seconds(self, ("ws_ping_interval_s", "ws_idle_timeout_s", "ws_auth_timeout_s", "header_timeout_s",
                             "body_timeout_s"))
        check_seconds(self, ("drain_timeout_s",), zero_allowed=True)  # 0: SIGTERM cancels at once

    @classmethod
    def from_env(cls, environ=os.environ, **overrides) -> "ServerSettings":
        """Read LOCKSTEP_<FIELD> (e.g. LOCKSTEP_MAX_SOCKETS=64); explicit overrides win. An empty variable means
        the default, but an empty API key is refused: it reads as a key left out by mistake (`$UNSET_VAR`)."""
        if environ.get("LOCKSTEP_API_KEY") == "" and "api_key" not in overrides:
            raise ValueError(f"{variable('api_key')} is set but empty: unset it to serve without a key")
        return dataclass_from_env(cls, environ, **overrides)

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
