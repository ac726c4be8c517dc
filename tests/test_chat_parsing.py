"""Tool-call and reasoning parsers on replies written the way each model family writes them: the whole
parse, and the streamed deltas (fed in small pieces) adding up to the same message."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")

from trellm.server.chat_parsing import (  # noqa: E402
    TOOL_FORMATS, ReplyParser, ReplyStream, detect_reasoning, detect_tool_format, message_of,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
TWO_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "Europe/Paris"})]

REPLIES = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                   '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
               '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]',
    "deepseek_v3": 'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                   '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
                   '```json\n{"zone": "Europe/Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "glm45": 'Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n'
             '<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>get_time\n'
             '<arg_key>zone</arg_key>\n<arg_value>Europe/Paris</arg_value>\n</tool_call>',
    "qwen3_coder": 'Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                   '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n'
                   '<parameter=zone>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>',
}


def streamed(parser: ReplyParser, text: str, step: int) -> dict:
    """Feed ``text`` in pieces of ``step`` characters; merge the deltas like a client does."""
    stream = ReplyStream(parser)
    merged: dict = {"content": "", "reasoning_content": "", "calls": {}}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, final=i == len(pieces) - 1)
        merged["content"] += delta.get("content", "")
        merged["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            entry = merged["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            if "id" in call:
                assert call["type"] == "function" and call["id"].startswith("call_") and "name" not in entry or not entry["name"]
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"].get("arguments", "")
    return merged


@pytest.mark.parametrize("fmt", sorted(REPLIES))
def test_each_format_whole_and_streamed(fmt):
    parser = ReplyParser(tool_format=TOOL_FORMATS[fmt](TOOLS))
    text = REPLIES[fmt]
    message = message_of(parser.parse(text, final=True))
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert calls == TWO_CALLS
    assert message["content"] == ("Let me check." if fmt != "llama3_json" else None)
    for step in (1, 3, 17):
        got = streamed(parser, text, step)
        assert got["content"] == (message["content"] or "")
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(got["calls"].items())] == TWO_CALLS
        assert [c["arguments"] for _, c in sorted(got["calls"].items())] == [c["function"]["arguments"] for c in message["tool_calls"]]


def test_mistral_v11_calls():
    parser = ReplyParser(tool_format=TOOL_FORMATS["mistral"](TOOLS))
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"zone": "Europe/Paris"}'
    message = message_of(parser.parse(text, final=True))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == TWO_CALLS
    assert message["content"] is None


def test_deepseek_v31_calls():
    parser = ReplyParser(tool_format=TOOL_FORMATS["deepseek_v3"](TOOLS))
    text = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}<｜tool▁call▁end｜>'
            '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "Europe/Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    message = message_of(parser.parse(text, final=True))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == TWO_CALLS


def test_harmony_channels_reasoning_answer_and_call():
    parser = ReplyParser(tool_format=TOOL_FORMATS["harmony"](TOOLS), reasoning="harmony")
    call = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}')
    message = message_of(parser.parse(call, final=True))
    assert message["reasoning_content"] == "Need the weather." and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    answer = '<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.'
    got = streamed(ReplyParser(reasoning="harmony"), answer, 2)
    assert got["reasoning_content"] == "Easy." and got["content"] == "It is sunny." and not got["calls"]


def test_think_reasoning_split_streamed_and_whole():
    parser = ReplyParser(tool_format=TOOL_FORMATS["hermes"](TOOLS), reasoning="think")
    text = '<think>\nThe user wants weather.\n</think>\n\nSure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    parsed = parser.parse(text, final=True)
    assert parsed.reasoning == "\nThe user wants weather.\n" and parsed.content == "Sure."
    assert parsed.calls[0].name == "get_time"
    got = streamed(parser, text, 2)
    assert got["reasoning_content"] == parsed.reasoning and got["content"] == "Sure."
    opened = ReplyParser(reasoning="think", starts_in_reasoning=True)  # the template opened <think> in the prompt
    assert opened.parse("thinking...</think>Answer", final=True).reasoning == "thinking..."
    assert opened.parse("still thinking", final=True).content == ""


def test_text_that_is_not_a_call_stays_content():
    parser = ReplyParser(tool_format=TOOL_FORMATS["hermes"](TOOLS))
    text = "I would use <tool_call> here but {broken json</tool_call>"
    assert message_of(parser.parse(text, final=True)) == {"role": "assistant", "content": text}
    assert ReplyParser(tool_format=TOOL_FORMATS["llama3_json"](TOOLS)).parse("Plain answer.", final=True).content == "Plain answer."
    assert streamed(parser, "a < b, and <tool", 1)["content"] == "a < b, and <tool"


def test_detection_from_templates():
    assert detect_tool_format("{{ '<tool_call>' }}") == "hermes"
    assert detect_tool_format("<tool_call>\n<function=x>") == "qwen3_coder"
    assert detect_tool_format("<arg_key>{{ k }}</arg_key>") == "glm45"
    assert detect_tool_format("[TOOL_CALLS]") == "mistral"
    assert detect_tool_format("<|python_tag|>") == "llama3_json"
    assert detect_tool_format("<|channel|>") == "harmony"
    assert detect_tool_format("<｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert detect_tool_format(None) == "hermes"
    assert detect_reasoning("<think>") == "think" and detect_reasoning("<|channel|>") == "harmony" and detect_reasoning("") == "none"


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_forced_call_grammars_accept_the_format(fmt, smollm2_dir):
    """Each format's forcing grammar compiles and accepts a call written in that format."""
    import llguidance

    from trellm.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    lltok = llguidance.LLTokenizer(tok.backend.to_str())
    grammar = TOOL_FORMATS[fmt](TOOLS).grammar(TOOLS, parallel=True, literal=lambda s: json.dumps(s))
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    written = {
        "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}',
        "mistral": REPLIES["mistral"][len("Let me check."):],
        "llama3_json": REPLIES["llama3_json"][len("<|python_tag|>"):],
        "deepseek_v3": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
                        '<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    }
    text = written[fmt] if fmt in written else REPLIES[fmt].split("\n", 1)[1]
    ids = tok.encode(text, add_special_tokens=False)
    assert matcher.validate_tokens(ids) == len(ids), (fmt, tok.decode(ids[: matcher.validate_tokens(ids) + 1]))
