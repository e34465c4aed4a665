"""vLLM backend: one in-process vLLM engine, driven one scheduler step per `step()` call.

vLLM owns batching, the paged KV cache and sampling; this class only translates our messages.
Each request is added with `RequestOutputKind.DELTA`, so every engine step reports just the
token ids it produced. The parent detects EOS and stop strings itself, so no stop strings are
passed; vLLM still stops on EOS by itself, and the EOS id is included in that last delta.
Penalties, logit_bias, min_tokens and logprobs map to vLLM's own SamplingParams (its logprobs are the raw
model's, as the hf backend's). A request's samples (n > 1, best_of) are added as one vLLM request each, with
seeds seed, seed + 1, ... as vLLM's own parallel sampling does (its prefix cache shares the prompt).
"""
import glob
import logging
import os
from pathlib import Path

from ..config import EngineConfig
from ..errors import describe
from ..messages import ModelInfo, eos_ids, NewRequest, PromptLogprobs, StepOutput, TokenLogprob, WorkerSampling
from .base import Backend, resolve_device
from .vllm_patches import allocate_pipeline_buffers, forget_web_context_proxies, undo_dropped_draws_on_cpu

logger = logging.getLogger(__name__)


class VLLMBackend(Backend):
    def __init__(self, config: EngineConfig, model_path: str):
        device = resolve_device(config.device)
        _set_environment(config, device)
        forget_web_context_proxies()
        # vLLM reads its environment variables when imported, so it is imported only now.
        from vllm import LLM

        self.llm = LLM(**_engine_args(config, model_path, device))
        if config.pipeline_parallel_size > 1 and device == "cpu":
            self.llm.collective_rpc(allocate_pipeline_buffers)
        if device == "cpu":
            self.llm.collective_rpc(undo_dropped_draws_on_cpu)
        self.engine = self.llm.llm_engine
        self.running: set[str] = set()  # ids vLLM has not finished; others need no abort
        self.prompt_logprobs: dict[str, list] = {}  # echo: gathered over prefill chunks until the first token
        self.sampling: dict[str, WorkerSampling] = {}  # of the running requests that asked for logprobs
        model_config = self.engine.model_config
        self.info = ModelInfo(
            model=model_path, backend="vllm", dtype=str(model_config.dtype).removeprefix("torch."),
            device=device, max_model_len=model_config.max_model_len,
            eos_token_ids=_eos_token_ids(self.llm), prefix_cache=config.prefix_cache)
        logger.info("vLLM backend: %s on %s, max_model_len %d", self.info.dtype, device,
                    self.info.max_model_len)

    def step(self, new_requests: tuple[NewRequest, ...], finished_ids: tuple[str, ...]) -> StepOutput:
        failed: dict[str, str] = {}
        self._abort(finished_ids)
        for request in new_requests:
            try:
                self._add(request)
            except (ValueError, TypeError) as exc:  # vLLM refused this one request (its params, its length)
                logger.warning("vLLM refused %s: %s", request.request_id, exc)
                self._abort(request.all_sample_ids)
                failed.update(dict.fromkeys(request.all_sample_ids, describe(exc)))
        output = StepOutput(failed=failed)
        if self.engine.has_unfinished_requests():
            self._collect(self.engine.step(), output)
        return output

    def close(self) -> None:
        if self.engine is None:
            return
        self._abort(tuple(self.running))
        self.engine.engine_core.shutdown()
        self.llm = self.engine = None

    def _add(self, request: NewRequest) -> None:
        # Rendered first: vLLM 0.32 deprecates passing a raw prompt dict to add_request.
        prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        engine_input = self.engine.renderer.render_cmpl([prompt])[0]
        for index, sample_id in enumerate(request.all_sample_ids):
            self.engine.add_request(sample_id, engine_input, _sampling_params(request.sampling, index))
            self.running.add(sample_id)
            if request.sampling.logprobs is not None or request.sampling.prompt_logprobs is not None:
                self.sampling[sample_id] = request.sampling

    def _abort(self, finished_ids: tuple[str, ...]) -> None:
        for request_id in finished_ids:
            self._forget(request_id)
        request_ids = [request_id for request_id in finished_ids if request_id in self.running]
        if request_ids:
            self.engine.abort_request(request_ids)
            self.running.difference_update(request_ids)

    def _collect(self, outputs: list, step: StepOutput) -> None:
        # A request still in (chunked) prefill has no new tokens this step (maybe prompt logprobs).
        for output in outputs:
            request_id, sample = output.request_id, output.outputs[0]
            if output.prompt_logprobs:
                self.prompt_logprobs.setdefault(request_id, []).extend(output.prompt_logprobs)
            if sample.token_ids:
                if request_id not in step.cached_tokens and output.num_cached_tokens is not None:
                    step.cached_tokens[request_id] = output.num_cached_tokens
                step.new_token_ids[request_id] = tuple(sample.token_ids)
                self._collect_logprobs(request_id, output, step)
            if output.finished:
                self.running.discard(request_id)
                self._forget(request_id)

    def _collect_logprobs(self, request_id: str, output, step: StepOutput) -> None:
        sampling, sample = self.sampling.get(request_id), output.outputs[0]
        if sampling is None:
            return
        if sample.logprobs is not None:
            step.logprobs[request_id] = tuple(_entry(token_id, logprobs, sampling.logprobs)
                                              for token_id, logprobs in zip(sample.token_ids, sample.logprobs))
        if request_id in self.prompt_logprobs:
            step.prompt_logprobs[request_id] = PromptLogprobs.of(
                None if logprobs is None else _entry(token_id, logprobs, sampling.prompt_logprobs)
                for token_id, logprobs in zip(output.prompt_token_ids, self.prompt_logprobs.pop(request_id)))

    def _forget(self, request_id: str) -> None:
        self.prompt_logprobs.pop(request_id, None)
        self.sampling.pop(request_id, None)


def _entry(token_id: int, logprobs: dict, num_top: int) -> TokenLogprob:
    """vLLM's {token id: Logprob(logprob, rank)}: the top `num_top`, plus the chosen token wherever it ranks."""
    top = sorted(logprobs.items(), key=lambda item: item[1].rank)[:num_top]
    return TokenLogprob(token_id, logprobs[token_id].logprob, tuple((i, p.logprob) for i, p in top))


def _sampling_params(sampling: WorkerSampling, sample_index: int = 0):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # temperature 0 makes vLLM greedy; top_k 0 means "disabled" in vLLM too.
    return SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        seed=None if sampling.seed is None else (sampling.seed + sample_index) % 2**63,
        max_tokens=sampling.max_tokens, ignore_eos=sampling.ignore_eos, detokenize=False,
        output_kind=RequestOutputKind.DELTA, structured_outputs=_structured_outputs(sampling),
        presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty, logit_bias=dict(sampling.logit_bias) or None,
        min_tokens=sampling.min_tokens, logprobs=sampling.logprobs, prompt_logprobs=sampling.prompt_logprobs)


def _structured_outputs(sampling: WorkerSampling):
    """JSON mode: vLLM's own structured outputs, with the schema text the hf backend compiles (its
    `x-guidance` options give both the same grammar: see engine/response_format.py)."""
    if sampling.json_schema is None and sampling.lark_grammar is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if sampling.lark_grammar is not None:  # tool calls: llguidance's Lark, which vLLM's guidance backend reads
        return StructuredOutputsParams(grammar=sampling.lark_grammar)
    return StructuredOutputsParams(json=sampling.json_schema)


def _engine_args(config: EngineConfig, model_path: str, device: str) -> dict:
    args = dict(
        model=model_path, dtype=config.dtype, enforce_eager=_enforce_eager(config, device), seed=0,
        max_model_len=config.max_model_len or None, max_num_seqs=config.max_batch_size,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        disable_log_stats=True, enable_prefix_caching=config.prefix_cache,
        structured_outputs_config={"backend": "guidance"})  # llguidance, as on the hf backend (constrained.py)
    if config.distributed_executor != "auto":
        args["distributed_executor_backend"] = config.distributed_executor
    if device == "cpu":
        # vLLM's own CPU default lets one long prompt take a whole step, stalling the running streams for seconds;
        # our prefill budget per step keeps the gap bounded, as on the hf backend.
        args.update(enable_chunked_prefill=True,
                    max_num_batched_tokens=max(config.max_batch_size, config.vllm_cpu_batched_tokens))
    if device == "cuda":
        # On CPU this flag means a share of host RAM; VLLM_CPU_KVCACHE_SPACE sizes the cache there.
        args["gpu_memory_utilization"] = config.gpu_memory_utilization
    return args


def _enforce_eager(config: EngineConfig, device: str) -> bool:
    """Eager on CPU (the compiled bf16 path gives wrong text there and costs 60-90 s per start); on CUDA vLLM
    captures graphs, which is most of its decode speed, unless LOCKSTEP_ENFORCE_EAGER says otherwise."""
    if config.enforce_eager != "auto":
        return config.enforce_eager == "true"
    return device == "cpu"


def _set_environment(config: EngineConfig, device: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    # The engine core runs in this process (faster, one process fewer); with tensor/pipeline parallel it
    # starts vLLM's workers as our children (see executor._fork_worker).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(config.cache_dir) / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(config.cache_dir) / "torchinductor"))
    if device == "cpu":
        # GiB of KV cache; unset, vLLM would reserve gpu_memory_utilization (0.9) of all host RAM.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        _bind_cpu_workers(num_model_workers(config))


def _bind_cpu_workers(num_workers: int) -> None:
    """Give each of vLLM's CPU workers cores of its own. vLLM binds one worker per NUMA node by itself and
    refuses more workers than nodes; on fewer nodes, split the allowed cores evenly (e.g. "0|1")."""
    if num_workers < 2 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return
    if numa_node_count() >= num_workers:
        return
    binding = split_cores(sorted(os.sched_getaffinity(0)), num_workers)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
    logger.info("VLLM_CPU_OMP_THREADS_BIND=%s (one core group per vLLM worker)", binding)


def split_cores(cores: list[int], num_workers: int) -> str:
    """["0,1", "2,3"] style groups joined by "|": as many groups as workers, the same size each."""
    per_worker = len(cores) // num_workers
    groups = [cores[i * per_worker:(i + 1) * per_worker] for i in range(num_workers)]
    return "|".join(",".join(str(core) for core in group) for group in groups)


def numa_node_count() -> int:
    return len(glob.glob("/sys/devices/system/node/node[0-9]*")) or 1


def num_model_workers(config: EngineConfig) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size


def _eos_token_ids(llm) -> tuple[int, ...]:
    return eos_ids(llm.get_tokenizer().eos_token_id,
                   llm.llm_engine.model_config.try_get_generation_config().get("eos_token_id"))
