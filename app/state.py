"""The app's one piece of state: the engine, metrics and server settings, kept in `app.extensions`."""
import logging
import threading
import time
from dataclasses import dataclass, field

from flask import current_app

from engine import MAX_STOP_LENGTH, EngineConfig, LLMEngine
from engine.tool_calls import MAX_DESCRIPTION_CHARS, MAX_TOOLS

from .ops.metrics import ServerMetrics
from .responses.store import ResponseStore
from .settings import ServerSettings

logger = logging.getLogger(__name__)

EXTENSION_KEY = "lockstep"


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
                "architecture": info.architecture if info else None,
                "weight_types": dict(info.weight_types) if info else None,
                "weights": info.weights if info else None, "compute": info.compute if info else None,
                "compute_reason": info.compute_reason if info else None,
                "prefix_cache": info.prefix_cache if info else None,
                "max_model_len": engine.max_model_len or None, "max_batch_size": engine.config.max_batch_size,
                "max_batch_kv_tokens": (info.kv_budget_tokens if info else 0) or engine.config.max_batch_kv_tokens,
                "kv_budget_reason": info.kv_budget_reason if info else None,
                "kv_per_row": info.kv_per_row if info else None,  # the budget bounds the rows' sum, else rows x longest
                "policy": engine.config.policy, "ready": engine.is_ready,
                # Limits a client should know, served so that the page does not repeat them.
                "max_stop_strings": engine.config.max_stop_strings, "max_stop_length": MAX_STOP_LENGTH,
                "max_prompts": self.settings.max_prompts,
                "max_request_timeout_s": engine.config.request_timeout_s,
                "max_tools": MAX_TOOLS, "max_tool_description_chars": MAX_DESCRIPTION_CHARS,
                # how the template writes calls, and whether it has a reasoning block (answers keep it apart)
                "tool_call_format": engine.tool_format.name if engine.inputs else None,
                "reasoning": engine.answer_shape().has_reasoning if engine.inputs else None}


def lockstep() -> AppState:
    return current_app.extensions[EXTENSION_KEY]
