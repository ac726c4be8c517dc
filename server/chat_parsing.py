"""What a chat model's raw output means: reasoning, content and tool calls, for whole and streamed replies.

Each format is a :class:`ToolFormat` (how calls look in the text, how to force them with a grammar)
and optionally a reasoning split (``<think>`` tags, or harmony channels, which carry both). Parsing
is done on the whole text so far: a stream re-parses after every chunk and sends what grew
(:class:`ReplyStream`), so the whole and the streamed answer always agree. Text that may still turn
into a marker (``<tool_ca``) is held back until it is decided.

Formats (facts from the models' chat templates and vLLM's parsers; no code taken from them):

- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, repeated.
- ``llama3_json`` (Llama 3.1-3.3): the reply is ``{"name": ..., "parameters": {...}}`` (``<|python_tag|>``
  may lead; several calls separated by ``;``).
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or (v11+ tokenizers)
  ``[TOOL_CALLS]name[ARGS]{...}`` per call.
- ``harmony`` (gpt-oss): messages ``<|channel|>analysis<|message|>...<|end|>`` (reasoning),
  ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`` (a call),
  ``<|channel|>final<|message|>...`` (the answer).
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``;
  V3.1 writes ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``; both are read.
- ``glm45`` (GLM 4.5/4.6): ``<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>``.
- ``qwen3_coder``: ``<tool_call>\\n<function=NAME>\\n<parameter=k>\\nv\\n</parameter>\\n</function>\\n</tool_call>``.
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any, Callable, ClassVar, Iterator, Sequence

import attrs

from trellm.grammar import JSON_WHITESPACE, lark_literal


@attrs.define
class ToolCall:
    name: str
    arguments: str  # JSON text; while streaming, the part known so far
    complete: bool = True


@attrs.define
class Parsed:
    content: str = ""
    calls: list[ToolCall] = attrs.field(factory=list)
    reasoning: str = ""


def held_back(text: str, markers: Sequence[str]) -> int:
    """Where a tail of ``text`` that could still grow into one of ``markers`` begins (len(text) if none)."""
    cut = len(text)
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:n]):
                cut = min(cut, len(text) - n)
                break
    return cut


def undecided(text: str, markers: Sequence[str]) -> str:
    """The part of a streamed ``text`` that is surely content: without a tail that may become a marker,
    and without trailing blanks (dropped when a call follows)."""
    return text[: held_back(text, markers)].rstrip()


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object/array/string starting at ``text[start]`` (blanks skipped), or None
    while it is incomplete."""
    i = start
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        elif depth == 0 and c not in " \t\r\n":  # a bare number / literal: ends at a delimiter
            m = re.match(r"[^,}\]\s]+", text[j:])
            return j + m.end() if j + m.end() < len(text) else None
    return None


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def json_call(body: str, final: bool, args_keys: Sequence[str] = ("arguments", "parameters")) -> ToolCall | None:
    """A call written as one JSON object ``{"name": ..., "arguments": {...}}``, partial while streaming.
    The arguments are the model's own JSON text (so streamed pieces add up to the final text).
    Final: None unless the object parses with a string name and object arguments."""
    if final:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        if not any(isinstance(obj.get(k), dict) for k in args_keys):
            return None
    name = _NAME.search(body)
    if name is None:
        return None
    key = re.search(r'"(?:%s)"\s*:\s*' % "|".join(args_keys), body)
    if key is None:
        return ToolCall(json.loads(f'"{name.group(1)}"'), "", complete=False)
    end = json_value_end(body, key.end())
    return ToolCall(json.loads(f'"{name.group(1)}"'), body[key.end():end].strip(), complete=end is not None)


# ---- tool formats -------------------------------------------------------------------------------------


Literal = Callable[[str], str]  # a marker as a Lark terminal: a special token by id, else a quoted string


class ToolFormat:
    """How one model family writes tool calls. ``parse`` splits text into content and calls;
    ``grammar`` is the Lark grammar that forces one call (or several) to the given tools."""

    name: ClassVar[str]
    template_markers: ClassVar[tuple[str, ...]] = ()  # any of these in a chat template picks the format
    markers: ClassVar[tuple[str, ...]] = ()  # text that opens calls (held back while it may be forming)
    special_tokens: ClassVar[bool] = False  # the markers are special tokens: decode them into the text

    def __init__(self, tools: Sequence[dict] = ()):
        self.tools = {t["function"]["name"]: t["function"] for t in tools if isinstance(t.get("function"), dict)}

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def grammar(self, tools: Sequence[dict], parallel: bool, literal: Literal) -> str:
        raise NotImplementedError

    def render_calls(self, calls: Sequence[dict]) -> str:
        """Calls written back as text, for templates that do not render ``tool_calls`` themselves."""
        return "\n".join(f'<tool_call>\n{json.dumps({"name": c["name"], "arguments": c["arguments"]})}\n</tool_call>'
                         for c in calls)

    def _blocks(self, text: str, at: int) -> Iterator[tuple[str, bool]]:
        """Each ``<tool_call>`` block's body from the marker at ``at`` on, and whether it is closed yet."""
        while at >= 0:
            start = at + len("<tool_call>")
            end = text.find("</tool_call>", start)
            yield (text[start:] if end < 0 else text[start:end]), end >= 0
            at = -1 if end < 0 else text.find("<tool_call>", end)

    def _content_before(self, text: str, final: bool) -> tuple[str, int]:
        """(content before the first marker, index of that marker or -1)."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if found:
            return text[: min(found)].rstrip() if not final else text[: min(found)], min(found)
        return (text if final else undecided(text, self.markers)), -1

    def param_types(self, function: str) -> dict[str, Any]:
        return ((self.tools.get(function) or {}).get("parameters") or {}).get("properties") or {}

    def typed(self, function: str, key: str, value: str) -> Any:
        """An XML-style argument value as JSON: strings stay text, other schema types are parsed."""
        kind = self.param_types(function).get(key, {}).get("type")
        if kind == "string":
            return value
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value


def schema_json(schema: dict) -> str:
    """``%json{...}`` for a Lark grammar, with the blanks rule of trellm.grammar."""
    return "%json" + json.dumps({**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})


def parameters_of(tool: dict) -> dict:
    params = (tool.get("function") or {}).get("parameters") or {"type": "object"}
    return params if params.get("type") == "object" or "properties" in params else {"type": "object"}


def _json_call_rules(tools: Sequence[dict], args_key: str) -> list[str]:
    rules = []
    for i, tool in enumerate(tools):
        schema = {"type": "object", "properties": {"name": {"const": tool["function"]["name"]}, args_key: parameters_of(tool)},
                  "required": ["name", args_key], "additionalProperties": False}
        rules.append(f"fn{i}: {schema_json(schema)}")
    return rules


def _alternatives(count: int) -> str:
    return " | ".join(f"fn{i}" for i in range(count))


class Hermes(ToolFormat):
    name = "hermes"
    template_markers = ("<tool_call>",)
    markers = ("<tool_call>",)

    def parse(self, text: str, final: bool) -> Parsed:
        content, at = self._content_before(text, final)
        calls: list[ToolCall] = []
        for body, closed in self._blocks(text, at):
            call = json_call(body.strip(), final=final and closed)
            if call is None and final:
                return Parsed(content=text, calls=[])  # not a call after all: the whole reply is text
            if call is not None:
                calls.append(call)
        return Parsed(content=content.rstrip() if calls else content, calls=calls)

    def grammar(self, tools, parallel, literal):
        call = f'call: {literal("<tool_call>")} "\\n" ({_alternatives(len(tools))}) "\\n" {literal("</tool_call>")}'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join([start, call, *_json_call_rules(tools, "arguments")])


class Llama3Json(ToolFormat):
    name = "llama3_json"
    template_markers = ("<|python_tag|>", '"parameters": dictionary of argument name')
    markers = ("<|python_tag|>",)
    special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].lstrip()
        elif not body.startswith("{"):
            return Parsed(content=text if final else undecided(text, self.markers))
        calls, pos = [], 0
        while pos < len(body):
            end = json_value_end(body, pos)
            call = json_call(body[pos:end].strip() if end else body[pos:].strip(), final=final and end is not None)
            if call is None:
                return Parsed(content=text) if final else Parsed(calls=calls)
            calls.append(call)
            if end is None:
                break
            rest = body[end:]
            sep = re.match(r"\s*;?\s*", rest)
            pos = end + sep.end()
        return Parsed(calls=calls)

    def grammar(self, tools, parallel, literal):
        start = 'start: fn ("; " fn)*' if parallel else "start: fn"
        return "\n".join([start, f"fn: {_alternatives(len(tools))}", *_json_call_rules(tools, "parameters")])

    def render_calls(self, calls):
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)


class Mistral(ToolFormat):
    name = "mistral"
    template_markers = ("[TOOL_CALLS]",)
    markers = ("[TOOL_CALLS]",)
    special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        content, at = self._content_before(text, final)
        if at < 0:
            return Parsed(content=content)
        rest = text[at + len("[TOOL_CALLS]"):]
        calls: list[ToolCall] = []
        if rest.lstrip().startswith("["):  # a JSON list of calls
            inner = rest.lstrip()[1:]
            pos = 0
            while True:
                m = re.match(r"[\s,]*", inner[pos:])
                pos += m.end()
                if pos >= len(inner) or inner[pos] != "{":
                    break
                end = json_value_end(inner, pos)
                call = json_call(inner[pos:end] if end else inner[pos:], final=final and end is not None)
                if call is None:
                    return Parsed(content=text) if final else Parsed(content=content, calls=calls)
                calls.append(call)
                if end is None:
                    break
                pos = end
        else:  # name[ARGS]{...}, each call behind its own [TOOL_CALLS]
            for part in rest.split("[TOOL_CALLS]"):
                name, sep, args = part.partition("[ARGS]")
                if not sep:
                    break
                name = name.split("[CALL_ID]")[0].strip()
                end = json_value_end(args, 0)
                if final and end is None:
                    return Parsed(content=text)
                calls.append(ToolCall(name, args[:end].strip(), complete=end is not None))
        return Parsed(content=content.rstrip() if calls else content, calls=calls)

    def grammar(self, tools, parallel, literal):
        if literal("[ARGS]").startswith("<["):  # v11+ tokenizers: name[ARGS]{...}
            fns = [f'fn{i}: {literal("[TOOL_CALLS]")} {lark_literal(t["function"]["name"])} {literal("[ARGS]")} '
                   f'{schema_json(parameters_of(t))}' for i, t in enumerate(tools)]
            return "\n".join(["start: call+" if parallel else "start: call", f"call: {_alternatives(len(tools))}", *fns])
        start = (f'start: {literal("[TOOL_CALLS]")} "[" call (", " call)* "]"' if parallel
                 else f'start: {literal("[TOOL_CALLS]")} "[" call "]"')
        return "\n".join([start, f"call: {_alternatives(len(tools))}", *_json_call_rules(tools, "arguments")])

    def render_calls(self, calls):
        return "[TOOL_CALLS]" + json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls])


class DeepSeekV3(ToolFormat):
    name = "deepseek_v3"
    CALLS, CALL, SEP, END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    template_markers = ("<｜tool▁calls▁begin｜>",)
    markers = (CALLS, CALL)
    special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        content, at = self._content_before(text, final)
        calls: list[ToolCall] = []
        pos = text.find(self.CALL, at) if at >= 0 else -1
        while pos >= 0:
            head_start = pos + len(self.CALL)
            sep = text.find(self.SEP, head_start)
            if sep < 0:
                break
            end = text.find(self.END, sep)
            head, body = text[head_start:sep].strip(), text[sep + len(self.SEP): end if end >= 0 else len(text)]
            if head == "function":  # V3: NAME then a ```json block
                name, _, body = body.partition("\n")
                if not _:
                    break
                body = body.lstrip()
                if "```json".startswith(body.rstrip()):  # the fence is still being written
                    body = ""
                body = body.removeprefix("```json")
            else:
                name = head
            done = end >= 0
            stop = json_value_end(body, 0)
            if final and (not done or stop is None):
                return Parsed(content=text)
            calls.append(ToolCall(name.strip(), body[:stop].strip(), complete=done))
            pos = text.find(self.CALL, end) if done else -1
        return Parsed(content=content.rstrip() if calls else content, calls=calls)

    def grammar(self, tools, parallel, literal):
        fns = [f'fn{i}: {literal(self.CALL)} {lark_literal(t["function"]["name"])} {literal(self.SEP)} '
               f'{schema_json(parameters_of(t))} {literal(self.END)}' for i, t in enumerate(tools)]
        body = "fn+" if parallel else "fn"
        return "\n".join([f"start: {literal(self.CALLS)} calls {literal('<｜tool▁calls▁end｜>')}",
                          f"calls: {body}", f"fn: {_alternatives(len(tools))}", *fns])


def _xml_value_rule(rule: str, schema: dict, close: str) -> str:
    """A Lark rule for one XML-style argument value and the text that closes it. A string is text without
    ``<`` (one regex with the closing text, so the lexer never has to guess where the value ends, and not
    ending in a newline when the closing text starts with one); other types are JSON."""
    if schema.get("type") == "string" and not schema.get("enum"):
        body = "([^<]*[^<\\n])?" if close.startswith("\n") else "[^<]*"
        closing = "".join("\\n" if c == "\n" else "\\" + c if c in "/.^$*+?()[]{}|\\" else c for c in close)
        return f"{rule}: /{body}{closing}/"
    return f"{rule}: {schema_json(schema)} {lark_literal(close)}"


class XmlToolFormat(ToolFormat):
    """Calls with one XML-style element per argument inside ``<tool_call>`` blocks. ``CALL`` and ``ARG``
    are the text a call and an argument are written as; the grammar and ``render_calls`` follow them,
    ``find_call`` reads a block (leniently, as models write them)."""

    markers = ("<tool_call>",)
    CALL: ClassVar[str]  # with {name} and {args}
    ARG: ClassVar[str]  # with {key} and {value}

    def find_call(self, block: str, closed: bool) -> tuple[str, list[tuple[str, str]]] | None:
        """(name, [(key, raw value)]) of a block, or None while its name is still being written."""
        raise NotImplementedError

    def parse(self, text: str, final: bool) -> Parsed:
        content, at = self._content_before(text, final)
        calls: list[ToolCall] = []
        for block, closed in self._blocks(text, at):
            found = self.find_call(block, closed)
            if found is None:
                break
            name, pairs = found
            args = {k.strip(): self.typed(name, k.strip(), v) for k, v in pairs}
            calls.append(_xml_call(name, args, complete=closed))
        if final and any(not c.complete for c in calls):
            return Parsed(content=text)
        return Parsed(content=content.rstrip() if calls else content, calls=calls)

    def grammar(self, tools, parallel, literal):
        call_open, rest = self.CALL.split("{name}")
        name_to_args, call_close = rest.split("{args}")
        arg_open, rest = self.ARG.split("{key}")
        key_to_value, value_close = rest.split("{value}")
        rules = []
        for i, tool in enumerate(tools):
            params = parameters_of(tool)
            required = set(params.get("required") or [])
            parts = []
            for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
                pair = f"{lark_literal(arg_open)} {lark_literal(key)} {lark_literal(key_to_value)} v{i}_{j}"
                parts.append(f"({pair})" + ("" if key in required else "?"))
                rules.append(_xml_value_rule(f"v{i}_{j}", schema, value_close))
            rules.append(f"fn{i}: {lark_literal(call_open)} {lark_literal(tool['function']['name'])} "
                         f"{lark_literal(name_to_args)} {' '.join(parts)} {lark_literal(call_close)}")
        start = 'start: fn ("\\n" fn)*' if parallel else "start: fn"
        return "\n".join([start, f"fn: {_alternatives(len(tools))}", *rules])

    def render_calls(self, calls):
        return "\n".join(self.CALL.format(name=c["name"], args="".join(
            self.ARG.format(key=k, value=v if isinstance(v, str) else json.dumps(v))
            for k, v in c["arguments"].items())) for c in calls)


class Glm45(XmlToolFormat):
    name = "glm45"
    template_markers = ("<arg_key>",)
    CALL = "<tool_call>{name}\n{args}</tool_call>"
    ARG = "<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n"
    PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def find_call(self, block, closed):
        if not closed and "\n" not in block and "<arg_key>" not in block:
            return None
        return re.split(r"\n|<arg_key>", block, maxsplit=1)[0].strip(), self.PAIR.findall(block)


class Qwen3Coder(XmlToolFormat):
    name = "qwen3_coder"
    template_markers = ("<function=",)
    CALL = "<tool_call>\n<function={name}>\n{args}</function>\n</tool_call>"
    ARG = "<parameter={key}>\n{value}\n</parameter>\n"
    PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def find_call(self, block, closed):
        fn = re.search(r"<function=([^>\n]+)>", block)
        return None if fn is None else (fn.group(1).strip(), self.PARAM.findall(block))


def _xml_call(name: str, args: dict, complete: bool) -> ToolCall:
    """XML-style arguments as JSON text; while the call is open, without the closing brace (so what
    is sent grows into the final text)."""
    text = json.dumps(args, ensure_ascii=False)
    return ToolCall(name, text if complete else text[:-1], complete=complete)


class Harmony(ToolFormat):
    """gpt-oss: reasoning, answer and calls are channels of one reply."""

    name = "harmony"
    template_markers = ("<|channel|>",)
    markers = ("<|channel|>", "<|start|>")
    special_tokens = True
    ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
    MESSAGE = re.compile(r"(?:<\|start\|>[^<]*)?(?P<header>(?:<\|channel\|>)?[^<]*(?:<\|constrain\|>[^<]*)?)<\|message\|>"
                         r"(?P<body>.*?)(?P<end><\|end\|>|<\|call\|>|<\|return\|>|$)", re.S)

    def parse(self, text: str, final: bool) -> Parsed:
        out = Parsed()
        if "<|message|>" not in text:
            if "<|channel|>" not in text and "<|start|>" not in text:  # a reply without channels is the answer
                out.content = text if final else undecided(text, self.markers)
            return out
        for m in self.MESSAGE.finditer(text):
            header, body = m.group("header"), m.group("body")
            if not m.group("end") and not final:  # an open message: its end marker may be forming
                body = body[: held_back(body, self.ENDS)]
            recipient = re.search(r"to=functions\.([^\s<]+)", header)
            channel = re.search(r"<\|channel\|>(\w+)", header)
            channel = channel.group(1) if channel else ""
            if recipient:
                end = json_value_end(body, 0)
                complete = bool(m.group("end")) or final
                if final and end is None:
                    continue
                out.calls.append(ToolCall(recipient.group(1), body[:end].strip(), complete))
            elif channel == "analysis":
                out.reasoning += body
            else:
                out.content += body
            if not m.group("end") and not final:
                break
        return out

    def grammar(self, tools, parallel, literal):
        fns = [f'fn{i}: {literal("<|channel|>")} "commentary to=functions." {lark_literal(t["function"]["name"])} " " '
               f'{literal("<|constrain|>")} "json" {literal("<|message|>")} {schema_json(parameters_of(t))}'
               for i, t in enumerate(tools)]
        return "\n".join(["start: fn", f"fn: {_alternatives(len(tools))}", *fns])


TOOL_FORMATS: dict[str, type[ToolFormat]] = {
    f.name: f for f in (Hermes, Llama3Json, Mistral, Harmony, DeepSeekV3, Glm45, Qwen3Coder)
}
# Checked in this order against a chat template: the more specific markers first.
DETECTION_ORDER = (Harmony, Qwen3Coder, Glm45, DeepSeekV3, Mistral, Llama3Json, Hermes)
REASONING_PARSERS = ("think", "harmony", "none")


def detect_tool_format(template: str | None) -> str:
    """The tool format a chat template writes (hermes when nothing matches: the most common one)."""
    for fmt in DETECTION_ORDER:
        if template and any(m in template for m in fmt.template_markers):
            return fmt.name
    return Hermes.name


def detect_reasoning(template: str | None) -> str:
    if template and "<|channel|>" in template:
        return "harmony"
    if template and "<think>" in template:
        return "think"
    return "none"


# ---- reasoning split -------------------------------------------------------------------------------------


def split_think(text: str, final: bool, starts_open: bool) -> tuple[str, str]:
    """(reasoning, rest) of a reply that may begin with ``<think>`` (or inside it, when the prompt opened it)."""
    body = text.lstrip() if not starts_open else text
    if not starts_open:
        if not body.startswith("<think>"):
            if not final and "<think>".startswith(body) and body:
                return "", ""
            return "", text
        body = body[len("<think>"):]
    close = body.find("</think>")
    if close < 0:
        return (body if final else body[: held_back(body, ("</think>",))]), ""
    return body[:close], body[close + len("</think>"):].lstrip()


# ---- one reply ---------------------------------------------------------------------------------------------


@attrs.define
class ReplyParser:
    """Turns one choice's raw text into reasoning, content and tool calls (both whole and streamed)."""

    tool_format: ToolFormat | None = None  # None: tool calls are not parsed (no tools, or tool_choice none)
    reasoning: str = "none"  # think | harmony | none
    starts_in_reasoning: bool = False  # the prompt ends inside an open <think>

    def parse(self, text: str, final: bool) -> Parsed:
        if self.reasoning == "harmony" or isinstance(self.tool_format, Harmony):
            parsed = Harmony().parse(text, final) if not isinstance(self.tool_format, Harmony) else self.tool_format.parse(text, final)
            if self.tool_format is None:
                parsed.calls = []
            if self.reasoning != "harmony":
                parsed.reasoning = ""
            return parsed
        reasoning, rest = split_think(text, final, self.starts_in_reasoning) if self.reasoning == "think" else ("", text)
        parsed = self.tool_format.parse(rest, final) if self.tool_format is not None else Parsed(content=rest)
        parsed.reasoning = reasoning
        return parsed


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ReplyStream:
    """Streams one choice: after each text chunk, the deltas OpenAI sends (``reasoning_content``,
    ``content``, ``tool_calls`` with index, id, name, then argument pieces)."""

    def __init__(self, parser: ReplyParser):
        self.parser = parser
        self.text = ""
        self.sent_reasoning = ""
        self.sent_content = ""
        self.sent_calls: list[tuple[str, str]] = []  # (id, arguments sent)

    def feed(self, chunk: str, final: bool = False) -> dict:
        """The delta for ``chunk`` (an empty dict when nothing is decided yet)."""
        self.text += chunk
        parsed = self.parser.parse(self.text, final)
        delta: dict[str, Any] = {}
        for key, now, attr in (("reasoning_content", parsed.reasoning, "sent_reasoning"),
                               ("content", parsed.content, "sent_content")):
            sent = getattr(self, attr)
            if len(now) > len(sent) and now.startswith(sent):
                delta[key] = now[len(sent):]
                setattr(self, attr, now)
        calls = []
        for i, call in enumerate(parsed.calls):
            if i >= len(self.sent_calls):
                call_id = new_call_id()
                self.sent_calls.append((call_id, ""))
                calls.append({"index": i, "id": call_id, "type": "function", "function": {"name": call.name, "arguments": ""}})
            call_id, sent = self.sent_calls[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                piece = call.arguments[len(sent):]
                self.sent_calls[i] = (call_id, call.arguments)
                if calls and calls[-1]["index"] == i:
                    calls[-1]["function"]["arguments"] += piece
                else:
                    calls.append({"index": i, "function": {"arguments": piece}})
        if calls:
            delta["tool_calls"] = calls
        return delta

    @property
    def has_calls(self) -> bool:
        return bool(self.sent_calls)


def message_of(parsed: Parsed) -> dict:
    """The assistant message of a whole (non-streamed) reply."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content if parsed.content or not parsed.calls else None}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.calls:
        message["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
    return message
