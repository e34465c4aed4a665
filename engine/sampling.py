"""SamplingParams as the API sees them: validated once, in the parent, before anything is queued."""
import math
from dataclasses import dataclass, field

from .errors import InvalidRequest
from .messages import WorkerSampling

MAX_STOP_LENGTH = 200
MAX_SEED = 2**63 - 1
# Below these, sampling is greedy in all but name (and float32 would round the value to 0): treat it as such,
# as vLLM does for temperature.
GREEDY_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None = the engine's default
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))

    @classmethod
    def from_request(cls, body: dict, max_stop_strings: int = 8) -> "SamplingParams":
        """Build from a JSON body, refusing wrong types and out-of-range values with the field's name."""
        params = cls(
            max_tokens=_optional_int(body, "max_tokens"),
            temperature=_number(body, "temperature", 0.0),
            top_p=_number(body, "top_p", 1.0),
            top_k=_optional_int(body, "top_k") or 0,
            stop=_stop_strings(body.get("stop")),
            seed=_optional_int(body, "seed"),
            ignore_eos=_flag(body, "ignore_eos"),
        )
        params.validate(max_stop_strings)
        return params

    def validate(self, max_stop_strings: int = 8) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0 or math.isnan(self.temperature):
            raise InvalidRequest("temperature must be between 0 and 100", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p must be in (0, 1]", "top_p")
        if self.top_k < 0:
            raise InvalidRequest("top_k must be >= 0 (0 disables it)", "top_k")
        if len(self.stop) > max_stop_strings:
            raise InvalidRequest(f"at most {max_stop_strings} stop strings are allowed", "stop")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise InvalidRequest(f"stop strings must be 1 to {MAX_STOP_LENGTH} characters", "stop")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidRequest("seed must be between 0 and 2**63-1", "seed")

    def for_worker(self, max_tokens: int) -> WorkerSampling:
        """Normalised for the worker: a tiny temperature or top_p means greedy."""
        is_greedy = self.temperature < GREEDY_TEMPERATURE or self.top_p < MIN_TOP_P or self.top_k == 1
        if is_greedy:
            return WorkerSampling(0.0, 1.0, 0, self.seed, max_tokens, self.ignore_eos)
        return WorkerSampling(self.temperature, self.top_p, self.top_k, self.seed, max_tokens, self.ignore_eos)


def _optional_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false", name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number", name)
    try:
        return float(value)
    except OverflowError:
        raise InvalidRequest(f"{name} is out of range", name) from None


def _stop_strings(value) -> str | list[str]:
    if value is None:
        return ()
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        return value  # __post_init__ makes it a tuple
    raise InvalidRequest("stop must be a string or a list of strings", "stop")
