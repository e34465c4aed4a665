"""lockstep's bfloat16 matmul kernel (engine/backends/bf16_kernels.c, native.py): built with the machine's compiler,
within bfloat16's rounding of the exact product on the model's own weights, each row the same alone as in any batch,
the fast forward on it as accurate as on oneDNN's matmul, and every way it can be unavailable falls back to oneDNN."""
import logging
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from engine.backends import native
from engine.backends.fast_decode import FastDecoder
from engine.backends.hf import HFBackend
from engine.backends.kv_cache import use_slot_attention
from engine.config import EngineConfig, default_cache_dir

PROMPTS = ["The capital of France is", "Write a short paragraph about the ocean. The ocean is",
           "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived a"]


@pytest.fixture(scope="module")
def kernel():
    loaded = native.load_bf16_kernels(default_cache_dir())
    assert loaded is not None, "this machine (AVX512-BF16, a C compiler) should run the kernel; see the log"
    return loaded


def load(model_dir: str, dtype: torch.dtype):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    assert use_slot_attention(model)
    return model


def exact_bound(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product, and how far a float32-accumulated, bfloat16-rounded result may be from it."""
    exact = x.double() @ weight.double().T
    return exact, exact.abs() * 2 ** -8 + (x.double().abs() @ weight.double().abs().T) * 2 ** -20


@torch.inference_mode()
def test_every_weight_shape_of_the_model_within_bfloat16_rounding_and_each_row_alone_as_in_a_batch(
        kernel, smol_model_dir):
    model = load(smol_model_dir, torch.bfloat16)
    layer = model.model.layers[3]
    weights = {"q": layer.self_attn.q_proj.weight, "k": layer.self_attn.k_proj.weight,
               "gate": layer.mlp.gate_proj.weight, "down": layer.mlp.down_proj.weight,
               "lm_head": model.lm_head.weight[:4096]}
    generator = torch.Generator().manual_seed(1)
    for name, weight in weights.items():
        packed = kernel.pack(weight)
        x = torch.randn(40, weight.shape[1], generator=generator).to(torch.bfloat16)
        together = kernel.linear(x, packed)
        exact, bound = exact_bound(x, weight)
        assert ((together.double() - exact).abs() <= bound).all(), name
        for rows in (1, 2, 7, 8, 9, 17, 33):  # inside one pass of 8 rows, across passes, a ragged last pass
            assert torch.equal(kernel.linear(x[:rows], packed), together[:rows]), (name, rows)
        assert torch.equal(kernel.linear(x[5:6], packed), together[5:6]), name


def test_it_refuses_inputs_it_cannot_read(kernel):
    packed = kernel.pack(torch.ones(64, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        kernel.linear(torch.ones(2, 16), packed)
    assert not kernel.supports(torch.ones(48, 16, dtype=torch.bfloat16))  # columns not a multiple of 32
    assert not kernel.supports(torch.ones(64, 15, dtype=torch.bfloat16))  # odd depth
    assert not kernel.supports(torch.ones(64, 16))  # float32


@torch.inference_mode()
def test_the_fast_forward_on_the_kernel_is_as_accurate_as_on_onednn(kernel, smol_model_dir):
    """Against the float32 model: the same top token, and logits about as far off as oneDNN's bfloat16 ones."""
    tokenizer = AutoTokenizer.from_pretrained(smol_model_dir)
    reference = load(smol_model_dir, torch.float32)
    on_kernel = FastDecoder(load(smol_model_dir, torch.bfloat16), kernel)
    on_onednn = FastDecoder(load(smol_model_dir, torch.bfloat16))
    assert on_kernel.kernel is kernel and on_onednn.kernel is None
    for text in PROMPTS:
        token_ids = torch.tensor(tokenizer(text)["input_ids"])
        exact = reference(token_ids[None]).logits[0, -1]
        errors = {}
        for name, decoder in (("kernel", on_kernel), ("onednn", on_onednn)):
            logits = decoder.prefill(token_ids, 0, DynamicCache(config=reference.config)).float()
            assert int(logits.argmax()) == int(exact.argmax()), (name, text)
            errors[name] = float((logits - exact).abs().max())
        assert errors["kernel"] < 2 * errors["onednn"] + 0.25, (text, errors)


@torch.inference_mode()
def test_the_backend_decodes_on_the_kernel_by_default_here(smol_model_dir):
    threads = torch.get_num_threads()
    backend = HFBackend(EngineConfig(model=smol_model_dir, dtype="bfloat16", device="cpu", threads=1),
                        smol_model_dir)
    assert backend.fast_decoder is not None and backend.fast_decoder.kernel is not None
    assert all(layer.qkv.kernel is not None for layer in backend.fast_decoder.layers)
    backend.close()
    with_two_threads = HFBackend(EngineConfig(model=smol_model_dir, dtype="bfloat16", device="cpu", threads=2),
                                 smol_model_dir)
    assert with_two_threads.fast_decoder.kernel is None  # a one-core kernel: oneDNN spreads over the threads
    with_two_threads.close()
    torch.set_num_threads(threads)


def test_a_kernel_that_computes_wrong_numbers_is_not_used(monkeypatch, caplog, smol_model_dir):
    monkeypatch.setattr(native.Bf16Kernels, "computes_correctly", lambda self: False)
    with caplog.at_level(logging.WARNING, logger="engine.backends.native"):
        assert native.load_bf16_kernels(default_cache_dir()) is None
    assert "wrong numbers" in caplog.text
    backend = HFBackend(EngineConfig(model=smol_model_dir, dtype="bfloat16", device="cpu", threads=1),
                        smol_model_dir)
    assert backend.fast_decoder is not None and backend.fast_decoder.kernel is None
    backend.close()


def test_no_kernel_without_the_cpu_instructions_or_a_working_compiler(monkeypatch, caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger="engine.backends.native"):
        monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx2", "avx512f"})
        assert native.load_bf16_kernels(str(tmp_path)) is None
        assert "lacks avx512_bf16, avx512bw, avx512vl" in caplog.text
        monkeypatch.undo()
        monkeypatch.setenv("CC", "false")  # a compiler that fails
        assert native.load_bf16_kernels(str(tmp_path)) is None
        assert "could not build" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left to load later


def test_processes_that_build_it_at_once_all_load_it(tmp_path):
    """gunicorn workers and test processes may start together on an empty cache folder."""
    script = ("import sys; from engine.backends import native; "
              "sys.exit(0 if native.load_bf16_kernels(sys.argv[1]) is not None else 1)")
    builders = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)]) for _ in range(4)]
    assert [builder.wait(timeout=180) for builder in builders] == [0, 0, 0, 0]
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1
    assert not [path for path in (tmp_path / "kernels").iterdir() if path.is_dir()]  # no build folders left
