"""The GGUF's tensors kept as safetensors (engine/gguf_tensors.py): the copy gives what gguf-py reads; a copy of
another GGUF, a broken one, or one that reads but is not what was written is read past and rewritten; and a cache
that cannot be written still gives the tensors."""
import json
import os

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from engine import EngineConfig
from engine.gguf_tensors import read_tensors
from engine.model_store import gguf_tensors_copy


def write_gguf(path, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", seed)
    weight = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_down.weight", quantize(weight, gguf.GGMLQuantizationType.Q4_1),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("output_norm.weight", rng.standard_normal(8).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def as_read_by_gguf_py(path: str) -> dict:
    return {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape), np.asarray(t.data))
            for t in gguf.GGUFReader(path).tensors}


def assert_same(tensors: dict, expected: dict) -> None:
    assert tensors.keys() == expected.keys()
    for name, (type_name, shape, data) in expected.items():
        got = tensors[name]
        assert (got.type_name, got.shape, got.data.dtype, got.data.shape) == (type_name, shape, data.dtype, data.shape)
        assert np.array_equal(got.data, data), name


def test_the_copy_gives_what_gguf_py_reads_and_is_then_read_instead(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf")
    copy = tmp_path / "cache" / "m.safetensors"
    assert_same(read_tensors(path, copy), as_read_by_gguf_py(path))
    assert copy.exists() and not list(copy.parent.glob("*.partial"))

    def no_gguf_reading(_path):
        raise AssertionError("read the GGUF although its copy is current")
    monkeypatch.setattr("engine.gguf_tensors._read_gguf", no_gguf_reading)
    assert_same(read_tensors(path, copy), as_read_by_gguf_py(path))


def test_a_copy_of_another_gguf_or_a_broken_one_is_read_past_and_rewritten(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", seed=1)
    copy = tmp_path / "m.safetensors"
    read_tensors(write_gguf(tmp_path / "other.gguf", seed=2), copy)
    assert_same(read_tensors(path, copy), as_read_by_gguf_py(path))  # the other GGUF's copy is not taken

    write_gguf(path, seed=3)  # the package reinstalled: another file at the same path
    os.utime(path, ns=(1, 1))
    assert_same(read_tensors(path, copy), as_read_by_gguf_py(path))

    copy.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert_same(read_tensors(path, copy), as_read_by_gguf_py(path))
    assert_same(read_tensors(path, copy), as_read_by_gguf_py(path))  # and the rewritten copy reads


def rewrite_copy(copy, change) -> None:
    """The copy rewritten with `change(tensors, metadata)` applied: a careless edit, or a disk that lost bytes."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(copy), framework="numpy") as stored:
        metadata, tensors = stored.metadata(), {name: stored.get_tensor(name) for name in stored.keys()}
    change(tensors, metadata)
    save_file(tensors, str(copy), metadata=metadata)


def flip_a_byte(tensors, _metadata):
    tensors["blk.0.ffn_down.weight"][0, 7] ^= 0x10


def drop_a_tensor(tensors, metadata):
    del tensors["output_norm.weight"]
    metadata["tensors"] = json.dumps({k: v for k, v in json.loads(metadata["tensors"]).items() if k in tensors})


def empty_the_layout(tensors, metadata):
    tensors.clear()
    tensors["x"] = np.zeros(1, dtype=np.uint8)
    metadata["tensors"] = json.dumps({"x": ["F32", [1]]})


def list_the_layout(_tensors, metadata):
    metadata["tensors"] = json.dumps([1, 2])


@pytest.mark.parametrize("change", [flip_a_byte, drop_a_tensor, empty_the_layout, list_the_layout])
def test_a_copy_that_is_not_what_was_written_is_read_past_and_rewritten(tmp_path, change):
    """Each of these reads without an error (the source still matches); only the digest or the layout check
    tells, and a copy taken anyway would fail every start (or, a flipped byte, compute other numbers silently)."""
    path = write_gguf(tmp_path / "m.gguf")
    copy = tmp_path / "m.safetensors"
    read_tensors(path, copy)
    rewrite_copy(copy, change)
    assert_same(read_tensors(path, copy), as_read_by_gguf_py(path))
    assert_same(read_tensors(path, copy), as_read_by_gguf_py(path))  # rewritten whole


def test_a_fifo_at_the_copys_place_is_replaced_without_blocking(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    copy = tmp_path / "m.safetensors"
    os.mkfifo(copy)
    assert_same(read_tensors(path, copy), as_read_by_gguf_py(path))
    assert copy.is_file()


def test_a_failed_write_still_gives_the_tensors(tmp_path, monkeypatch):
    """Fault injection: safetensors reports a write it could not do (a read-only or full disk) as its own error,
    not an OSError."""
    import safetensors.numpy
    from safetensors import SafetensorError

    def cannot_write(*_args, **_kwargs):
        raise SafetensorError("Error while serializing: I/O error: Operation not permitted (os error 1)")
    monkeypatch.setattr(safetensors.numpy, "save_file", cannot_write)
    path = write_gguf(tmp_path / "m.gguf")
    assert_same(read_tensors(path, tmp_path / "m.safetensors"), as_read_by_gguf_py(path))
    assert list(tmp_path.iterdir()) == [tmp_path / "m.gguf"]


def test_an_unwritable_cache_still_gives_the_tensors(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    assert_same(read_tensors(path, not_a_folder / "m.safetensors"), as_read_by_gguf_py(path))
    assert not_a_folder.read_text() == "" and not list(tmp_path.glob("*.partial"))


def test_the_embedded_models_copy_lies_beside_its_folder_not_in_it():
    """vLLM's loader takes every *.safetensors in the model's folder for weights."""
    copy = gguf_tensors_copy(EngineConfig().cache_dir)
    assert copy.suffix == ".safetensors" and copy.parent.name == "models"
