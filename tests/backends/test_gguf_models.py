"""A user's own GGUF file: refused at start in one line when lockstep will not serve it, and otherwise prepared
once and served, in every family, as exactly the weights its blocks hold (a Hugging Face folder of the same
weights, tests/gguf_models.py, is the reference)."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app import STARTUP_FAILURE_EXIT_CODE, create_app
from engine import EngineConfig, SamplingParams
from engine.gguf_export import quantized_path
from engine.gguf_file import InvalidGGUF, read_gguf
from engine.model_store import SOURCE_RECORD, UnsupportedModel, prepared_dir, prepared_model, resolve_model

from ..client import http
from ..torch_jobs import REPO, run_job

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
PROMPTS = ([1, 504, 3575, 282, 4649, 314], [1, 19556, 665], [28, 216, 29, 216, 30])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def family_files(tmp_path_factory, smol_model_dir) -> dict[str, dict]:
    """Each family's file (every block type among its projections) and its reference folder."""
    target = tmp_path_factory.mktemp("gguf")
    return run_job("build_gguf_models", target=str(target), families=FAMILIES, tokenizer_dir=smol_model_dir,
                   add_bos_to=["qwen2"], prompts=PROMPTS)


# -- a file lockstep will not serve ------------------------------------------------------------------------------

def _string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _header(fields: list[bytes], tensors: list[bytes], num_tensors: int | None = None, version: int = 3) -> bytes:
    count = len(tensors) if num_tensors is None else num_tensors
    return b"GGUF" + struct.pack("<IQQ", version, count, len(fields)) + b"".join(fields) + b"".join(tensors)


def _field_string(key: str, value: str) -> bytes:
    return _string(key) + struct.pack("<I", 8) + _string(value)


def _tensor(name: str, shape: tuple[int, ...], type_id: int = 0, offset: int = 0) -> bytes:
    return _string(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape) + \
        struct.pack("<IQ", type_id, offset)


ARCH = _field_string("general.architecture", "llama")
BAD_FILES = {
    "not a GGUF": (b"<html>a download page, not a model</html>" * 4, "is not a GGUF file"),
    "an old version": (_header([ARCH], [], version=1), "version 1"),
    "a truncated header": (_header([ARCH, _field_string("general.name", "x" * 100)], [])[:60], "a truncated file"),
    "a 10 MB string": (_header([_string("general.name") + struct.pack("<IQ", 8, 10 << 20)], []),
                       "10,485,760 bytes long"),
    "a million-entry vocabulary": (_header([ARCH, _string("tokenizer.ggml.tokens") +
                                            struct.pack("<IIQ", 9, 8, 1_000_000)], []), "1,000,000 entries"),
    "a billion tensors": (_header([ARCH], [], num_tensors=1 << 30), "1,073,741,824 tensors"),
    "absurd dimensions": (_header([ARCH], [_tensor("token_embd.weight", (1 << 40, 1 << 40))]), "has the shape"),
    "a tensor past the end": (_header([ARCH], [_tensor("token_embd.weight", (64, 64), offset=1 << 30)]),
                              "ends past the file"),
    "an IQ type": (_header([ARCH], [_tensor("token_embd.weight", (256, 4), type_id=23)]),
                   "token_embd.weight is IQ4_XS, which lockstep does not read (it reads F32, F16, Q4_0"),
    "another architecture": (_header([_field_string("general.architecture", "mamba")], []),
                             "architecture 'mamba' is not one lockstep serves (it serves llama, qwen2, qwen3, "
                             "gemma3)"),
    "no head count": (_header([ARCH, _string("llama.embedding_length") + struct.pack("<II", 4, 64)], []),
                   "the field llama.attention.head_count is missing"),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_a_file_lockstep_will_not_serve_is_refused_in_one_line(tmp_path, kind):
    content, expected = BAD_FILES[kind]
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(InvalidGGUF) as refused:
        read_gguf(str(path))
    message = str(refused.value)
    assert expected in message and "\n" not in message and str(path) in message


def _u32(key: str, value: int) -> bytes:
    return _string(key) + struct.pack("<II", 4, value)


SHAPE_FIELDS = [ARCH, _u32("llama.block_count", 1), _u32("llama.embedding_length", 64),
                _u32("llama.attention.head_count", 4), _u32("llama.feed_forward_length", 128),
                _string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + _string("a") + _string("b")]


def test_the_reader_reads_what_gguf_py_reads(family_files):
    """engine/gguf_file.py's metadata and tensors (bytes in place) against gguf-py's own reader, on the embedded
    model's file and a file of every block type."""
    from gguf import GGUFReader

    from engine.model_store import find_gguf

    for path in (str(find_gguf()), family_files["llama"]["gguf"]):
        ours, theirs = read_gguf(path), GGUFReader(path)
        assert list(ours.tensors) == [tensor.name for tensor in theirs.tensors]
        for tensor in theirs.tensors:
            mine = ours.tensors[tensor.name]
            assert (mine.type_name, mine.shape) == (tensor.tensor_type.name, tuple(int(d) for d in tensor.shape))
            assert bytes(ours.tensor_data(tensor.name)) == np.ascontiguousarray(tensor.data).tobytes()
        assert ours.metadata["tokenizer.ggml.tokens"] == theirs.fields["tokenizer.ggml.tokens"].contents()
        assert ours.metadata["tokenizer.chat_template"] == theirs.fields["tokenizer.chat_template"].contents()


@pytest.mark.parametrize("tensors, expected", [
    ([_tensor("token_embd.weight", (64, 100))], "tensor output_norm.weight is missing (architecture llama)"),
    ([_tensor("token_embd.weight", (64, 100)), _tensor("output_norm.weight", (32,), offset=25600)],
     "tensor output_norm.weight has the shape [32], llama with these hyperparameters reads [64]"),
    ([_tensor("token_embd.weight", (64, 1))], "the tokenizer has 2 tokens, the embedding 1 rows")])
def test_a_tensor_the_architecture_does_not_read_as_it_is_is_refused(tmp_path, tensors, expected):
    path = tmp_path / "model.gguf"
    header = _header(SHAPE_FIELDS, tensors)
    path.write_bytes(header + bytes(-len(header) % 32) + bytes(64 * 100 * 4 + 128))
    with pytest.raises(InvalidGGUF) as refused:
        read_gguf(str(path))
    assert str(refused.value) == f"{path}: {expected}"


def test_a_file_cut_short_is_refused(family_files, tmp_path):
    good = read_gguf(family_files["llama"]["gguf"])
    assert good.architecture == "llama" and good.type_counts()["Q4_K"] >= 1
    cut = tmp_path / "cut.gguf"
    data = Path(family_files["llama"]["gguf"]).read_bytes()
    cut.write_bytes(data[:len(data) - 1000])  # the last tensor's bytes cut short
    with pytest.raises(InvalidGGUF, match="ends past the file's"):
        read_gguf(str(cut))


def test_the_server_and_the_prepare_command_stop_with_one_line(tmp_path, cache_dir, caplog):
    bad = tmp_path / "iq.gguf"
    bad.write_bytes(BAD_FILES["an IQ type"][0])
    with pytest.raises(SystemExit) as stopped:
        create_app({"ENGINE": EngineConfig(model=str(bad), cache_dir=cache_dir)})
    assert stopped.value.code == STARTUP_FAILURE_EXIT_CODE
    [line] = [r.message for r in caplog.records if r.levelname == "CRITICAL"]
    assert line.startswith("lockstep cannot start: ") and "is IQ4_XS, which lockstep does not read" in line
    done = subprocess.run([sys.executable, "-m", "engine.prepare_model", "--gguf", str(bad), "--cache-dir", cache_dir],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "IQ4_XS" in done.stderr and "Traceback" not in done.stderr
    with pytest.raises(UnsupportedModel, match="is not a regular file"):
        prepared_model(str(tmp_path), cache_dir)


# -- a file lockstep serves --------------------------------------------------------------------------------------

def _greedy(make_engine, model: str, cache_dir: str) -> tuple[list[tuple[int, ...]], object]:
    engine = make_engine(model, cache_dir=cache_dir)
    outputs = [engine.submit(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=8, temperature=0,
                                                                              ignore_eos=True)).result(120)
               for prompt in PROMPTS]
    return [output.output_token_ids for output in outputs], engine.info


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_computes_its_blocks_as_the_same_weights_in_a_folder(family_files, family, make_engine,
                                                                          cache_dir):
    """Architecture, hyperparameters and every block type read as llama.cpp writes them (q/k rows permuted for
    llama, Gemma's norms as 1 + w, Qwen2's biases, Qwen3's and Gemma's q/k norms, Gemma's sliding window, tied
    and untied embeddings): the served file's greedy tokens are the reference folder's own generate's."""
    files = family_files[family]
    served, info = _greedy(make_engine, files["gguf"], cache_dir)
    assert served == [tuple(tokens) for tokens in files["greedy"]]  # the folder's model.generate
    assert len({tokens for tokens in served}) == len(PROMPTS)  # the prompts steer the model: a real comparison
    types = dict(info.weight_types)
    assert info.architecture == family and {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q8_0", "BF16"} <= set(types)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_1", "Q5_K", "Q6_K", "F16", "BF16",
                                       "F32"])
def test_every_block_type_reaches_the_4_bit_kernels_with_its_values(family_files, type_name):
    """block_repack.py against gguf-py's own dequantization of the file's blocks: Q4_1, Q8_0, Q4_0 and Q5_0 exactly,
    Q4_K but for its scales' rounding to float16, the rest within Q8_0's rounding."""
    from gguf import GGMLQuantizationType, quants

    from engine.backends.block_repack import FORMAT_Q4_1, KEPT, kernel_blocks

    gguf = read_gguf(family_files["llama"]["gguf"])
    [tensor] = [t for t in gguf.tensors.values() if t.type_name == type_name and len(t.shape) == 2][:1]
    stored = quants.dequantize(gguf.tensor_data(tensor.name), GGMLQuantizationType[type_name])
    format_, blocks = kernel_blocks(type_name, gguf.tensor_data(tensor.name), tensor.shape[1])
    read = quants.dequantize(blocks, GGMLQuantizationType["Q4_1" if format_ == FORMAT_Q4_1 else "Q8_0"])
    error = np.abs(read.reshape(stored.shape) - stored).reshape(-1, 32)
    block_max = np.abs(stored).reshape(-1, 32).max(axis=1, keepdims=True)
    if type_name == "Q4_K":
        # a q - b (q < 16), a and b each within half a float16 step: 2^-11 (15 a + b), and 15 a + b is at most
        # 3 block maxima (2^-25 a step below float16's normal range)
        assert format_ == FORMAT_Q4_1 and (error <= 3 * 2.0 ** -11 * block_max + 16 * 2.0 ** -25).all()
    elif type_name in KEPT:
        assert (error == 0).all()
    else:
        # half a step of d = max / 127, and d's own rounding to float16 for up to 127 steps (2^-11 d, or 2^-25
        # below float16's normal range)
        assert (error <= block_max / 127 * (0.5 + 127 * 2.0 ** -11) + 127 * 2.0 ** -25).all() and error.max() > 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_a_file_of_every_type_runs_on_the_4_bit_kernels(family_files, family, make_engine, cache_dir):
    """The file's blocks repacked (llama's q/k rows permuted back, q/k/v of two formats fused as Q8_0, a lone Q6_K
    weight as its own blocks where the kernels interleave, llama's untied token embedding, Qwen2's q/k/v biases,
    Qwen3's q/k norms, Gemma 3's GeGLU, output norms, embedding scale, local rotary and 8-position sliding windows):
    with float32 activations, the kernels' greedy tokens are the float32 model's on the same weights."""
    files = family_files[family]
    engine = make_engine(files["gguf"], cache_dir=cache_dir, dtype="auto", weights="exact")
    # a lone Q6_K projection kept as the file's blocks where the kernels interleave (Q6_K_X8), else Q8_0
    formats = "q4_1+q6_k+q8_0" if "interleaved by 8 rows" in engine.info.compute else "q4_1+q8_0"
    assert engine.info.weights == formats and "4-bit kernels" in engine.info.compute
    served = [engine.submit(prompt_token_ids=list(prompt), sampling=SamplingParams(max_tokens=8, temperature=0,
                                                                                   ignore_eos=True)).result(120)
              .output_token_ids for prompt in PROMPTS]
    expected = run_job("same_blocks_greedy", model_dir=str(prepared_dir(files["gguf"], cache_dir)),
                       gguf=files["gguf"], prompts=PROMPTS, num_tokens=8)
    assert served == [tuple(tokens) for tokens in expected]


@pytest.mark.parametrize("family, quantize", [("llama", "q8_0"), ("qwen2", "q4_0"), ("qwen3", "q8_0"),
                                              ("gemma3", "q4_0")])
def test_a_folder_quantized_at_load_runs_on_the_kernels_as_its_blocks(family_files, family, quantize, make_engine,
                                                                     cache_dir):
    """A Hugging Face folder of each family with quantize set: its weights written once as blocks into the cache
    (engine/gguf_export.py, as convert_hf_to_gguf lays them out) and served by the same decoder as a GGUF file, the
    per-row KV cache and the prefix cache with it; with float32 activations its greedy tokens are the float32
    model's on those very blocks."""
    reference = family_files[family]["reference"]
    engine = make_engine(reference, cache_dir=cache_dir, dtype="auto", weights="exact", quantize=quantize)
    info = engine.info
    assert "4-bit kernels" in info.compute and info.kv_per_row and info.prefix_cache
    assert f"quantize={quantize}" in info.compute_reason
    blocks = quantized_path(reference, quantize, cache_dir)
    written = blocks.stat().st_mtime_ns
    served = [engine.submit(prompt_token_ids=list(prompt), sampling=SamplingParams(max_tokens=8, temperature=0,
                                                                                   ignore_eos=True)).result(120)
              .output_token_ids for prompt in PROMPTS]
    expected = run_job("same_blocks_greedy", model_dir=reference, gguf=str(blocks), prompts=PROMPTS, num_tokens=8)
    assert served == [tuple(tokens) for tokens in expected] and len(set(served)) == len(PROMPTS)
    engine.shutdown()
    again = make_engine(reference, cache_dir=cache_dir, dtype="auto", weights="exact", quantize=quantize)
    assert "4-bit kernels" in again.info.compute and blocks.stat().st_mtime_ns == written  # written once


def test_quantize_says_where_it_does_not_apply(tiny_opt_dir, make_engine, cache_dir):
    engine = make_engine(tiny_opt_dir, cache_dir=cache_dir, quantize="q8_0")
    assert "quantize=q8_0 does not apply" in engine.info.compute_reason and "4-bit" not in engine.info.compute
    with pytest.raises(ValueError, match="quantize"):
        EngineConfig(quantize="q3_k")


def test_a_served_file_chats_with_its_own_template_and_says_what_it_is(family_files, make_server_for, cache_dir):
    files = family_files["qwen2"]
    server = make_server_for(files["gguf"], cache_dir=cache_dir, dtype="auto")  # the defaults: the 4-bit kernels
    status, _, models = http("GET", f"{server.url}/v1/models")
    card = models["data"][0]
    assert status == 200 and card["architecture"] == "qwen2" and card["weight_types"]["Q4_K"] == 2
    # the file's two Q4_K tensors are fused with parts of other types (so Q4_1); its Q6_K is read as it is where the
    # kernels interleave their blocks, rounded to Q8_0 where they do not
    kept = "Q4_1 and Q6_K and Q8_0" if "blocks interleaved by 8 rows" in card["compute"] else "Q4_1 and Q8_0"
    assert f"4-bit kernels, the GGUF's blocks as {kept} on" in card["compute"]
    # The file says add_bos_token: a plain prompt starts with the BOS; the chat template is the file's (ChatML).
    status, _, tokens = http("POST", f"{server.url}/tokenize", {"prompt": "Hello"})
    assert status == 200 and tokens["tokens"][0] == 1
    messages = [{"role": "user", "content": "Hello"}]
    status, _, answer = http("POST", f"{server.url}/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    assert status == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length")
    status, _, chat_tokens = http("POST", f"{server.url}/tokenize", {"messages": messages})
    assert server.state.engine.tokenizer.decode(chat_tokens["tokens"]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    assert 2 in server.state.engine.info.eos_token_ids  # <|im_end|> ends a turn


def test_a_replaced_file_is_prepared_again(family_files, cache_dir, tmp_path):
    gguf = tmp_path / "copy.gguf"
    gguf.write_bytes(Path(family_files["llama"]["gguf"]).read_bytes())
    folder = prepared_model(str(gguf), cache_dir)
    first = json.loads((folder / SOURCE_RECORD).read_text())
    assert folder == prepared_dir(str(gguf), cache_dir) and first["types"]["Q6_K"] == 2
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert json.loads((prepared_model(str(gguf), cache_dir) / SOURCE_RECORD).read_text())["source"] != first["source"]


# -- a file too big for a float32 folder -------------------------------------------------------------------------

@pytest.mark.parametrize("family, dtype", [("llama", "float32"), ("gemma3", "bfloat16")])
def test_a_file_too_big_for_a_float32_folder_is_served_from_the_file(family_files, family, dtype, make_engine,
                                                                      cache_dir, tmp_path):
    """A file whose float32 weights pass FOLDER_WEIGHTS_MAX_BYTES (a 7 B one: 28 GB) is prepared without them:
    the model's own forward reads every weight from the file, the same parameters bit for bit as a folder that
    holds them (llama: untied, q/k rows permuted; Gemma: tied, its norms stored as 1 + w), and the 4-bit kernels
    serve it from the file's blocks and look its tokens up in them. vLLM, which reads a folder's weights, is
    refused in one line."""
    from engine.model_store import prepare_gguf_model

    files, big_cache = family_files[family], str(tmp_path / "cache")
    folder = prepare_gguf_model(files["gguf"], big_cache, weights=False)
    assert not list(folder.glob("*.safetensors"))
    assert json.loads((folder / SOURCE_RECORD).read_text())["weights"] is False
    reference = prepared_model(files["gguf"], cache_dir)
    assert list(reference.glob("*.safetensors"))
    assert run_job("unequal_parameters", model_dir=str(folder), reference_dir=str(reference), dtype=dtype) == []
    served, _ = _greedy(make_engine, files["gguf"], big_cache)  # the model's own forward, float32
    assert served == [tuple(tokens) for tokens in files["greedy"]]
    on_kernels, kernels_info = _greedy(lambda model, **kw: make_engine(model, dtype="auto", **kw),
                                      files["gguf"], big_cache)
    assert "4-bit kernels" in kernels_info.compute
    assert on_kernels == _greedy(lambda model, **kw: make_engine(model, dtype="auto", **kw), files["gguf"],
                                 cache_dir)[0]
    with pytest.raises(UnsupportedModel, match="LOCKSTEP_BACKEND=hf"):
        resolve_model(EngineConfig(model=files["gguf"], backend="vllm", cache_dir=big_cache))


def test_a_folder_keeps_the_weights_of_a_small_file_only(family_files, tmp_path, monkeypatch):
    from engine import gguf_convert
    from engine.model_store import prepare_gguf_model

    gguf = family_files["qwen3"]["gguf"]
    needed = gguf_convert.float32_bytes(read_gguf(gguf))
    monkeypatch.setattr(gguf_convert, "FOLDER_WEIGHTS_MAX_BYTES", needed)
    assert list(prepare_gguf_model(gguf, str(tmp_path / "fits")).glob("*.safetensors"))
    monkeypatch.setattr(gguf_convert, "FOLDER_WEIGHTS_MAX_BYTES", needed - 1)
    assert not list(prepare_gguf_model(gguf, str(tmp_path / "too-big")).glob("*.safetensors"))
