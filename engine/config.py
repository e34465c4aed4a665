"""EngineConfig: every engine setting in one dataclass, checked on creation, readable from LOCKSTEP_* variables."""
import os
from dataclasses import dataclass, fields
from pathlib import Path

from .hardware import available_cores

DEFAULT_MODEL = "smollm2"
BACKENDS = ("hf", "vllm", "auto")
POLICIES = ("continuous", "static", "none")
DTYPES = ("bfloat16", "float32", "float16", "auto")  # auto: what the hardware computes (engine/hardware.py)
QUANTIZE = ("none", "q8_0", "q4_0")  # a Hugging Face folder's weights at load (engine/gguf_export.py)
WEIGHTS = ("auto", "q4", "exact")  # auto: a model's own 4-bit GGUF blocks where it has them (q4), else exact
DEVICES = ("cpu", "cuda", "auto")
DISTRIBUTED_EXECUTORS = ("auto", "mp", "ray")  # vLLM's distributed_executor_backend; ray spans nodes
BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
ENFORCE_EAGER = ("auto", "true", "false")  # auto: eager on CPU only (CUDA captures graphs)
# A duration setting's most: a week. Past about 24.8 days a socket's poll (milliseconds in 32 bits) overflows, and
# from about 300 years every timed wait does: a value that starts the server but fails each request or socket.
MAX_SECONDS = 7 * 24 * 3600
MAX_THREADS = 1024  # torch threads in the worker: past the cores it only slows; far past them torch fails


def default_cache_dir() -> str:
    return str(Path(__file__).resolve().parent.parent / ".cache")


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    backend: str = "hf"
    dtype: str = "auto"
    # hf on CPU: `q4` computes a GGUF file's model (the embedded one's among them) on its own blocks, repacked as
    # Q4_1 or Q8_0, with lockstep's 4-bit kernels (engine/backends/q4.py), activations rounded to 8 bits per 32 as
    # llama.cpp's;
    # `exact`, the same kernels on float32 activations (the blocks' own numbers), or for a model without blocks
    # (or a dtype other than float32) the model's own forward in `dtype`; `auto`: q4 where the model has blocks.
    weights: str = "auto"
    # hf on CPU, a Hugging Face folder of a family the 4-bit kernels run (llama, mistral, qwen2, qwen3, gemma3): its
    # weights quantized once into the cache as q8_0 or q4_0 blocks (engine/gguf_export.py), then served as a GGUF
    # file of them is (per `weights`); none: its own weights, on its own forward.
    quantize: str = "none"
    device: str = "auto"
    max_batch_size: int = 16  # 16 clients decode together (at 8 the other 8 queued: docs/benchmarks.md)
    max_queue: int = 256
    # Keys and values of the batch: on the 4-bit path each row holds its own (prompt + max_tokens), so the sum of the
    # rows'; elsewhere rows x the longest row (a padded batch). The default, 16 x 8,192, lets a full batch of the
    # embedded model hold whole contexts (at most ~3 GB on the 4-bit path, resident only as written; 6 GB in the exact
    # mode). hf on CPU lowers it, and the context with it, where the memory left once the model is loaded would not
    # hold it (kv_cache.kv_budget_within).
    max_batch_kv_tokens: int = 131072
    # Model workers that share this host's memory (gunicorn's LOCKSTEP_WORKERS): each takes an equal share of what a
    # memory limit leaves for keys and values.
    model_copies: int = 1
    max_queue_per_client: int = 32  # waiting requests one client (an address, a socket) may hold
    # Samples (n, best_of) one request may ask for: a group takes that many batch slots at once, so a bound
    # well under the batch keeps one request from holding the whole batch (see `sample_limit`).
    max_samples: int = 4
    # echo + logprobs: the most logprob entries (prompt and answer tokens x (top logprobs + 1) x samples, summed
    # over a request's prompts) one response may carry; ~30 bytes of JSON each, so about 7 MB at most.
    max_echo_logprob_entries: int = 250_000
    policy: str = "continuous"
    threads: int = 0  # torch threads in the worker; 0 = all cores but one (see `num_threads`)
    max_model_len: int = 0  # 0 = the model's own context length
    default_max_tokens: int = 256
    max_stop_strings: int = 8
    load_timeout_s: float = 600.0
    step_timeout_s: float = 120.0
    request_timeout_s: float = 600.0  # a request's deadline (a request may ask for less, never more)
    prefill_chunk_tokens: int = 512  # most prompt tokens fed per step
    prefill_step_target_s: float = 0.2  # beside running streams, prompt chunks sized to take about this long
    # hf: greedy output bit-identical to the request run alone, whatever else is in the batch (prompt chunks
    # planned from the prompt alone; on oneDNN's matmuls, decode never at one row); costs about 1-3%
    # (docs/benchmarks.md).
    batch_invariant: bool = True
    # hf, Llama-shaped models: decode steps and prompt chunks run by engine/backends/fast_forward.py (fused
    # projections, no per-module overhead) instead of the model's forward (tests/backends/test_fast_forward.py).
    fast_decode: bool = True
    # hf fast forward, bfloat16, one torch thread, a CPU with AVX512-BF16 and a C compiler: its matmuls, decode
    # attention and norms run on lockstep's kernels (engine/backends/bf16_kernels.c; a step in about half the time)
    # instead of oneDNN's matmuls, whose numbers the model's own forward gives bit for bit. Rounding differs from
    # oneDNN's, accuracy alike (tests/backends/test_bf16_kernels.py).
    bf16_kernel: bool = True
    # On those kernels, decode steps of at most this many rows share their weight matmuls with a helper thread,
    # on the core left to the server (0: never).
    kernel_helper_rows: int = 16
    # Keys and values of past prompts and answers kept for requests that start with the same tokens (the next
    # turn of a chat): hf on the 4-bit path, where a resumed prompt computes the same bits (prefix_cache.py);
    # vLLM: its own automatic prefix caching. At most prefix_cache_tokens positions (hf: ~23 KB each for the
    # embedded model in float16, so ~375 MB at the default; twice that in the exact mode's float32), least
    # recently used first out, and never more than the running rows and prompts leave of max_batch_kv_tokens (the
    # worker's one KV budget).
    prefix_cache: bool = True
    prefix_cache_tokens: int = 16384
    vllm_cpu_batched_tokens: int = 64  # vLLM on CPU: tokens per step (decode + prefill chunks); bounds the gap
    cache_dir: str = ""
    # vLLM only: passed through so one node can use several GPUs.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    distributed_executor: str = "auto"
    enforce_eager: str = "auto"

    def __post_init__(self):
        self.cache_dir = self.cache_dir or default_cache_dir()
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("policy", self.policy, POLICIES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("weights", self.weights, WEIGHTS)
        _check_choice("quantize", self.quantize, QUANTIZE)
        _check_choice("device", self.device, DEVICES)
        _check_choice("distributed_executor", self.distributed_executor, DISTRIBUTED_EXECUTORS)
        _check_choice("enforce_eager", self.enforce_eager, ENFORCE_EAGER)
        check_at_least(self, ("max_batch_size", "max_batch_kv_tokens", "model_copies", "max_queue",
                              "max_queue_per_client", "max_samples", "max_echo_logprob_entries",
                              "default_max_tokens", "max_stop_strings", "prefill_chunk_tokens",
                              "vllm_cpu_batched_tokens", "tensor_parallel_size", "pipeline_parallel_size"))
        check_at_least(self, ("max_model_len", "kernel_helper_rows", "prefix_cache_tokens"), minimum=0)
        if not 0 <= self.threads <= MAX_THREADS:
            raise ValueError(f"{variable('threads')} must be 0 (all cores but one) to {MAX_THREADS}, "
                             f"got {self.threads}")
        if not 0 < self.gpu_memory_utilization <= 1:  # NaN fails too
            raise ValueError(f"{variable('gpu_memory_utilization')} must be a fraction in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        check_seconds(self, ("load_timeout_s", "step_timeout_s", "request_timeout_s", "prefill_step_target_s"))

    @property
    def sample_limit(self) -> int:
        """The most samples one request may ask for: max_samples, never more than a batch or a client's queue."""
        return min(self.max_samples, self.max_batch_size, self.max_queue_per_client)

    @property
    def num_threads(self) -> int:
        """Leave one core to the server process: torch's spinning threads stall badly when they must share
        every core (docs/benchmarks.md, "Measurements behind the code's constants")."""
        return self.threads or max(1, available_cores() - 1)

    @classmethod
    def from_env(cls, environ=os.environ, **overrides) -> "EngineConfig":
        """Read LOCKSTEP_<FIELD> (e.g. LOCKSTEP_MAX_BATCH_SIZE=16); explicit overrides win."""
        return dataclass_from_env(cls, environ, **overrides)


def dataclass_from_env(cls, environ=os.environ, **overrides):
    """A settings dataclass from LOCKSTEP_<FIELD> variables (unset or empty: the field's default), each value
    parsed by the field's type (bool, int, float, str, or a comma list for a tuple); explicit overrides win."""
    values = {}
    for f in fields(cls):
        raw = environ.get(f"LOCKSTEP_{f.name.upper()}")
        if raw is not None and raw != "":
            values[f.name] = _parse(f.type, raw, f.name)
    values.update(overrides)
    return cls(**values)


def _parse(type_name, raw: str, name: str):
    kind = type_name if isinstance(type_name, str) else type_name.__name__
    if kind == "bool":
        if raw.lower() not in BOOLEANS:
            raise ValueError(f"LOCKSTEP_{name.upper()} must be one of {', '.join(BOOLEANS)}, got {raw!r}")
        return BOOLEANS[raw.lower()]
    if kind == "tuple":
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ValueError(f"LOCKSTEP_{name.upper()} must be a number, got {raw!r}") from None
    return raw


def variable(name: str) -> str:
    """A setting as an error names it: the field and the variable that sets it."""
    return f"{name} (LOCKSTEP_{name.upper()})"


def check_at_least(settings, names: tuple[str, ...], minimum: int = 1) -> None:
    """A count setting below `minimum` is refused by name (a queue, a batch or a cap of 0 would serve nobody)."""
    for name in names:
        if getattr(settings, name) < minimum:
            raise ValueError(f"{variable(name)} must be at least {minimum}, got {getattr(settings, name)}")


def check_seconds(settings, names: tuple[str, ...], zero_allowed: bool = False) -> None:
    """A duration setting is a number of seconds above 0 (or 0 where `zero_allowed`) up to MAX_SECONDS; NaN and
    infinity fail."""
    for name in names:
        value = getattr(settings, name)
        if not ((0 <= value if zero_allowed else 0 < value) and value <= MAX_SECONDS):
            low = ">= 0" if zero_allowed else "> 0"
            raise ValueError(f"{variable(name)} must be a number of seconds {low} and at most {MAX_SECONDS} "
                             f"(a week), got {value}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{variable(name)} must be one of {', '.join(choices)}; got {value!r}")
