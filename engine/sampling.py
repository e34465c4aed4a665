"""SamplingParams as the API sees them: validated once, in the parent, before anything is queued."""
import math
from dataclasses import dataclass, field

from .errors import InvalidRequest
from .messages import WorkerSampling
from .response_format import parse_response_format, refuse_conflicts

MAX_STOP_LENGTH = 200
MIN_SEED, MAX_SEED = -2**63, 2**63 - 1  # a signed 64-bit integer, as vLLM's server takes
# Below these, sampling is greedy in all but name (and float32 would round the value to 0): treat it as such,
# as vLLM does for temperature.
GREEDY_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6
MAX_PENALTY = 2.0  # presence and frequency, as OpenAI
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # vLLM only asks > 0; past these float32 turns a logit into 0 or inf
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGPROBS = 20  # top logprobs per position, as OpenAI's chat API and vLLM's default max_logprobs


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None = the engine's default
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False
    response_format: str | None = None  # JSON mode: the checked schema text (engine/response_format.py)
    tool_grammar: str | None = None  # tool calls: the calls' checked Lark grammar (engine/tool_calls.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a {id: bias} dict is taken too
    min_tokens: int = 0
    logprobs: int | None = None  # None = none; k = each token's logprob and the k most likely there
    echo: bool = False  # the prompt comes back before the answer (with its logprobs when `logprobs` is set)
    n: int = 1  # samples returned
    best_of: int | None = None  # samples generated (>= n); the n with the highest cumulative logprob return

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def num_samples(self) -> int:
        """How many samples the worker generates for this request (prompt only: n, as nothing is there to rank)."""
        return self.n if self.is_prompt_only else self.best_of or self.n

    @classmethod
    def from_request(cls, body: dict, max_stop_strings: int = 8,
                     max_output_chars: int | None = None) -> "SamplingParams":
        """Build from a JSON body, refusing wrong types and out-of-range values with the field's name.
        `max_output_chars`: the most characters any answer can hold (bounds JSON-mode schemas' counts)."""
        params = cls(
            max_tokens=_optional_int(body, "max_tokens"),
            temperature=_number(body, "temperature", 0.0),
            top_p=_number(body, "top_p", 1.0),
            top_k=_optional_int(body, "top_k") or 0,
            stop=_stop_strings(body.get("stop")),
            seed=_optional_int(body, "seed"),
            ignore_eos=_flag(body, "ignore_eos"),
            response_format=parse_response_format(body.get("response_format"), max_output_chars),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            logit_bias=_logit_bias(body.get("logit_bias")),
            min_tokens=_optional_int(body, "min_tokens") or 0,
            logprobs=_logprobs(body),
            echo=_flag(body, "echo"),
            n=_int(body, "n", 1),
            best_of=_optional_int(body, "best_of"),
        )
        params.validate(max_stop_strings)
        return params

    def validate(self, max_stop_strings: int = 8) -> None:
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            raise InvalidRequest("max_tokens must be at least 1 (0 only with echo on /v1/completions: the prompt "
                                 "alone, nothing generated)", "max_tokens")
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
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise InvalidRequest("seed must be a signed 64-bit integer (-2**63 to 2**63-1)", "seed")
        if self.response_format is not None:
            refuse_conflicts(self.stop, self.ignore_eos, self.min_tokens)
        self._validate_processors()
        self._validate_samples()

    def _validate_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:  # NaN fails every comparison
                raise InvalidRequest(f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}", name)
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise InvalidRequest(f"repetition_penalty must be between {low:g} and {high:g} (1 = off)",
                                 "repetition_penalty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens", "logit_bias")
        for token_id, bias in self.logit_bias:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise InvalidRequest("logit_bias keys must be token ids (non-negative integers)", "logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                    or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequest(f"logit_bias values must be numbers between -{MAX_LOGIT_BIAS:g} and "
                                     f"{MAX_LOGIT_BIAS:g}", "logit_bias")
        if self.min_tokens < 0:
            raise InvalidRequest("min_tokens must be >= 0", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens must be at most max_tokens", "min_tokens")

    def _validate_samples(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}", "logprobs")
        if self.n < 1:
            raise InvalidRequest("n must be at least 1", "n")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequest("best_of must be at least n", "best_of")

    def check_vocabulary(self, vocab_size: int) -> None:
        """logit_bias ids must name tokens of this model's vocabulary."""
        outside = next((token_id for token_id, _ in self.logit_bias if token_id >= vocab_size), None)
        if outside is not None:
            raise InvalidRequest(f"logit_bias names token {outside}, outside the vocabulary (ids 0 to "
                                 f"{vocab_size - 1})", "logit_bias")

    @property
    def is_prompt_only(self) -> bool:
        """echo with max_tokens 0 (OpenAI's way to score a text): the prompt and its logprobs, nothing generated."""
        return self.echo and self.max_tokens == 0

    def for_worker(self, max_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> WorkerSampling:
        """Normalised for the worker: a tiny temperature or top_p means greedy. `stop_token_ids` (the EOS set)
        are what min_tokens holds back. best_of ranks samples by their logprobs, so the worker sends them."""
        is_greedy = self.temperature < GREEDY_TEMPERATURE or self.top_p < MIN_TOP_P or self.top_k == 1
        draw = (0.0, 1.0, 0) if is_greedy else (self.temperature, self.top_p, self.top_k)
        min_tokens = min(self.min_tokens, max_tokens)
        logprobs = 0 if self.logprobs is None and self.num_samples > self.n else self.logprobs
        return WorkerSampling(
            *draw, self.seed, max_tokens, self.ignore_eos, json_schema=self.response_format,
            lark_grammar=self.tool_grammar,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple((token_id, float(bias)) for token_id, bias in self.logit_bias),
            min_tokens=min_tokens, stop_token_ids=stop_token_ids if min_tokens else (),
            logprobs=logprobs, prompt_logprobs=self.logprobs if self.echo else None)


def _optional_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer", name)
    return value


def _int(body: dict, name: str, default: int) -> int:
    value = _optional_int(body, name)
    return default if value is None else value


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


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} as OpenAI sends it (JSON keys are strings)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids to biases", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:  # before parsing a huge object key by key
        raise InvalidRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens", "logit_bias")
    pairs = []
    for key, bias in value.items():
        text = str(key)
        # canonical ids only: "05" beside "5" would bias one token twice here and once on vLLM (a dict)
        if not (text.isascii() and text.isdigit()) or len(text) > 12 or text != str(int(text)):
            raise InvalidRequest(f"logit_bias keys must be token ids; got {text[:40]!r}", "logit_bias")
        pairs.append((int(text), bias))
    return tuple(pairs)


def _logprobs(body: dict) -> int | None:
    """Chat: `logprobs: true` and `top_logprobs: k`. Completions: `logprobs: k`. Both are read everywhere."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise InvalidRequest("top_logprobs must be an integer", "top_logprobs")
    if value is None or value is False:
        if top:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    if value is True:
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", "top_logprobs")
        return top or 0
    if not isinstance(value, int):
        raise InvalidRequest("logprobs must be true/false or a number of top logprobs", "logprobs")
    if top is not None:
        raise InvalidRequest("give top_logprobs with logprobs: true, not with a number", "top_logprobs")
    return value
