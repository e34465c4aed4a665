"""A GGUF file read as untrusted input: its header, metadata and tensor table parsed with a bound on everything,
every tensor's type, shape, offset and size checked against the file and the architecture before any is used.

A file is refused with `InvalidGGUF`, one line that names what is wrong (a type or architecture lockstep does not
serve, a tensor past the end of the file, a dimension or string past its bound), never a crash, a hang or an
allocation of a size the file claims: strings and arrays are read only after their length was checked against the
bytes the file has, and tensors are not read at all here (`tensor_data` maps them in place).
"""
import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Bounds far past any real file (an 8 B Q4_K_M model has 291 tensors and ~30 metadata fields; Gemma 3's vocabulary,
# the largest common one, 262,144 tokens; chat templates are a few KB), and small enough that no field can make a
# reader allocate much.
MAX_TENSORS = 65_536
MAX_FIELDS = 65_536
MAX_KEY_BYTES = 1024
MAX_STRING_BYTES = 1 << 20
MAX_ARRAY_ITEMS = 1 << 19
MAX_DIMS = 4
MAX_DIM = 1 << 31
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 17

# GGML's type ids, names and (values per block, bytes per block): ggml.h, gguf-py's GGML_QUANT_SIZES.
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
         7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
         14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2)}
OTHER_TYPE_NAMES = {9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
                    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
                    26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
SUPPORTED_TYPES = ", ".join(name for name, _, _ in TYPES.values())
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

# Metadata value types (gguf.h): struct format of the scalars, 8 = string, 9 = array.
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8",
                 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


class InvalidGGUF(ValueError):
    """A file lockstep will not serve, with the one line that says why."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # GGML's: Q4_K, F32, ...
    shape: tuple[int, ...]  # GGML's order: the innermost (contiguous) dimension first
    offset: int  # from the file's start
    nbytes: int

    @property
    def rows(self) -> int:
        return math.prod(self.shape[1:])


@dataclass
class GGUFFile:
    path: str
    size: int
    version: int
    metadata: dict[str, object]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for tensor in self.tensors.values():
            counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: -item[1]))

    def tensor_data(self, name: str) -> np.ndarray:
        """A tensor's bytes, memory-mapped in place (read-only): [rows, bytes per row]."""
        tensor = self.tensors[name]
        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=(tensor.nbytes,))
        return data.reshape(tensor.rows, -1)


def is_gguf(path: str) -> bool:
    """Whether `path` names a file that starts as a GGUF does (or at least ends in .gguf)."""
    candidate = Path(path)
    if candidate.suffix.lower() == ".gguf":
        return True
    try:
        with candidate.open("rb") as stream:
            return candidate.is_file() and stream.read(4) == MAGIC
    except OSError:
        return False


def read_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensor table, checked (see the module's docstring); raises InvalidGGUF."""
    if not Path(path).is_file():  # not a FIFO either: opening one would block the start
        raise InvalidGGUF(f"{path} is not a regular file")
    try:
        with open(path, "rb") as stream:
            size = Path(path).stat().st_size
            if size < 24:
                raise InvalidGGUF(f"{path} is not a GGUF file ({size} bytes)")
            with mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as view:
                parsed = _Parser(view, path).parse()
    except OSError as exc:
        raise InvalidGGUF(f"cannot read {path}: {exc.strerror or exc}") from exc
    check_architecture(parsed)
    return parsed


class _Parser:
    def __init__(self, view: mmap.mmap, path: str):
        self.view, self.path, self.position = view, path, 0

    def fail(self, what: str) -> InvalidGGUF:
        return InvalidGGUF(f"{self.path} is not a valid GGUF file: {what}")

    def take(self, count: int) -> int:
        """The position of the next `count` bytes, checked against the file's end."""
        start = self.position
        if count < 0 or start + count > len(self.view):
            raise self.fail(f"it ends at byte {len(self.view):,} where byte {start + count:,} was expected "
                            "(a truncated file?)")
        self.position += count
        return start

    def scalar(self, fmt: str):
        return struct.unpack_from(fmt, self.view, self.take(struct.calcsize(fmt)))[0]

    def string(self, limit: int, what: str) -> str:
        length = self.scalar("<Q")
        if length > limit:
            raise self.fail(f"{what} is {length:,} bytes long (at most {limit:,})")
        start = self.take(length)
        try:
            return bytes(self.view[start:start + length]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not UTF-8") from exc

    def value(self, value_type: int, key: str):
        if value_type in SCALARS:
            return self.scalar(SCALARS[value_type])
        if value_type == STRING:
            return self.string(MAX_STRING_BYTES, f"the value of {key}")
        if value_type == ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if count > MAX_ARRAY_ITEMS:
                raise self.fail(f"{key} has {count:,} entries (at most {MAX_ARRAY_ITEMS:,})")
            if item_type in NUMPY_SCALARS:
                dtype = np.dtype(NUMPY_SCALARS[item_type])
                start = self.take(count * dtype.itemsize)
                return np.frombuffer(self.view, dtype=dtype, count=count, offset=start).copy()
            if item_type == STRING:
                return [self.string(MAX_STRING_BYTES, f"an entry of {key}") for _ in range(count)]
            raise self.fail(f"{key} is an array of type {item_type}")
        raise self.fail(f"{key} has value type {value_type}")

    def parse(self) -> GGUFFile:
        if bytes(self.view[:4]) != MAGIC:
            raise InvalidGGUF(f"{self.path} is not a GGUF file (it does not start with 'GGUF')")
        self.take(4)
        version = self.scalar("<I")
        if version not in VERSIONS:
            raise self.fail(f"version {version} (lockstep reads versions {', '.join(map(str, VERSIONS))})")
        num_tensors, num_fields = self.scalar("<Q"), self.scalar("<Q")
        if num_tensors > MAX_TENSORS or num_fields > MAX_FIELDS:
            raise self.fail(f"it claims {num_tensors:,} tensors and {num_fields:,} metadata fields")
        metadata: dict[str, object] = {}
        for _ in range(num_fields):
            key = self.string(MAX_KEY_BYTES, "a metadata key")
            metadata[key] = self.value(self.scalar("<I"), key)
        infos = [self.tensor_info() for _ in range(num_tensors)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1 or alignment > 1 << 16 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment is {alignment!r}")
        data_start = -(-self.position // alignment) * alignment
        gguf = GGUFFile(self.path, len(self.view), version, metadata)
        for name, type_name, shape, relative, nbytes in infos:
            if name in gguf.tensors:
                raise self.fail(f"tensor {name} is listed twice")
            if relative % alignment:
                raise self.fail(f"tensor {name} is not aligned to {alignment} bytes")
            offset = data_start + relative
            if offset + nbytes > len(self.view):
                raise self.fail(f"tensor {name} ({nbytes:,} bytes at {offset:,}) ends past the file's "
                                f"{len(self.view):,} bytes (a truncated file?)")
            gguf.tensors[name] = TensorInfo(name, type_name, shape, offset, nbytes)
        return gguf

    def tensor_info(self) -> tuple[str, str, tuple[int, ...], int, int]:
        name = self.string(MAX_KEY_BYTES, "a tensor's name")
        num_dims = self.scalar("<I")
        if not 1 <= num_dims <= MAX_DIMS:
            raise self.fail(f"tensor {name} has {num_dims} dimensions")
        shape = tuple(self.scalar("<Q") for _ in range(num_dims))
        if any(not 1 <= dim <= MAX_DIM for dim in shape):
            raise self.fail(f"tensor {name} has the shape {list(shape)}")
        type_id, relative = self.scalar("<I"), self.scalar("<Q")
        if type_id not in TYPES:
            type_name = OTHER_TYPE_NAMES.get(type_id, f"type {type_id}")
            raise InvalidGGUF(f"{self.path}: tensor {name} is {type_name}, which lockstep does not read "
                              f"(it reads {SUPPORTED_TYPES})")
        type_name, block_values, block_bytes = TYPES[type_id]
        if shape[0] % block_values:
            raise self.fail(f"tensor {name}'s rows of {shape[0]} are not whole {type_name} blocks")
        nbytes = math.prod(shape) // block_values * block_bytes
        return name, type_name, shape, relative, nbytes


@dataclass(frozen=True)
class Hyperparameters:
    """What the file says of the model's shape (`{architecture}.*` fields), checked for sense."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int


def hyperparameters(gguf: GGUFFile) -> Hyperparameters:
    arch, fields_ = gguf.architecture, gguf.metadata

    def integer(key: str, default: int | None = None, most: int = MAX_WIDTH) -> int:
        value = fields_.get(f"{arch}.{key}", default)
        if isinstance(value, np.ndarray) and value.size and np.all(value == value.flat[0]):
            value = int(value.flat[0])  # per-layer counts (some files), all alike
        if value is None:
            raise InvalidGGUF(f"{gguf.path}: the field {arch}.{key} is missing")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= int(value) <= most:
            raise InvalidGGUF(f"{gguf.path}: {arch}.{key} is {value!r} (expected 1 to {most:,})")
        return int(value)

    hidden, heads = integer("embedding_length"), integer("attention.head_count", most=4096)
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is None or len(embedding.shape) != 2:
        raise InvalidGGUF(f"{gguf.path}: no two-dimensional token_embd.weight")
    return Hyperparameters(
        architecture=arch, num_layers=integer("block_count", most=MAX_LAYERS), hidden_size=hidden,
        intermediate_size=integer("feed_forward_length", most=1 << 20), num_heads=heads,
        num_kv_heads=integer("attention.head_count_kv", heads, most=heads),
        head_dim=integer("attention.key_length", hidden // heads if hidden % heads == 0 else None, most=4096),
        vocab_size=embedding.shape[1], context_length=integer("context_length", 2048, most=1 << 24))


def expected_shapes(hp: Hyperparameters) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture reads, with its shape (GGML's order); optional ones end in '?'."""
    hidden, q_width, kv_width = hp.hidden_size, hp.num_heads * hp.head_dim, hp.num_kv_heads * hp.head_dim
    shapes = {"token_embd.weight": (hidden, hp.vocab_size), "output_norm.weight": (hidden,),
              "output.weight?": (hidden, hp.vocab_size)}
    for i in range(hp.num_layers):
        layer = {"attn_norm.weight": (hidden,), "attn_q.weight": (hidden, q_width),
                 "attn_k.weight": (hidden, kv_width), "attn_v.weight": (hidden, kv_width),
                 "attn_output.weight": (q_width, hidden), "ffn_norm.weight": (hidden,),
                 "ffn_gate.weight": (hidden, hp.intermediate_size), "ffn_up.weight": (hidden, hp.intermediate_size),
                 "ffn_down.weight": (hp.intermediate_size, hidden)}
        if hp.architecture == "qwen2":
            layer.update({"attn_q.bias": (q_width,), "attn_k.bias": (kv_width,), "attn_v.bias": (kv_width,)})
        if hp.architecture in ("qwen3", "gemma3"):
            layer.update({"attn_q_norm.weight": (hp.head_dim,), "attn_k_norm.weight": (hp.head_dim,)})
        if hp.architecture == "gemma3":
            layer.update({"post_attention_norm.weight": (hidden,), "post_ffw_norm.weight": (hidden,)})
        shapes.update({f"blk.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def check_architecture(gguf: GGUFFile) -> Hyperparameters:
    """The file is of an architecture lockstep serves and holds exactly the tensors it reads, in their shapes."""
    if gguf.architecture not in ARCHITECTURES:
        raise InvalidGGUF(f"{gguf.path}: architecture {gguf.architecture or '(none)'!r} is not one lockstep "
                          f"serves (it serves {', '.join(ARCHITECTURES)})")
    hp = hyperparameters(gguf)
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise InvalidGGUF(f"{gguf.path}: no tokenizer (tokenizer.ggml.tokens)")
    if len(tokens) > hp.vocab_size:
        raise InvalidGGUF(f"{gguf.path}: the tokenizer has {len(tokens):,} tokens, the embedding "
                          f"{hp.vocab_size:,} rows")
    for name, shape in expected_shapes(hp).items():
        optional, name = name.endswith("?"), name.rstrip("?")
        tensor = gguf.tensors.get(name)
        if tensor is None:
            if optional:
                continue
            raise InvalidGGUF(f"{gguf.path}: tensor {name} is missing (architecture {hp.architecture})")
        if tensor.shape != shape:
            raise InvalidGGUF(f"{gguf.path}: tensor {name} has the shape {list(tensor.shape)}, "
                              f"{hp.architecture} with these hyperparameters reads {list(shape)}")
    return hp


def add_metadata(writer, key: str, value) -> None:
    """One metadata field, as read here, into gguf-py's GGUFWriter (files made for tests and benchmarks: a tokenizer
    copied from another file, say). Integers are written as uint32, floats as float32."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_array(key, [item.item() if hasattr(item, "item") else item for item in value])
