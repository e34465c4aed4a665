"""JSON mode's parent side: `response_format` checked, and its schema bounded and compiled once, so a bad,
unsupported or too costly schema is a 400 naming the field before anything is queued.

`parse_response_format` checks the field, bounds the schema's counts (`bound_counts`: llguidance spells out every
item and repeat, so an unbounded count could take all memory), then compiles the schema under parser limits and
takes its first steps on a byte vocabulary. The worker gets the checked schema as JSON text
(`WorkerSampling.json_schema`) and masks logits with it (backends/constrained.py).

Whitespace is fixed (", " and ": " between items, none elsewhere): with free whitespace a small model can spend
its whole budget on newlines. These options travel inside the schema (`x-guidance`), so vLLM's guidance backend
compiles exactly the same grammar.
"""
import copy
import functools
import json
import re
from dataclasses import dataclass

from .errors import InvalidRequest

PARAM = "response_format"
MAX_SCHEMA_SIZE = 64_000  # characters of keys and strings plus one per value: about the schema's JSON length
MAX_SCHEMA_DEPTH = 32  # objects/arrays inside each other (OpenAI allows 5-10 levels of schema nesting)
MAX_NAME_LENGTH = 64
GRAMMAR_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}
FORMAT_KEYS = {"type", "json_schema"}
JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
# Bounds on what one schema may cost: building its lexer (parent and worker) and each token's mask (worker).
# llguidance's own defaults are 1,000,000 / 200,000 / 500,000; these keep a hostile schema's step short (its cost:
# docs/benchmarks.md, "Measurements behind the code's constants").
# Without verbose errors a refusal does not carry the parser's state and grammar (hundreds of bytes).
PARSER_LIMITS = {"initial_lexer_fuel": 500_000, "step_lexer_fuel": 100_000, "max_grammar_size": 100_000,
                 "verbose_errors": False}
# Clients tend to send the same schema with every request: its check (parent) and its fresh matcher (worker) are
# kept for the most recent ones: a kept matcher is copied in far less time than a large schema takes to check and
# build the first time (docs/benchmarks.md).
NUM_KEPT_SCHEMAS = 32
# llguidance spells out every item an array or object may hold (minItems 10**9 allocates until the kernel kills
# the process, a Rust abort nothing can catch) and every repeat of a pattern's `{n,m}`, nested repeats multiplied.
# Their sum over a schema is bounded before llguidance sees it (what the costliest schemas at this bound take to
# check and build, and what they took without it: docs/benchmarks.md). String lengths are not spelled out, so
# only the context bounds them. Without this bound minItems 10**9 aborts the process.
MAX_EXPANSION = 16_384
# What no answer can exceed when the caller does not say: SmolLM2's 8,192-token context x its longest token (81).
DEFAULT_MAX_OUTPUT_CHARS = 8192 * 81
MIN_COUNT_KEYWORDS = ("minItems", "minProperties", "minContains", "minLength")
MAX_COUNT_KEYWORDS = ("maxItems", "maxProperties", "maxContains", "maxLength")
SPELLED_OUT_KEYWORDS = {"minItems", "maxItems", "minProperties", "maxProperties", "minContains", "maxContains"}
LITERAL_KEYWORDS = {"const", "enum", "default", "examples"}  # JSON values, not schemas: never walked
REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
MAX_REPEAT_DIGITS = 9  # a longer count is over every bound (and int() refuses past 4,300 digits)


@dataclass(frozen=True)
class SchemaSite:
    """Where a schema came from, as its errors name it: the words for it and the request field."""

    what: str
    param: str


RESPONSE_FORMAT = SchemaSite("the response_format schema", PARAM)


def parse_response_format(value, max_output_chars: int | None = None) -> str | None:
    """The JSON schema (as text, with the grammar options) the output must match, or None for free text.
    `max_output_chars`: the most characters an answer can hold (context x the longest token).
    Raises InvalidRequest naming `response_format` for anything else."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest('response_format must be an object, e.g. {"type": "json_object"}', PARAM)
    _refuse_unknown_keys(value, FORMAT_KEYS, "response_format")
    match value.get("type"):
        case "text":
            return None
        case "json_object":
            schema = ANY_JSON_OBJECT
        case "json_schema":
            schema = bound_counts(_schema_of(value.get("json_schema")), max_output_chars or DEFAULT_MAX_OUTPUT_CHARS)
        case _:
            raise InvalidRequest('response_format.type must be "text", "json_object" or "json_schema"', PARAM)
    try:
        schema_text = json.dumps({**schema, "x-guidance": GRAMMAR_OPTIONS}, allow_nan=False)
    except ValueError:  # the body parser takes NaN and Infinity; JSON Schema has no such numbers
        raise InvalidRequest("the response_format schema holds NaN or Infinity, which JSON does not have", PARAM) \
            from None
    check_compiles(schema_text, max_output_chars or DEFAULT_MAX_OUTPUT_CHARS)
    return schema_text


def refuse_conflicts(stop: tuple[str, ...], ignore_eos: bool, min_tokens: int = 0) -> None:
    """Settings that would end JSON output early or hold it past its end (once the JSON is complete only EOS
    is allowed: min_tokens or ignore_eos would leave no token to draw)."""
    if stop:
        raise InvalidRequest("stop strings cannot be combined with response_format: they would cut the JSON "
                             "short (the output ends by itself when the JSON is complete)", PARAM)
    if ignore_eos:
        raise InvalidRequest("ignore_eos cannot be combined with response_format: the output ends when the "
                             "JSON is complete", PARAM)
    if min_tokens:
        raise InvalidRequest("min_tokens cannot be combined with response_format: the output ends when the "
                             "JSON is complete", PARAM)


def _schema_of(spec) -> dict:
    if not isinstance(spec, dict):
        raise InvalidRequest('response_format.json_schema must be an object: {"name": ..., "schema": {...}}', PARAM)
    _refuse_unknown_keys(spec, JSON_SCHEMA_KEYS, "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LENGTH:
        raise InvalidRequest(f"response_format.json_schema.name must be a string of 1 to {MAX_NAME_LENGTH} "
                             "characters", PARAM)
    if not isinstance(spec.get("description"), (str, type(None))):
        raise InvalidRequest("response_format.json_schema.description must be a string", PARAM)
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise InvalidRequest("response_format.json_schema.strict must be true or false", PARAM)
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format.json_schema.schema must be a JSON Schema object", PARAM)
    _check_size(schema, RESPONSE_FORMAT)
    return {key: value for key, value in schema.items() if key != "x-guidance"}  # the options are ours


def _refuse_unknown_keys(value: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequest(f"{where} does not take {', '.join(repr(key[:40]) for key in unknown[:5])} "
                             f"(it takes {', '.join(sorted(known))})", PARAM)


def _check_size(schema: dict, site: SchemaSite) -> None:
    """Refuse a schema nested too deep or too large, walking it without recursion and stopping as soon as
    it is over either bound (a 10 MB schema costs no more than a 64 kB one)."""
    size, pending = 0, [(schema, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_SCHEMA_DEPTH and isinstance(value, (dict, list)):
            raise InvalidRequest(f"{site.what} nests deeper than {MAX_SCHEMA_DEPTH} levels", site.param)
        size += 1
        if isinstance(value, dict):
            size += sum(len(key) for key in value)
            pending.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            pending.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            size += len(value)
        if size > MAX_SCHEMA_SIZE:
            raise InvalidRequest(f"{site.what} is too large (at most about {MAX_SCHEMA_SIZE} characters)",
                                 site.param)


def checked_schema(schema: dict, max_output_chars: int, site: SchemaSite) -> dict:
    """A client's schema (a tool's parameters) bounded as response_format's is: size, depth and counts."""
    _check_size(schema, site)
    return bound_counts(schema, max_output_chars, site)


def bound_counts(schema: dict, max_output_chars: int, site: SchemaSite = RESPONSE_FORMAT) -> dict:
    """A copy of the schema with every count checked before llguidance sees it: a min* no answer can reach is
    refused; a max* above what any answer can hold is dropped (it constrains nothing reachable, and llguidance
    would spell out every item up to it); what remains must spell out at most MAX_EXPANSION items and repeats."""
    schema = copy.deepcopy(schema)  # small: _check_size bounded it
    expansion = 0
    for node in _subschemas(schema):
        _bound_node_counts(node, max_output_chars, site)
        expansion += _node_expansion(node)
        if expansion > MAX_EXPANSION:
            raise InvalidRequest(f"{site.what} is too costly: its counts (minItems, maxItems, min/maxProperties, "
                                 f"pattern repeats {{n,m}}) add up to more than {MAX_EXPANSION}", site.param)
    return schema


def expansion_of(schema_text: str) -> int:
    """How many items and repeats llguidance spells out for a checked schema (the worker weighs kept matchers)."""
    return sum(_node_expansion(node) for node in _subschemas(json.loads(schema_text)))


def _subschemas(schema: dict):
    """Every object in the schema, walked without recursion, except JSON values (const, enum, ...)."""
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
        elif isinstance(node, dict):
            yield node
            pending.extend(value for key, value in node.items() if key not in LITERAL_KEYWORDS)


def _bound_node_counts(node: dict, max_output_chars: int, site: SchemaSite) -> None:
    for key in MIN_COUNT_KEYWORDS:
        if _is_count(node.get(key)) and node[key] > max_output_chars:
            raise InvalidRequest(f"{site.what} can never be met: {key} {_shown(node[key])} is more than any "
                                 f"answer can hold (at most {max_output_chars} characters)", site.param)
    for key in MAX_COUNT_KEYWORDS:  # dropped, not clamped: unbounded costs nothing, a clamped bound is spelled out
        if _is_count(node.get(key)) and node[key] > max_output_chars:
            del node[key]


def _node_expansion(node: dict) -> int:
    expansion = sum(int(node[key]) for key in SPELLED_OUT_KEYWORDS if _is_count(node.get(key)) and node[key] > 0)
    if isinstance(node.get("pattern"), str):
        expansion += pattern_expansion(node["pattern"])
    if isinstance(node.get("patternProperties"), dict):
        expansion += sum(pattern_expansion(pattern) for pattern in node["patternProperties"])
    return expansion


def _is_count(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # NaN: not a count


def _shown(value) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return text if len(text) <= 20 else f"{text[:8]}...({len(text)} digits)"


def pattern_expansion(pattern: str) -> int:
    """How many characters' worth of regex a pattern's `{n}`/`{n,m}` repeats spell out: a repeat multiplies the
    atom before it (a group's whole content, so nested repeats multiply). Alternatives are added, which can only
    overcount. A cheap scan, not a parser: llguidance still checks the syntax."""
    totals, last, position = [0], 1, 0  # totals: the size of each open group; last: the atom just read
    while position < len(pattern):
        char = pattern[position]
        repeat = REPEAT.match(pattern, position) if char == "{" else None
        if char == "\\":
            last, position = 1, position + 2
            totals[-1] += 1
        elif char == "[":
            last, position = 1, _class_end(pattern, position)
            totals[-1] += 1
        elif char == "(":
            totals.append(0)
            last, position = 0, position + 1
        elif char == ")" and len(totals) > 1:
            last = totals.pop()
            totals[-1] += last
            position += 1
        elif repeat:
            count = max(_repeat_count(repeat.group(1)), _repeat_count(repeat.group(2) or "0"))
            totals[-1] += last * (count - 1)
            last, position = last * count, repeat.end()
        else:
            last, position = 1, position + 1
            totals[-1] += 1
        if totals[-1] > MAX_EXPANSION:
            return totals[-1]
    return sum(totals)


def _repeat_count(digits: str) -> int:
    return int(digits) if len(digits) <= MAX_REPEAT_DIGITS else MAX_EXPANSION + 1


def _class_end(pattern: str, start: int) -> int:
    """The position after a character class `[...]` (escapes inside skipped)."""
    position = start + 1
    while position < len(pattern) and pattern[position] != "]":
        position += 2 if pattern[position] == "\\" else 1
    return position + 1


def check_compiles(schema_text: str, max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> None:
    """Compile the schema's grammar within PARSER_LIMITS and take its first steps; a refusal names the problem."""
    if error := _compile_error(schema_text, "json", max_output_chars):
        raise InvalidRequest(f"the response_format schema is not supported: {error[:300]}", PARAM)


def schema_error(schema_text: str, max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> str:
    """Why llguidance cannot use a JSON schema ("" where it can): the check of `check_compiles`, for a caller that
    names the schema itself."""
    return _compile_error(schema_text, "json", max_output_chars)


def check_lark_compiles(lark: str, site: SchemaSite, max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> None:
    """The same check for a Lark grammar (tool calls: their markup around each tool's schema)."""
    if error := _compile_error(lark, "lark", max_output_chars):
        raise InvalidRequest(f"{site.what} is not supported: {error[:300]}", site.param)


def grammar_of(kind: str, text: str) -> str:
    """llguidance's grammar for a JSON schema ("json") or a Lark grammar ("lark"), as LLMatcher takes it."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(text) if kind == "json" else LLMatcher.grammar_from_lark(text)


@functools.lru_cache(maxsize=NUM_KEPT_SCHEMAS)
def _compile_error(text: str, kind: str, max_output_chars: int) -> str:
    """Some errors only show once the grammar runs: a schema that forces an endless output (a required recursive
    $ref) or a lexer too large to build. A matcher on a byte vocabulary (no model needed, ~1 MB) computes the first
    mask and the bytes the grammar forces from the start, as the worker's first steps would."""
    from llguidance import LLMatcher

    grammar = grammar_of(kind, text)
    if error := LLMatcher.validate_grammar(grammar, None, limits=parser_limits()):
        return error
    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=parser_limits())
    matcher.compute_bitmask()
    forced = matcher.compute_ff_tokens()
    if len(forced) > max_output_chars:
        return f"it forces an output longer than any answer can hold ({max_output_chars} characters)"
    matcher.consume_tokens(forced)
    matcher.compute_bitmask()
    return short_error(matcher.get_error()) if matcher.is_error() else ""


def short_error(error: str) -> str:
    return error.replace("<non-verbose/>", "").strip()


class _ByteVocabulary:
    """A vocabulary of the 256 bytes and an EOS, in the shape llguidance's TokenizerWrapper reads."""
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([byte]) for byte in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


@functools.cache
def _byte_tokenizer():
    from llguidance import LLTokenizer, TokenizerWrapper

    return LLTokenizer(TokenizerWrapper(_ByteVocabulary()))


def parser_limits():
    from llguidance import LLParserLimits

    return LLParserLimits(**PARSER_LIMITS)
