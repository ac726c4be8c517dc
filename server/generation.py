"""From an OpenAI request to trellm jobs and back: prompts, sampler settings, jobs, result merging.

The routes stay thin: they validate and shape JSON; this module owns everything between a parsed
request body and the generator's results, including cleanup when a client goes away.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Sequence, TypeVar

import attrs
from starlette.requests import Request
from starlette.responses import StreamingResponse

from trellm.generator import AsyncJob, Job, JobFinished, JobTooLargeError, SamplerSettings, TokenChunk
from trellm.grammar import Grammar, GrammarError
from trellm.lora import LoraError

from .chat_parsing import (
    TOOL_FORMATS, ReplyParser, ToolFormat, detect_reasoning, detect_tool_format, lark_literal,
)

from .engine import ModelHost, QueueFullError
from .errors import APIError, bad_request
from .limits import check_chat_request, check_image_pixels, check_prompt_bytes
from .template_sandbox import render_request_template
from .schemas import DRY_MAX_RANGE, GREEDY_BELOW_TEMPERATURE, MAX_STOP_STRINGS, ChatCompletionRequest, ChatMessage, SamplingFields

log = logging.getLogger("trellm.server")
T = TypeVar("T")

SEED_MODULUS = 2**63
# SamplerSettings fields a request may set under the same name (None = not given = neutral).
PASSTHROUGH_SAMPLER_FIELDS = (
    "top_p", "min_p", "typical_p", "temperature_last", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "penalty_range", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_range", "xtc_threshold", "xtc_probability",
)


# ---- prompts -----------------------------------------------------------------------------------------


def encode_text(tokenizer, text: str, add_special_tokens: bool, param: str) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as exc:  # e.g. lone surrogates the Rust tokenizer refuses
        raise bad_request(f"cannot tokenize {param}: {exc}", param=param) from None


def completion_prompts(host: ModelHost, prompt: Any) -> list[list[int]]:
    """OpenAI's four prompt shapes -> a list of token-id prompts. Blocking (tokenizes): call it in a worker thread."""
    tok = host.tokenizer
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt is empty", param="prompt")
    if len(prompts) > 64:
        raise bad_request(f"at most 64 prompts per request, got {len(prompts)}", param="prompt")
    check_prompt_bytes(host.config, (p for p in prompts if isinstance(p, str)), "prompt")
    out = []
    for p in prompts:
        ids = encode_text(tok, p, True, "prompt") if isinstance(p, str) else [int(t) for t in p]
        check_token_ids(host, ids, "prompt")
        out.append(ids)
    return out


def check_token_ids(host: ModelHost, ids: Sequence[int], param: str) -> None:
    if not ids:
        raise bad_request(f"{param} is empty (no tokens)", param=param)
    vocab = host.tokenizer.vocab_size if host.tokenizer is not None else None
    model_vocab = int(getattr(host.lm.config, "vocab_size", 0) or 0)
    limit = min(v for v in (vocab, model_vocab) if v) if (vocab or model_vocab) else None
    if limit is not None:
        bad = [t for t in ids if t < 0 or t >= limit]
        if bad:
            raise bad_request(f"{param}: token id {bad[0]} is outside the vocabulary (0..{limit - 1})", param=param)


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict]:
    """Messages as plain dicts for the template; content parts joined (text parts only), null content as
    "" and tool-call arguments as objects (what HF templates expect)."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        d.setdefault("content", "")
        if "tool_calls" in d:
            d["tool_calls"] = template_tool_calls(d["tool_calls"], f"messages[{i}].tool_calls")
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content: only text parts are supported, got type {part.get('type')!r}",
                                      param=f"messages[{i}].content")
                texts.append(part["text"])
            d["content"] = "".join(texts)
        out.append(d)
    return out


def template_tool_calls(calls: Any, param: str) -> list[dict]:
    """An assistant turn's OpenAI ``tool_calls`` with their JSON-text arguments parsed (400 when malformed)."""
    if not isinstance(calls, list):
        raise bad_request(f"{param}: expected a list of tool calls", param=param)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{param}[{j}]: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param=param)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError as exc:
                raise bad_request(f"{param}[{j}].function.arguments is not JSON: {exc}", param=param) from None
        if not isinstance(args, dict):
            raise bad_request(f"{param}[{j}].function.arguments must be a JSON object, got {type(args).__name__}", param=param)
        out.append({**call, "function": {**fn, "arguments": args}, "name": fn["name"], "arguments": args})
    return out


def has_image_parts(messages: Sequence[ChatMessage]) -> bool:
    return any(isinstance(m.content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m.content)
               for m in messages)


def split_image_messages(messages: Sequence[ChatMessage]) -> tuple[list[dict], list[Any]]:
    """Messages with ``image_url`` parts -> (template messages with {"type": "image"} parts, decoded images); 400 on bad ones."""
    from trellm.multimodal import ImageError, split_openai_messages

    try:
        return split_openai_messages([m.model_dump(exclude_none=True) for m in messages])
    except ImageError as exc:  # remote URL, bad base64, not an image, too large ...
        raise bad_request(str(exc), param="messages", code="invalid_image") from None


async def chat_request_prompt(host: ModelHost, req: ChatCompletionRequest) -> tuple[list[int], Any]:
    """(prompt ids, MultimodalPrompt or None) of a chat request; templating, tokenizing and images (decoded and
    encoded) run off the event loop, after the request's limits are checked."""
    check_chat_request(host.config, req.messages)
    if not has_image_parts(req.messages):
        return await asyncio.to_thread(chat_prompt, host, req), None
    from trellm.capabilities import supports_images
    from trellm.multimodal import ImageError, prepare_prompt

    await asyncio.to_thread(check_image_pixels, host.config, req.messages)
    if not supports_images(host.lm.model):
        raise bad_request(f"model {host.model_name!r} takes no image input", param="messages", code="invalid_image")
    template_messages, images = await asyncio.to_thread(split_image_messages, req.messages)
    ids = await asyncio.to_thread(chat_prompt, host, req, template_messages)
    try:
        mm = await asyncio.to_thread(prepare_prompt, host.lm, ids, images)
    except ImageError as exc:  # a text-only model, a marker count that differs, a bad image
        raise bad_request(str(exc), param="messages", code="invalid_image") from None
    check_token_ids(host, mm.input_ids, "messages")
    return mm.input_ids, mm


def chat_prompt(host: ModelHost, req: ChatCompletionRequest, messages: list[dict] | None = None) -> list[int]:
    """Render the messages (or ``messages``, already template-ready) with the request's template (in the sandbox)
    or the model's; 400 when there is none. Blocking: call it in a worker thread."""
    tok = host.tokenizer
    messages = message_dicts(req.messages) if messages is None else messages
    extra = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        extra.setdefault("reasoning_effort", req.reasoning_effort)
    template = req.chat_template if req.chat_template is not None else model_template(host)
    if req.tools and template and (req.tool_choice or "auto") != "none":
        messages = explain_tools(messages, template, tool_format(host, req.tools), req.tools)
    try:
        if req.chat_template is not None:
            specials = {k: v for k, v in (("bos_token", tok.bos_token), ("eos_token", tok.eos_token)) if v is not None}
            text = render_request_template(host, req.chat_template, messages, add_generation_prompt=req.add_generation_prompt,
                                           tools=req.tools, **{**specials, **extra})
        elif not tok.has_chat_template:
            raise bad_request(f"model {host.model_name!r} has no chat template; send one as 'chat_template' or use "
                              "/v1/completions", param="messages", code="chat_template_missing")
        else:
            text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, tools=req.tools, **extra)
    except APIError:
        raise
    except Exception as exc:  # a template that raises (raise_exception, bad roles, syntax) is the request's fault
        raise bad_request(f"the chat template failed on these messages: {type(exc).__name__}: {exc}", param="messages") from None
    ids = encode_text(tok, text, False, "messages")
    check_token_ids(host, ids, "messages")
    return ids


# ---- sampling and jobs -------------------------------------------------------------------------------


def stop_strings(req: SamplingFields) -> list[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
    return [s for s in stops if s]


def sampler_settings(host: ModelHost, req: SamplingFields) -> SamplerSettings:
    """The request's sampler fields as SamplerSettings (validated by building the stack once)."""
    temperature = 1.0 if req.temperature is None else req.temperature
    kw: dict[str, Any] = {"temperature": 0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature}
    for name in PASSTHROUGH_SAMPLER_FIELDS:
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    if req.top_k is not None:
        kw["top_k"] = max(req.top_k, 0)
    vocab = int(getattr(host.lm.config, "vocab_size", 0) or 0) or host.tokenizer.vocab_size
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(f"logit_bias: key {key!r} is not a token id", param="logit_bias") from None
            if not 0 <= token < vocab:
                raise bad_request(f"logit_bias: token id {token} is outside the vocabulary (0..{vocab - 1})", param="logit_bias")
            if not -100.0 <= value <= 100.0:
                raise bad_request(f"logit_bias: bias {value} for token {token} is outside [-100, 100]", param="logit_bias")
            bias[token] = value
        kw["logit_bias"] = bias
    if req.banned_tokens:
        bad = [t for t in req.banned_tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"banned_tokens: token id {bad[0]} is outside the vocabulary", param="banned_tokens")
        kw["banned_tokens"] = tuple(req.banned_tokens)
    if req.dry_sequence_breakers:
        breakers: list[int] = []
        for b in req.dry_sequence_breakers:
            breakers += [b] if isinstance(b, int) else encode_text(host.tokenizer, b, False, "dry_sequence_breakers")
        kw["dry_sequence_breakers"] = tuple(breakers)
    if req.dry_multiplier:
        kw["dry_range"] = min(req.dry_range or DRY_MAX_RANGE, DRY_MAX_RANGE)
    settings = SamplerSettings(**kw)
    try:
        settings.build()
    except ValueError as exc:
        raise bad_request(f"invalid sampler settings: {exc}") from None
    return settings


# ---- structured output and tools ---------------------------------------------------------------------


def model_template(host: ModelHost) -> str | None:
    templates = getattr(host.tokenizer, "chat_templates", None) or {}
    return templates.get("tool_use") or templates.get("default") or next(iter(templates.values()), None)


def tool_format(host: ModelHost, tools: Sequence[dict] = ()) -> ToolFormat:
    """The model's tool-call format: ``--tool-parser``, else read from its chat template."""
    name = host.config.tool_parser or detect_tool_format(model_template(host))
    return TOOL_FORMATS[name](tools)


def explain_tools(messages: list[dict], template: str, fmt: ToolFormat, tools: list[dict]) -> list[dict]:
    """For a template that ignores tools: describe them in a system message, and write earlier calls
    into their assistant turns, in the model's tool-call format, so the model still sees both."""
    out = [dict(m) for m in messages]
    if "tool_calls" not in template:
        for m in out:
            if m.get("tool_calls"):
                calls = [{"name": c["name"], "arguments": c["arguments"]} for c in m["tool_calls"]]
                m["content"] = "\n".join(p for p in (m.get("content") or "", fmt.render_calls(calls)) if p)
    if "tools" in template:
        return out
    example = fmt.render_calls([{"name": "NAME", "arguments": {"ARGUMENT": "VALUE"}}])
    text = ("You can call these functions (JSON schemas):\n" + "\n".join(json.dumps(t.get("function", t)) for t in tools)
            + f"\nTo call one, reply with:\n{example}")
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{text}"
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def special_literal(host: ModelHost) -> Any:
    """Lark spelling of a marker: the special token by id when the tokenizer has it as one, else the text."""
    specials = {t.content: i for i, t in host.tokenizer.backend.get_added_tokens_decoder().items() if t.special}

    def literal(text: str) -> str:
        return f"<[{specials[text]}]>" if text in specials else lark_literal(text)

    return literal


def output_grammar(req: SamplingFields) -> Grammar | None:
    """The grammar the request's extra fields ask for (json_schema, regex, grammar, choice), or None; 400 for
    more than one or for one the engine refuses."""
    given = [name for name in ("json_schema", "regex", "grammar", "choice") if getattr(req, name) is not None]
    if len(given) > 1:
        raise bad_request(f"give at most one of json_schema, regex, grammar and choice, got {', '.join(given)}", param=given[1])
    if not given:
        return None
    name = given[0]
    build = {"json_schema": Grammar.json_schema, "regex": Grammar.regex, "grammar": Grammar.lark, "choice": Grammar.choice}
    return grammar_or_400(lambda: build[name](getattr(req, name)), name)


def grammar_or_400(build: Any, param: str) -> Grammar:
    try:
        return build()
    except GrammarError as exc:
        raise bad_request(f"{param}: {exc}", param=param, code="invalid_grammar") from None


def response_format_grammar(response_format: dict | None) -> Grammar | None:
    """OpenAI's response_format: text (None), json_object, or json_schema ({"json_schema": {"name", "schema", "strict"}})."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", {"type": "object"}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema must be an object with a 'schema' object", param="response_format")
        return grammar_or_400(lambda: Grammar.json_schema(schema), "response_format")
    raise bad_request(f"response_format type {kind!r} is not one of text, json_object, json_schema", param="response_format")


@attrs.define
class ChatPlan:
    """How one chat request's replies are shaped: the grammar its jobs follow and how their text is read."""

    grammar: Grammar | None
    parser: ReplyParser
    decode_special_tokens: bool


def chat_plan(host: ModelHost, req: ChatCompletionRequest, prompt_ids: list[int]) -> ChatPlan:
    """Grammar and reply parser of a chat request (400 for a tool_choice or grammar that cannot work)."""
    tools = [t for t in (req.tools or [])]
    for i, t in enumerate(tools):
        fn = t.get("function")
        if (t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("parameters", {}), dict)):
            raise bad_request(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': str, 'parameters': "
                              "object}}}}", param="tools")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    grammar = output_grammar(req)
    shaped = response_format_grammar(req.response_format)
    if shaped is not None and grammar is not None:
        raise bad_request("give either response_format or one of json_schema/regex/grammar/choice", param="response_format")
    grammar = grammar or shaped
    fmt = tool_format(host, tools)
    if choice != "none" and not tools:
        raise bad_request(f"tool_choice {choice!r} needs tools", param="tool_choice")
    if isinstance(choice, dict):
        name = choice.get("function").get("name") if isinstance(choice.get("function"), dict) else None
        forced = [t for t in tools if t["function"]["name"] == name]
        if not forced:
            raise bad_request(f"tool_choice names function {name!r}, which is not among the tools", param="tool_choice")
    else:
        forced = tools if choice == "required" else []
    if forced:
        if grammar is not None:
            raise bad_request("a forced tool call cannot also follow response_format or a grammar", param="tool_choice")
        parallel = req.parallel_tool_calls is not False and not isinstance(choice, dict)
        lark = fmt.grammar(forced, parallel, special_literal(host))
        grammar = grammar_or_400(lambda: Grammar.lark(lark), "tools")
    reasoning = host.config.reasoning_parser or detect_reasoning(model_template(host))
    starts_open = reasoning == "think" and host.tokenizer.decode(prompt_ids[-4:]).rstrip().endswith("<think>")
    parser = ReplyParser(tool_format=fmt if choice != "none" else None, reasoning=reasoning, starts_in_reasoning=starts_open)
    needs_specials = (choice != "none" and fmt.special_tokens) or reasoning == "harmony"
    return ChatPlan(grammar=grammar, parser=parser, decode_special_tokens=needs_specials)


async def compiled(host: ModelHost, grammar: Grammar | None) -> None:
    """Compile ``grammar`` for the model off the event loop (the first one also builds the engine)."""
    if grammar is not None:
        try:
            await asyncio.to_thread(host.generator.grammar_engine.compile, grammar)
        except GrammarError as exc:
            raise bad_request(str(exc), code="invalid_grammar") from None


def make_jobs(host: ModelHost, req: SamplingFields, prompts: list[list[int]], max_tokens: int | None, default_max: int,
              logprobs: int | None, request_id: str, images: Any = None, grammar: Grammar | None = None,
              decode_special_tokens: bool = False, lora: str | None = None) -> list[Job]:
    """n jobs per prompt; choice index = prompt index * n + j (OpenAI's order). ``images``: a
    MultimodalPrompt (one prompt) whose ids are ``prompts[0]``."""
    n = req.n
    if n > host.config.max_n:
        raise bad_request(f"n={n} is more than this server allows ({host.config.max_n})", param="n")
    if len(prompts) * n > host.job_limit:
        raise bad_request(f"{len(prompts) * n} completions in one request; this server runs at most {host.job_limit} at once",
                          param="n")
    sampler = sampler_settings(host, req)
    stops = stop_strings(req)
    stop_ids = None
    if req.ignore_eos or req.stop_token_ids:
        stop_ids = set(req.stop_token_ids or []) | (set() if req.ignore_eos else host.lm.default_stop_ids())
    capacity = host.max_model_len
    limit = host.config.max_tokens_limit
    if limit is not None and max_tokens is not None and max_tokens > limit:
        raise bad_request(f"max_tokens={max_tokens} is more than this server allows per request ({limit})", param="max_tokens")
    if limit is not None:
        default_max = min(default_max, limit)
    jobs = []
    for p, ids in enumerate(prompts):
        room = capacity - len(ids)
        budget = max_tokens if max_tokens is not None else min(default_max, room)
        if budget < 1 or len(ids) + budget > capacity:
            raise APIError(400, f"this model's context holds {capacity} tokens; the prompt has {len(ids)} and "
                                f"{budget} more were requested", param="max_tokens" if max_tokens else "messages",
                           code="context_length_exceeded")
        for j in range(n):
            seed = None if req.seed is None else (req.seed + j) % SEED_MODULUS
            try:
                jobs.append(Job(
                    ids, budget, min_new_tokens=min(req.min_tokens or 0, budget), stop=stops, stop_token_ids=stop_ids,
                    sampler=sampler, seed=seed, banned_strings=req.banned_strings or (), logprobs=logprobs is not None,
                    top_logprobs=logprobs or 0, identifier=(request_id, p * n + j),
                    decode_special_tokens=decode_special_tokens or not req.skip_special_tokens, images=images, lora=lora,
                    grammar=grammar,
                ))
            except ValueError as exc:
                raise bad_request(str(exc)) from None
    return jobs


# ---- running jobs --------------------------------------------------------------------------------------


class JobGroup:
    """The jobs of one request: submits them, merges their results, cancels and releases them once."""

    def __init__(self, host: ModelHost, jobs: list[Job], request_id: str, route: str):
        self.host, self.request_id, self.route = host, request_id, route
        self.t_start = time.time()
        self.t_first_token: float | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finished: dict[int, JobFinished] = {}
        self._closed = False
        try:
            self.ajobs: list[AsyncJob] = host.submit(jobs)
        except QueueFullError as exc:
            raise APIError(429, str(exc), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        except JobTooLargeError as exc:
            raise APIError(400, str(exc), param="max_tokens", code="context_length_exceeded") from None
        except LoraError as exc:  # the adapter was unloaded after the model name was checked
            raise APIError(404, str(exc), param="model", code="model_not_found") from None

    async def results(self) -> AsyncIterator[tuple[int, Any]]:
        """(job index, result) pairs as they come; ends once every job has finished."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, ajob: AsyncJob) -> None:
            try:
                async for result in ajob:
                    queue.put_nowait((index, result))
            except Exception as exc:  # the generator failed: surface it to the request
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(i, aj)) for i, aj in enumerate(self.ajobs)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, APIError):  # the server ended the job (shutting down)
                    raise item
                if isinstance(item, Exception):
                    raise APIError(500, f"generation failed: {item}", "server_error")
                self._account(index, item)
                yield index, item
        finally:
            for t in tasks:
                t.cancel()

    def _account(self, index: int, item: Any) -> None:
        if isinstance(item, TokenChunk) and item.token_ids and self.t_first_token is None:
            self.t_first_token = time.time()
        elif isinstance(item, JobFinished):
            self.finished[index] = item
            self.completion_tokens += item.generated_tokens

    async def run(self, consumer: Awaitable[T], request: Request | None = None) -> T:
        """Await ``consumer`` (which drains :meth:`results`); cancel the jobs if the client disconnects first."""
        work = asyncio.ensure_future(consumer)
        watcher = asyncio.create_task(_wait_disconnect(request)) if request is not None else None
        try:
            waiting = {work} | ({watcher} if watcher else set())
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                raise APIError(499, "client closed the request", code="client_disconnected")
            return work.result()
        finally:
            for t in (work, watcher):
                if t is not None:
                    t.cancel()
            self.close()

    def close(self) -> None:
        """Cancel unfinished jobs (their pages come back at the next generator step) and log the request."""
        if self._closed:
            return
        self._closed = True
        for aj in self.ajobs:
            if aj.final is None:
                aj.cancel()
        self.host.release(len(self.ajobs))
        self.host.metrics.observe_group(self)
        self._log()

    def _log(self) -> None:
        t_end = time.time()
        ttft = (self.t_first_token - self.t_start) if self.t_first_token else None
        decode_time = t_end - self.t_first_token if self.t_first_token else 0.0
        rate = (self.completion_tokens - 1) / decode_time if decode_time > 0 and self.completion_tokens > 1 else 0.0
        reasons = sorted({f.eos_reason for f in self.finished.values()}) or ["cancelled"]
        log.info("request %s %s: %d jobs, tokens in %d out %d, ttft %s, %.1f tok/s, %.3fs, end %s", self.request_id, self.route,
                 len(self.ajobs), self.prompt_tokens, self.completion_tokens,
                 f"{ttft * 1000:.0f} ms" if ttft is not None else "-", rate, t_end - self.t_start, ",".join(reasons))


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body has been read already, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class JobStreamResponse(StreamingResponse):
    """SSE stream that always watches for a disconnect and always releases its jobs, even if never started."""

    def __init__(self, content: AsyncIterator[str], group: JobGroup):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "x-request-id": group.request_id})
        self.group = group

    async def __call__(self, scope, receive, send) -> None:
        scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.0"}}  # use Starlette's disconnect listener
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def finish_reason(f: JobFinished) -> str:
    return f.finish_reason if f.finish_reason in ("stop", "length") else "stop"


def check_finished(result: JobFinished) -> None:
    """A job that ended by error or cancellation (not by the client) fails the request."""
    if result.eos_reason == "error":
        raise APIError(500, f"generation failed: {result.error}", "server_error")
    if result.eos_reason == "cancelled":
        raise APIError(503, "the job was cancelled (the model was unloaded or the server is stopping)", "server_error",
                       code="cancelled")


def token_text(tokenizer, token_id: int) -> str:
    return token_piece(tokenizer, token_id)[0]


@functools.lru_cache(maxsize=1 << 16)
def token_piece(tokenizer, token_id: int) -> tuple[str, tuple[int, ...]]:
    """A token's text (decoded alone) and its raw UTF-8 bytes, which may be part of a character.

    Byte-level BPE spells bytes as printable characters (GPT-2's table) and SentencePiece byte
    fallback as ``<0xNN>``; both are mapped back, so ``bytes`` is exact where ``text`` shows U+FFFD.
    """
    text = tokenizer.decode([token_id])
    piece = tokenizer.id_to_token(token_id) or ""
    raw: bytes | None = None
    if type(tokenizer.backend.decoder).__name__ == "ByteLevel" and all(c in _BYTE_OF_CHAR for c in piece):
        raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
    elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            raw = bytes([int(piece[3:5], 16)])
        except ValueError:
            raw = None
    if raw is None:
        raw = text.encode("utf-8", "replace")
    return text, tuple(raw)


def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 byte values, inverted (character -> byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_OF_CHAR = _byte_level_table()
