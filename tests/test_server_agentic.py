"""Structured output and tool calls through the real server (SmolLM2 on CPU, 127.0.0.1) with the official
``openai`` client: JSON-schema answers that validate, grammar fields, forced tool calls streamed and not,
the agent round trip, and the OpenAI Agents SDK running its tool loop against the server."""
from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from trellm.server.config import ServerConfig  # noqa: E402
from trellm.server.testing import ServerThread  # noqa: E402

API_KEY = "test-api-key-agentic"
PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"type": "string", "enum": ["engineer", "doctor", "artist"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
    },
    "required": ["name", "age", "role", "address", "skills", "rating"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}}, "required": ["zone"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = ServerConfig(model=str(smollm2_dir), api_key=API_KEY, admin_key=API_KEY + "-admin", device="cpu",
                          cache_size=8192, page_size=64, max_batch_size=8, max_queue=8)
    with ServerThread(config) as s:
        s.model = s.host.model_name
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.mark.parametrize("prompt", ["Invent a person who lives in Berlin.", "Describe a doctor as a profile.",
                                    "Give me a profile of an artist named Mia."])
def test_json_schema_answers_validate(server, client, prompt):
    r = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": prompt}], max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "profile", "schema": PROFILE, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PROFILE)
    assert r.choices[0].finish_reason == "stop"


def test_json_schema_streamed_and_json_object(server, client):
    chunks = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "A person, please."}], max_tokens=200, temperature=0.7,
        seed=5, stream=True, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PROFILE}})
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), PROFILE)
    ask = 'Reply with a JSON object holding one key "answer": what is 2+2?'
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": ask}],
                                       max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content


def test_regex_choice_and_grammar_fields(server, client):
    chat = dict(model=server.model, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=16, temperature=0)
    assert client.chat.completions.create(**chat, extra_body={"choice": ["yes", "no"]}).choices[0].message.content in ("yes", "no")
    text = client.chat.completions.create(**chat, extra_body={"regex": r"(Yes|No), [a-z]+\."}).choices[0].message.content
    assert text.split(",")[0] in ("Yes", "No") and text.endswith(".")
    lark = 'start: "Answer: " WORD\nWORD: /[a-z]{2,8}/'
    text = client.completions.create(model=server.model, prompt="Q: colour of grass?", max_tokens=12, temperature=0,
                                     extra_body={"guided_grammar": lark}).choices[0].text
    assert text.startswith("Answer: ") and text[8:].isalpha()
    with pytest.raises(openai.BadRequestError, match="unclosed character class"):
        client.chat.completions.create(**chat, extra_body={"regex": "[a-z"})
    with pytest.raises(openai.BadRequestError, match="at most one"):
        client.chat.completions.create(**chat, extra_body={"regex": "a", "choice": ["b"]})


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def check_weather(args: dict) -> None:
    jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_tool_choice_named_and_required(server, client):
    named = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER, TIME], max_tokens=80,
                                           temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (name, args), = calls_of(choice.message)
    assert name == "get_weather" and choice.message.tool_calls[0].id.startswith("call_")
    check_weather(args)
    required = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER, TIME], max_tokens=80,
                                              temperature=0, tool_choice="required", parallel_tool_calls=False)
    (name, args), = calls_of(required.choices[0].message)
    assert name in ("get_weather", "get_time")
    jsonschema.validate(args, (WEATHER if name == "get_weather" else TIME)["function"]["parameters"])


def test_tool_calls_streamed_like_openai(server, client):
    kwargs = dict(model=server.model, messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs)
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and all(d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 2  # the arguments arrive in pieces
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


def test_agent_round_trip(server, client):
    """Call forced, then the tool's answer goes back (assistant content null + tool_calls, a tool message)."""
    first = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0,
                                           tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    answer = client.chat.completions.create(model=server.model, messages=history, tools=[WEATHER], max_tokens=40,
                                            temperature=0, tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_tool_requests_that_cannot_work_are_400(server, client):
    base = dict(model=server.model, messages=ASK, max_tokens=8)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(**base, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(**base, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="arguments is not JSON"):
        client.chat.completions.create(**{**base, "messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(**base, response_format={"type": "xml"})


def test_openai_agents_sdk_tool_loop(server):
    """The OpenAI Agents SDK drives a whole tool loop: the forced first turn calls the tool, the SDK runs
    it and sends the result back (tool_choice none from then on), the model answers."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        seen.append(city)
        return f"It is 21 degrees and sunny in {city}."

    class AnswerAfterTools(agents.AgentHooks):
        """Once a tool has answered, the next turn must be text (a 135M model would otherwise call again)."""

        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    model = agents.OpenAIChatCompletionsModel(
        model=server.model, openai_client=openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer weather questions with the get_weather tool.",
                         tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
                         tool_use_behavior="run_llm_again", reset_tool_choice=False, hooks=AnswerAfterTools())
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    kinds = [type(item).__name__ for item in result.new_items]
    assert seen and all(isinstance(c, str) and c for c in seen)
    assert "ToolCallItem" in kinds and "ToolCallOutputItem" in kinds and kinds[-1] == "MessageOutputItem"
    assert isinstance(result.final_output, str) and result.final_output
