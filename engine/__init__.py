"""lockstep's engine: a thread-safe front to one forked model worker. The app imports only from here.

    engine = LLMEngine(EngineConfig(model="smollm2")).start()
    for text in engine.submit("Hello", SamplingParams(max_tokens=32)):
        ...
"""
from .config import EngineConfig, dataclass_from_env
from .detokenizer import TokenTexts
from .engine import LLMEngine, RequestHandle
from .errors import (BackendUnavailable, CorrelationMismatch, DeadlineExceeded, EngineError, InvalidRequest, NotReady,
                     Overloaded, PromptTooLong, RequestFailed, ShuttingDown, WorkerBusy, WorkerFailed)
from .inputs import check_encodable
from .messages import FinishReason, PromptLogprobs, TokenLogprob
from .model_store import ModelNotFound, UnsupportedModel
from .output_processor import RequestObserver
from .outputs import DeltaEvent, RequestOutput, Usage
from .preprocess import MAX_CACHE_SALT_CHARS
from .response_format import MAX_NAME_LENGTH as MAX_SCHEMA_NAME_LENGTH
from .sampling import (MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_PENALTY, MAX_SEED, MAX_STOP_LENGTH,
                       MIN_SEED, REPETITION_PENALTY_RANGE, SamplingParams)

__all__ = ["BackendUnavailable", "CorrelationMismatch", "DeadlineExceeded", "DeltaEvent", "EngineConfig",
           "EngineError", "FinishReason", "InvalidRequest", "LLMEngine", "MAX_CACHE_SALT_CHARS", "MAX_LOGIT_BIAS",
           "MAX_LOGIT_BIAS_ENTRIES", "MAX_LOGPROBS", "MAX_PENALTY", "MAX_SCHEMA_NAME_LENGTH", "MAX_SEED",
           "MAX_STOP_LENGTH", "MIN_SEED", "ModelNotFound", "NotReady", "Overloaded", "PromptLogprobs", "PromptTooLong",
           "REPETITION_PENALTY_RANGE", "RequestFailed", "RequestHandle", "RequestObserver", "RequestOutput",
           "SamplingParams", "ShuttingDown", "TokenLogprob", "TokenTexts", "UnsupportedModel", "Usage", "WorkerBusy",
           "WorkerFailed",
           "check_encodable", "dataclass_from_env"]
