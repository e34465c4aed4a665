"""Tool calls: the request's tools checked, and the prompt and the grammar in the model's own call format (the
calls are taken back out of the answer's text, streamed or whole, by engine/answer_stream.py).

A `ToolFormat` is data, chosen from the chat template (`tool_format_for`):

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call. Qwen2.5 and
  Qwen3 templates render tools and calls themselves in it (`is_native`); for a template that knows no tools (the
  embedded SmolLM2, Gemma 3) lockstep describes the tools in a system message and writes earlier calls and their
  results as text in the same format.
- `llama3-json`: the whole answer is `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3 templates), one call.

Decoding is constrained (llguidance, the JSON mode's library) so that a call is valid whatever the model's quality:
with `required` or a named function the answer is calls only, each one's arguments matching its tool's schema;
with `auto` the text is free until the model opens a call, and from there the call must be valid (a lazy grammar).
"""
import dataclasses
import json
import re
import secrets
from dataclasses import dataclass

from .errors import InvalidRequest
from .response_format import (DEFAULT_MAX_OUTPUT_CHARS, GRAMMAR_OPTIONS, LITERAL_KEYWORDS, SchemaSite,
                              check_lark_compiles, checked_schema, schema_error)

MAX_TOOLS = 128  # OpenAI's own limit on tools per request
MAX_DESCRIPTION_CHARS = 8192
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
TOOLS_SITE = SchemaSite("a tool's parameters schema", "tools")


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str
    parameters: dict  # checked and bounded (the JSON mode's bounds)


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools: the tools, `tool_choice` ("none", "auto", "required", or a function's name)
    and whether several calls may come in one answer."""

    tools: tuple[FunctionTool, ...]
    choice: str
    is_parallel: bool = True

    @property
    def is_forced(self) -> bool:
        return self.choice not in ("none", "auto")

    @property
    def offered(self) -> tuple[FunctionTool, ...]:
        """The tools the model may call now."""
        if self.choice == "none":
            return ()
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(tool for tool in self.tools if tool.name == self.choice)

    def as_openai(self) -> list[dict]:
        """The tools as a chat template takes them (OpenAI's shape)."""
        return [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                  "parameters": tool.parameters}} for tool in self.tools]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# -- the request ---------------------------------------------------------------------------------------------

def parse_tool_request(body: dict, max_output_chars: int | None = None) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` checked (a 400 naming the field), or None when the request
    offers no tools."""
    tools = _tools(body.get("tools"), max_output_chars or DEFAULT_MAX_OUTPUT_CHARS)
    choice = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if not tools:
        return None
    return ToolRequest(tools, choice, parallel is not False)


def _tools(value, max_output_chars: int) -> tuple[FunctionTool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequest("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    if len(value) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools per request", "tools")
    tools = tuple(_tool(item, f"tools[{index}]", max_output_chars) for index, item in enumerate(value))
    names = [tool.name for tool in tools]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise InvalidRequest(f"two tools are named {duplicate!r}: function names must be unique", "tools")
    return tools


def _tool(item, where: str, max_output_chars: int) -> FunctionTool:
    if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
        raise InvalidRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                             "(only function tools are supported)", "tools")
    _refuse_unknown(item, {"type", "function"}, where)
    function = item["function"]
    _refuse_unknown(function, {"name", "description", "parameters", "strict"}, f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequest(f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes",
                             "tools")
    description = function.get("description") or ""
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS:
        raise InvalidRequest(f"{where}.function.description must be a string of at most {MAX_DESCRIPTION_CHARS} "
                             "characters", "tools")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise InvalidRequest(f"{where}.function.strict must be true or false", "tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"{where}.function.parameters must be a JSON Schema object", "tools")
    try:
        json.dumps(parameters, allow_nan=False)
    except ValueError:  # the body parser takes NaN and Infinity; JSON Schema has no such numbers
        raise InvalidRequest(f"{where}.function.parameters holds NaN or Infinity, which JSON does not have",
                             "tools") from None
    if parameters.get("type", "object") != "object":
        raise InvalidRequest(f"{where}.function.parameters must be a JSON Schema of type \"object\" (a call's "
                             f"arguments are an object), not {str(parameters.get('type'))[:40]!r}", "tools")
    site = SchemaSite(f"{where}.function.parameters", "tools")
    parameters = checked_schema({"type": "object", **{k: v for k, v in parameters.items() if k != "x-guidance"}},
                                max_output_chars, site)
    # compiled alone first, so that a refusal names this tool's schema rather than the grammar of every call
    if error := schema_error(json.dumps(parameters, allow_nan=False), max_output_chars):
        raise InvalidRequest(f"{where}.function.parameters is not supported: {error[:300]}", "tools")
    return FunctionTool(name, description, parameters)


def _refuse_unknown(value: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequest(f"{where} does not take {unknown[0][:40]!r} (it takes {', '.join(sorted(known))})",
                             "tools")


def _choice(value, tools: tuple[FunctionTool, ...]) -> str:
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in CHOICES:
            raise InvalidRequest(f"tool_choice must be {', '.join(CHOICES)} or {{\"type\": \"function\", "
                                 "\"function\": {\"name\": ...}}", "tool_choice")
        if value == "required" and not tools:
            raise InvalidRequest("tool_choice \"required\" needs tools", "tool_choice")
        return value
    name = value.get("function", {}).get("name") if isinstance(value, dict) and value.get("type") == "function" \
        and isinstance(value.get("function"), dict) else None
    if not isinstance(name, str):
        raise InvalidRequest("tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                             "tool_choice")
    if name not in {tool.name for tool in tools}:
        raise InvalidRequest(f"tool_choice names the function {name[:64]!r}, which is not in tools", "tool_choice")
    return name


# -- the model's format -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolFormat:
    """How one family of chat templates writes a call: the markup around it and the key of its arguments."""

    name: str
    opening: str  # before a call's JSON ("" where the whole answer is the call)
    closing: str  # after it
    arguments_key: str
    is_native: bool  # the template renders tools, calls and results itself
    allows_several: bool = True

    def grammar(self, tools: ToolRequest, reasoning: str | None = None) -> str | None:
        """The Lark grammar the answer must follow, or None when nothing needs constraining. `reasoning` (a
        template with a `<think>` block): "optional", a forced answer may think first; "open", the prompt opened
        the block, so a forced answer closes it before its calls."""
        offered = tools.offered
        if not offered:
            return None
        call = f"call_json: %json {json.dumps(self._call_schema(offered), allow_nan=False)}"
        several = tools.is_parallel and self.allows_several
        thought = REASONING_PREFIXES.get(reasoning, "") if tools.is_forced else ""
        thought_rules = THOUGHT_RULES if thought else ""
        if not self.opening:  # the whole answer is one call
            start = f"start: {thought}call_json" if tools.is_forced else \
                "start: TEXT | call_json\nTEXT: /[^{](.|\\n)*/"
            return f"%llguidance {{}}\n{start}\n{call}\n{thought_rules}"
        tail = f'"{_lark_escape(self.closing)}"'
        if tools.is_forced:
            block = f'"{_lark_escape(self.opening)}" call_json {tail}'
            start = f'start: {thought}block ("\\n" block)*' if several else f"start: {thought}block"
            return f"%llguidance {{}}\n{start}\nblock: {block}\n{call}\n{thought_rules}"
        opening = _lark_escape(self.opening)
        if several:
            return (f"%llguidance {{}}\nstart: (opened call_json {tail})* TEXT\n"
                    f'opened[lazy]: TEXT "{opening}"\nTEXT: /(.|\\n)*/\n{call}\n')
        # one call at most: the text after it may not open another
        return (f"%llguidance {{}}\nstart: (opened call_json {tail})? REST\n"
                f'opened[lazy]: TEXT "{opening}"\nTEXT: /(.|\\n)*/\n'
                f'REST: /(?s:.*)/ & ~/(?s:.*){re.escape(self.opening.strip())}(?s:.*)/\n{call}\n')

    def _call_schema(self, offered: tuple[FunctionTool, ...]) -> dict:
        """One schema for every offered call; each tool's local `$ref`s (pydantic's `#/$defs/...`) pointed at
        where its parameters now lie."""
        def call(tool: FunctionTool, at: str) -> dict:
            location = f"{at}/properties/{self.arguments_key}"
            return {"type": "object", "additionalProperties": False, "required": ["name", self.arguments_key],
                    "properties": {"name": {"const": tool.name},
                                   self.arguments_key: _relocated(tool.parameters, location)}}

        if len(offered) == 1:
            schema = call(offered[0], "")
        else:
            schema = {"anyOf": [call(tool, f"/anyOf/{index}") for index, tool in enumerate(offered)]}
        return {**schema, "x-guidance": GRAMMAR_OPTIONS}

    # -- the prompt --------------------------------------------------------------------------------------------

    def prompt(self, messages: list[dict], tools: ToolRequest | None) -> tuple[list[dict], list[dict] | None]:
        """The messages and tools for the chat template. A native template gets them as they are (arguments as
        objects, as templates write them with `tojson`); for any other, tools are described in a system message,
        earlier calls become the assistant's text and results the user's, in this format."""
        offered = tools is not None and tools.offered
        if self.is_native:
            return [_with_argument_objects(m) for m in messages], tools.as_openai() if offered else None
        rewritten = [self._as_text(m) for m in messages]
        if offered:
            system = self.system_text(tools)
            if rewritten[0]["role"] == "system":
                rewritten[0] = {"role": "system", "content": f"{rewritten[0]['content']}\n\n{system}"}
            else:
                rewritten.insert(0, {"role": "system", "content": system})
        return rewritten, None

    def _as_text(self, message: dict) -> dict:
        if message["role"] == "tool":
            return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        if not message.get("tool_calls"):
            return message
        calls = "\n".join(self.call_text(call["function"]["name"], json.loads(call["function"]["arguments"]))
                          for call in message["tool_calls"])
        text = f"{message['content']}\n{calls}" if message.get("content") else calls
        return {"role": "assistant", "content": text}

    def call_text(self, name: str, arguments: dict) -> str:
        """An earlier call, as the model would have written it."""
        return f"{self.opening}{json.dumps({'name': name, self.arguments_key: arguments}, ensure_ascii=False)}" \
               f"{self.closing}"

    def system_text(self, tools: ToolRequest) -> str:
        """For a template without tools: what the model is told of them and of the format."""
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools.as_openai())
        example = self.call_text("function_name", {"argument": "value"})
        return (f"You may call these functions. They are described in JSON Schema inside <tools></tools>:\n"
                f"<tools>\n{listed}\n</tools>\nTo call one, answer with:\n{example}")


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", is_native=True)
GENERIC = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", is_native=False)
LLAMA3_JSON = ToolFormat("llama3-json", "", "", "parameters", is_native=True, allows_several=False)


def tool_format_for(chat_template: str | None) -> ToolFormat:
    """The call format a chat template speaks, or the generic one (Hermes-style, described in a system message)."""
    template = chat_template or ""
    if "<tool_call>" in template and "tools" in template:
        return HERMES
    if "tools" in template and ("<|python_tag|>" in template or "ipython" in template):
        return LLAMA3_JSON
    return GENERIC


# Before a forced call, a reasoning template's thinking: a `<think>` block, or the end of one the prompt opened.
# THOUGHT is the thinking and its closing tag in one lexeme (ending at the first `</think>`): the lexer cannot
# step back out of a lexeme that stopped matching several bytes in.
REASONING_PREFIXES = {"optional": "think? ", "open": "THOUGHT SPACE? "}
THOUGHT_RULES = ('think: "<think>" THOUGHT SPACE?\n'
                 "THOUGHT: /(?s:.*)<\\/think>/ & ~/(?s:.*)<\\/think>(?s:.+)/\nSPACE: /[ \\t\\n]+/\n")


def _relocated(schema: dict, location: str) -> dict:
    """A copy of `schema` whose local references ("#", "#/$defs/x") point into it at `location` (a JSON pointer
    of where it sits in a larger schema). JSON values (const, enum, default, examples) are left as they are."""
    def walk(node):
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        moved = {key: value if key in LITERAL_KEYWORDS else walk(value) for key, value in node.items()}
        reference = node.get("$ref")
        if isinstance(reference, str) and reference.startswith("#"):
            moved["$ref"] = "#" + location + reference[1:]
        return moved

    return walk(schema)  # bounded: the schema passed checked_schema's depth and size


def _with_argument_objects(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [{**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
             for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _lark_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def check_tool_grammar(grammar: str | None, max_output_chars: int | None = None) -> None:
    """Compile the tools' grammar in the parent (as JSON mode's schema is) so that a bad schema is a 400."""
    if grammar is not None:
        check_lark_compiles(grammar, TOOLS_SITE, max_output_chars or DEFAULT_MAX_OUTPUT_CHARS)


def constrained_sampling(sampling, tools: ToolRequest | None, tool_format: ToolFormat,
                         max_output_chars: int | None = None, reasoning: str | None = None):
    """`sampling` (SamplingParams) with the tools' grammar, checked: a 400 for a grammar llguidance refuses or for
    settings that would cut a forced call short or hold the answer past it."""
    if tools is None or not tools.offered:
        return sampling
    if sampling.response_format is not None:
        raise InvalidRequest("response_format cannot be combined with tools (the answer is text or calls); send "
                             "one of them, or tool_choice \"none\"", "response_format")
    if tools.is_forced and (sampling.stop or sampling.ignore_eos or sampling.min_tokens):
        raise InvalidRequest("stop, ignore_eos and min_tokens cannot be combined with a forced tool call "
                             "(tool_choice \"required\" or a function): the answer ends with its calls", "tool_choice")
    grammar = tool_format.grammar(tools, reasoning)
    check_tool_grammar(grammar, max_output_chars)
    return dataclasses.replace(sampling, tool_grammar=grammar)
