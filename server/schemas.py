"""Request and response bodies of the OpenAI-compatible API (pydantic), plus trellm's extra sampler fields.

Requests accept and ignore unknown fields (clients send ``user``, ``metadata``, ``store`` ...), but
every field the server reads is validated here: a bad value is a 400 before any work starts.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_LIST = 64
MAX_GRAMMAR_CHARS = 64 * 1024  # a regex, Lark grammar or one choice
MAX_TOOLS = 128
DRY_MAX_RANGE = 512  # DRY's penalty grows as base ** match length: a bounded window keeps it finite
GREEDY_BELOW_TEMPERATURE = 1e-4  # smaller temperatures overflow the logits; they mean greedy anyway

Float = float  # readability in the field declarations below


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions: OpenAI's, then trellm's own."""

    model: str = Field(..., max_length=512)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP_STRINGS} stop strings")
    temperature: float | None = Field(None, ge=0.0, le=100.0, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    user: str | None = None
    # trellm's sampler settings, under the names of trellm.samplers.SamplerSettings
    top_k: int | None = Field(None, ge=-1, description="0 or -1 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    typical_p: float | None = Field(None, gt=0.0, le=1.0)
    temperature_last: bool | None = None
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    penalty_range: int | None = Field(None, ge=0)
    dry_multiplier: float | None = Field(None, ge=0.0, le=100.0)
    dry_base: float | None = Field(None, ge=1.0, le=4.0)
    dry_allowed_length: int | None = Field(None, ge=1, le=4096)
    dry_sequence_breakers: list[Union[int, str]] | None = Field(None, max_length=MAX_LIST)
    dry_range: int | None = Field(None, ge=0, description=f"0 = the last {DRY_MAX_RANGE} tokens (the most allowed)")
    xtc_threshold: float | None = Field(None, ge=0.0, le=1.0)
    xtc_probability: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0)
    banned_strings: list[str] | None = Field(None, max_length=MAX_LIST)
    banned_tokens: list[int] | None = Field(None, max_length=4096)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_LIST)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # constrained output (trellm.grammar); vLLM's guided_* names are accepted too. At most one of them.
    json_schema: dict[str, Any] | None = Field(None, validation_alias=AliasChoices("json_schema", "guided_json"),
                                               description="the output is JSON valid under this schema")
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS, validation_alias=AliasChoices("regex", "guided_regex"),
                              description="the output matches this regex (Rust syntax)")
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS,
                                validation_alias=AliasChoices("grammar", "guided_grammar"),
                                description="the output follows this Lark grammar (or GBNF, with ::=)")
    choice: list[str] | None = Field(None, max_length=1024, validation_alias=AliasChoices("choice", "guided_choice"),
                                     description="the output is exactly one of these strings")


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="text, texts, token ids, or lists of token ids")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)


class ChatMessage(BaseModel):
    """One message; content is text or a list of parts (only text parts are understood). Assistant turns
    may carry ``tool_calls`` (content null), ``tool`` turns ``tool_call_id``; extra keys reach the template."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(..., max_length=64)
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = Field(None, max_length=32, description="passed to chat templates that read it")
    chat_template: str | None = Field(None, description="a Jinja chat template to use instead of the model's")
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class TokenEncodeRequest(_Request):
    text: Union[str, list[ChatMessage]] = Field(..., description="text, or chat messages rendered by the chat template")
    add_special_tokens: bool = True


class TokenDecodeRequest(_Request):
    tokens: list[int] = Field(..., max_length=1_000_000)
    skip_special_tokens: bool = False


class ModelLoadRequest(_Request):
    model: str = Field(..., description="HF model directory on the server's disk", max_length=4096)
    model_name: str | None = Field(None, max_length=512)
    cache_size: int | None = Field(None, ge=16)
    cache_bits: str | None = Field(None, description="'K,V' bits (2..8) for a quantized cache; '16' for fp16")
    draft_model: str | None = Field(None, max_length=4096)


class LoraLoadRequest(_Request):
    name: str = Field(..., min_length=1, max_length=256, pattern=r"^[^:]+$", description="served as '<model>:<name>'")
    path: str = Field(..., description="PEFT adapter directory: a name under the server's --models-dir", max_length=4096)
    scale: float = Field(1.0, description="multiplies the adapter's update")


class LoraUnloadRequest(_Request):
    name: str = Field(..., min_length=1, max_length=256)


# ---- responses (plain shapes; documented for the OpenAPI schema) -------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "trellm"
    max_model_len: int | None = Field(None, description="the most tokens (prompt + completion) one request may use")
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenEncodeResponse(BaseModel):
    tokens: list[int]
    length: int


class TokenDecodeResponse(BaseModel):
    text: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
