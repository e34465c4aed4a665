"""lockstep's engine: a thread-safe front to one forked model worker.

    engine = LLMEngine(EngineConfig(model="smollm2")).start()
    for text in engine.submit("Hello", SamplingParams(max_tokens=32)):
        ...
"""
from .config import EngineConfig
from .engine import LLMEngine, RequestHandle
from .errors import (BackendUnavailable, CorrelationMismatch, EngineError, InvalidRequest, NotReady,
                     Overloaded, PromptTooLong, WorkerFailed)
from .messages import FinishReason
from .sampling import SamplingParams
from .sequence import RequestOutput

__all__ = ["BackendUnavailable", "CorrelationMismatch", "EngineConfig", "EngineError", "FinishReason",
           "InvalidRequest", "LLMEngine", "NotReady", "Overloaded", "PromptTooLong", "RequestHandle",
           "RequestOutput", "SamplingParams", "WorkerFailed"]
