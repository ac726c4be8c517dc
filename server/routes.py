"""The HTTP routes: OpenAI's /v1/models, /v1/completions, /v1/chat/completions, plus tokens, health and admin."""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request

from .engine import BUILTIN_DRAFTS, LoadSettings, ModelHost, ModelNotReadyError
from .errors import APIError, AsciiJSONResponse, bad_request
from .chat_parsing import ReplyStream, message_of
from .limits import check_chat_request, check_prompt_bytes
from .generation import (
    ChatPlan, JobGroup, JobStreamResponse, chat_plan, chat_prompt, chat_request_prompt, check_finished, check_token_ids,
    compiled, completion_prompts, encode_text, finish_reason, make_jobs, output_grammar, token_piece, token_text,
)
from .schemas import (
    ChatCompletionRequest, CompletionRequest, ErrorResponse, LoraLoadRequest, LoraUnloadRequest, ModelCard, ModelList,
    ModelLoadRequest, TokenDecodeRequest,
    TokenDecodeResponse, TokenEncodeRequest, TokenEncodeResponse,
)
from trellm.generator import JobFinished, TokenChunk

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 413, 429, 500, 503)
}


def host_of(request: Request) -> ModelHost:
    return request.app.state.host


def build_router(keys) -> APIRouter:
    """All routes; ``keys`` is the server's KeyChecker."""
    api = [Depends(keys.require_api_key)]
    admin = [Depends(keys.require_admin_key)]
    router = APIRouter(responses=ERROR_RESPONSES)

    @router.get("/health", tags=["status"])
    async def health(request: Request):
        host = host_of(request)  # no key needed: names no paths and no errors (those are on the admin route)
        body = {"status": "ok" if host.ready else host.state, "model": host.model_name}
        return AsciiJSONResponse(body, status_code=200 if host.ready else 503)

    @router.get("/v1/models", dependencies=api, response_model=ModelList, tags=["openai"])
    async def list_models(request: Request):
        host = host_of(request)
        return ModelList(data=[model_card(host), *(model_card(host, n) for n in host.loras)] if host.ready else [])

    @router.get("/v1/models/{model_id:path}", dependencies=api, response_model=ModelCard, tags=["openai"])
    async def get_model(model_id: str, request: Request):
        host = host_of(request)
        if not host.ready or not (model_id == host.model_name or model_id.removeprefix(f"{host.model_name}:") in host.loras):
            raise APIError(404, f"model {model_id!r} is not served here", param="model", code="model_not_found")
        return model_card(host, host.adapter_for(model_id))

    @router.post("/v1/completions", dependencies=api, tags=["openai"])
    async def completions(body: CompletionRequest, request: Request):
        host = ready_host(request, body.model)
        if body.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        prompts = await asyncio.to_thread(completion_prompts, host, body.prompt)
        request_id = "cmpl-" + secrets.token_hex(12)
        grammar = output_grammar(body)
        await compiled(host, grammar)
        jobs = make_jobs(host, body, prompts, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, body.logprobs, request_id,
                         grammar=grammar, lora=host.adapter_for(body.model))
        echo = [host.tokenizer.decode(p) if body.echo else "" for p in prompts for _ in range(body.n)]
        shaper = CompletionShaper(host, body, request_id, echo)
        group = JobGroup(host, jobs, request_id, "/v1/completions")  # submitted: from here on the response releases them
        group.prompt_tokens = sum(len(p) for p in prompts)
        if body.stream:
            return JobStreamResponse(sse(shaper.stream(group)), group)
        reply = await group.run(shaper.whole(group), request)
        return AsciiJSONResponse(reply, headers={"x-request-id": request_id})

    @router.post("/v1/chat/completions", dependencies=api, tags=["openai"])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        host = ready_host(request, body.model)
        ids, images = await chat_request_prompt(host, body)
        plan = chat_plan(host, body, ids)
        await compiled(host, plan.grammar)
        request_id = "chatcmpl-" + secrets.token_hex(12)
        max_tokens = body.max_completion_tokens or body.max_tokens
        top = body.top_logprobs or 0
        if top and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        jobs = make_jobs(host, body, [ids], max_tokens, host.config.default_max_tokens, top if body.logprobs else None,
                         request_id, images=images, grammar=plan.grammar, decode_special_tokens=plan.decode_special_tokens,
                         lora=host.adapter_for(body.model))
        shaper = ChatShaper(host, body, request_id, len(jobs), plan)
        group = JobGroup(host, jobs, request_id, "/v1/chat/completions")
        group.prompt_tokens = len(ids)
        if body.stream:
            return JobStreamResponse(sse(shaper.stream(group)), group)
        reply = await group.run(shaper.whole(group), request)
        return AsciiJSONResponse(reply, headers={"x-request-id": request_id})

    @router.post("/v1/token/encode", dependencies=api, response_model=TokenEncodeResponse, tags=["tokens"])
    async def token_encode(body: TokenEncodeRequest, request: Request):
        host = ready_host(request, None)
        if isinstance(body.text, str):
            check_prompt_bytes(host.config, [body.text], "text")
            ids = await asyncio.to_thread(encode_text, host.tokenizer, body.text, body.add_special_tokens, "text")
        else:
            if not body.text:
                raise bad_request("text: the message list is empty", param="text")
            check_chat_request(host.config, body.text)
            chat = ChatCompletionRequest.model_construct(model=host.model_name, messages=body.text)
            ids = await asyncio.to_thread(chat_prompt, host, chat)
        return TokenEncodeResponse(tokens=ids, length=len(ids))

    @router.post("/v1/token/decode", dependencies=api, response_model=TokenDecodeResponse, tags=["tokens"])
    async def token_decode(body: TokenDecodeRequest, request: Request):
        host = ready_host(request, None)
        if body.tokens:
            check_token_ids(host, body.tokens, "tokens")
        return TokenDecodeResponse(text=host.tokenizer.decode(body.tokens, skip_special_tokens=body.skip_special_tokens))

    @router.get("/v1/model", dependencies=admin, tags=["admin"])
    async def current_model(request: Request):
        host = host_of(request)
        info: dict[str, Any] = {"state": host.state, "error": host.error, "in_flight": host.in_flight}
        if host.ready:
            gen = host.generator
            info.update(model_card(host).model_dump(), model_dir=str(host.settings.model_dir),
                        capacity_tokens=gen.capacity_tokens, active_jobs=gen.num_active, pending_jobs=gen.num_pending,
                        cache_bits=host.settings.cache_bits, draft_model=str(host.settings.draft_model or "") or None)
        return AsciiJSONResponse(info)

    @router.post("/v1/model/load", dependencies=admin, tags=["admin"])
    async def load_model(body: ModelLoadRequest, request: Request):
        host = host_of(request)
        config = host.config
        model_dir = model_under_models_dir(config.models_dir, body.model, "model")
        draft = body.draft_model
        from .config import parse_cache_bits
        from trellm.errors import ConfigError

        try:
            cache_bits = parse_cache_bits(body.cache_bits) if body.cache_bits is not None else config.cache_bits
        except ConfigError as exc:
            raise bad_request(str(exc), param="cache_bits") from None
        settings = LoadSettings.from_config(config, model_dir)
        settings.model_name = body.model_name or Path(body.model).name
        settings.cache_size = body.cache_size or config.cache_size
        settings.cache_bits = cache_bits
        settings.loras = {}  # the configured adapters belong to the configured model; load others with /v1/lora/load
        settings.draft_model = (Path(draft) if draft in BUILTIN_DRAFTS else model_under_models_dir(config.models_dir, draft, "draft_model")
                                if draft else None)
        try:
            await host.load(settings)
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}".replace(str(Path(config.models_dir).resolve()), "<models-dir>")
            raise APIError(400, f"loading {body.model!r} failed: {detail}; the loaded model is unchanged", param="model",
                           code="model_load_failed") from None
        return AsciiJSONResponse({"status": "loaded", **model_card(host).model_dump()})

    @router.post("/v1/lora/load", dependencies=admin, tags=["admin"])
    async def load_lora(body: LoraLoadRequest, request: Request):
        """Load a PEFT LoRA adapter directory (a name under ``--models-dir``), served as ``<model>:<name>``."""
        from trellm.lora import LoraError

        host = ready_host(request, None)
        path = model_under_models_dir(host.config.models_dir, body.path, "path", marker="adapter_config.json")
        try:
            await host.load_lora(body.name, str(path), body.scale)
        except LoraError as exc:
            detail = str(exc).replace(str(Path(host.config.models_dir).resolve()), "<models-dir>")
            raise APIError(400, detail, param="path", code="lora_load_failed") from None
        return AsciiJSONResponse({"status": "loaded", **model_card(host, body.name).model_dump()})

    @router.post("/v1/lora/unload", dependencies=admin, tags=["admin"])
    async def unload_lora(body: LoraUnloadRequest, request: Request):
        host = ready_host(request, None)
        if body.name not in host.loras:
            raise APIError(404, f"no LoRA adapter named {body.name!r} is loaded (loaded: {sorted(host.loras) or 'none'})",
                           param="name", code="model_not_found")
        await host.unload_lora(body.name)
        return AsciiJSONResponse({"status": "unloaded", "id": f"{host.model_name}:{body.name}"})

    @router.post("/v1/model/unload", dependencies=admin, tags=["admin"])
    async def unload_model(request: Request):
        host = host_of(request)
        await host.unload()
        return AsciiJSONResponse({"status": "unloaded"})

    return router


def model_card(host: ModelHost, lora: str | None = None) -> ModelCard:
    """The card of the base model, or of LoRA adapter ``lora`` on it (id ``<model>:<lora>``, parent the model)."""
    created = int(host.loaded_at or time.time())
    if lora is None:
        return ModelCard(id=host.model_name, created=created, max_model_len=host.max_model_len)
    return ModelCard(id=f"{host.model_name}:{lora}", created=created, max_model_len=host.max_model_len, parent=host.model_name)


MAX_MODEL_NAME = 1024


def model_under_models_dir(models_dir: str | None, name: str, param: str, marker: str = "config.json") -> Path:
    """The model directory an admin load names: a relative name under ``--models-dir`` that resolves (symlinks
    followed) inside it and holds ``marker`` (config.json; a LoRA adapter's adapter_config.json). Whatever is wrong, the answer names only ``name``, so it reveals
    nothing about the files outside."""
    if models_dir is None:
        raise APIError(403, "admin model loads are off: start the server with --models-dir DIR and name a model under it",
                       "permission_error", param=param, code="model_loading_disabled")
    parts = name.split("/")
    if (not name or len(name) > MAX_MODEL_NAME or name.startswith("/") or "\\" in name or "\0" in name
            or any(p in ("", ".", "..") or len(p.encode("utf-8", "surrogatepass")) > 255 for p in parts)):
        raise bad_request(f"{param}: expected a model name under the models directory (relative, no '..', path parts of "
                          f"at most 255 bytes, at most {MAX_MODEL_NAME} characters)", param=param, code="invalid_model_name")
    root = Path(models_dir).resolve()
    try:
        path = (root / name).resolve(strict=True)
        found = path.is_relative_to(root) and (path / marker).is_file()
    except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, an odd name
        found = False
    if not found:
        raise APIError(404, f"{param}: no model named {name!r} in the models directory", param=param, code="model_not_found")
    return path


def ready_host(request: Request, model: str | None) -> ModelHost:
    host = host_of(request)
    try:
        host.require_ready()
    except ModelNotReadyError as exc:
        raise APIError(503, str(exc), "server_error", code=exc.code, headers={"Retry-After": "5"}) from None
    try:
        host.adapter_for(model)
    except LookupError as exc:
        raise APIError(404, str(exc), param="model", code="model_not_found") from None
    return host


async def sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events: one ``data:`` line per JSON chunk, then ``[DONE]``; a failure becomes an error event."""
    try:
        async for event in events:
            yield "data: " + json.dumps(event, ensure_ascii=True) + "\n\n"
    except APIError as exc:
        yield "data: " + json.dumps(exc.body(), ensure_ascii=True) + "\n\n"
    yield "data: [DONE]\n\n"


def usage(group: JobGroup) -> dict:
    return {"prompt_tokens": group.prompt_tokens, "completion_tokens": group.completion_tokens,
            "total_tokens": group.prompt_tokens + group.completion_tokens}


class CompletionShaper:
    """Builds /v1/completions chunks (``text_completion`` objects, the legacy logprobs shape) and whole bodies."""

    object_name = "text_completion"

    def __init__(self, host: ModelHost, body: CompletionRequest, request_id: str, echo: list[str]):
        self.host, self.body, self.request_id, self.echo = host, body, request_id, echo
        self.model_id = host.model_name if host.adapter_for(body.model) is None else body.model  # <model>:<adapter>
        self.created = int(time.time())
        self.offsets = [len(e) for e in echo]

    @property
    def include_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)

    def chunk(self, choices: list[dict], usage_body: dict | None = None, with_usage: bool = False) -> dict:
        out = {"id": self.request_id, "object": self.object_name, "created": self.created, "model": self.model_id,
               "choices": choices}
        if with_usage:
            out["usage"] = usage_body
        return out

    def _logprobs(self, index: int, result: TokenChunk) -> dict | None:
        if self.body.logprobs is None or not result.logprobs:
            return None
        tok = self.host.tokenizer
        tokens = [token_text(tok, t) for t in result.token_ids[: len(result.logprobs)]]
        offsets = []
        for s in tokens:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(s)
        tops = None
        if self.body.logprobs:
            tops = [{token_text(tok, t): lp for t, lp in per_token} for per_token in (result.top_logprobs or [])]
        return {"tokens": tokens, "token_logprobs": list(result.logprobs), "top_logprobs": tops, "text_offset": offsets}

    def token_choice(self, index: int, result: TokenChunk) -> dict:
        return {"index": index, "text": result.text, "logprobs": self._logprobs(index, result), "finish_reason": None}

    def final_choice(self, index: int, reason: str) -> dict:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}

    def first_chunks(self, count: int) -> list[dict]:
        return [self.chunk([{"index": i, "text": text, "logprobs": None, "finish_reason": None}], None, self.include_usage)
                for i, text in enumerate(self.echo) if text]

    async def stream(self, group: JobGroup) -> AsyncIterator[dict]:
        """Chunks as OpenAI streams them; the usage chunk (``choices: []``) last when asked for."""
        for c in self.first_chunks(len(group.ajobs)):
            yield c
        async for index, result in group.results():
            if isinstance(result, TokenChunk):
                if result.text or result.token_ids:
                    yield self.chunk([self.token_choice(index, result)], None, self.include_usage)
            elif isinstance(result, JobFinished):
                check_finished(result)
                yield self.chunk([self.final_choice(index, finish_reason(result))], None, self.include_usage)
        if self.include_usage:
            yield self.chunk([], usage(group), True)

    async def whole(self, group: JobGroup) -> dict:
        """The non-streaming body: the streamed chunks merged per choice."""
        choices: dict[int, dict] = {}
        async for c in self.stream(group):
            for choice in c["choices"]:
                merge_choice(choices.setdefault(choice["index"], {}), choice)
        return {**self.chunk([choices[i] for i in sorted(choices)]), "usage": usage(group)}


class ChatShaper(CompletionShaper):
    """Builds /v1/chat/completions chunks (``chat.completion.chunk``, chat logprobs shape) and whole bodies."""

    object_name = "chat.completion.chunk"

    def __init__(self, host: ModelHost, body: ChatCompletionRequest, request_id: str, n: int, plan: ChatPlan):
        super().__init__(host, body, request_id, [""] * n)
        self.replies = [ReplyStream(plan.parser) for _ in range(n)]  # each choice's text, read as reasoning/content/calls

    def chunk(self, choices: list[dict], usage_body: dict | None = None, with_usage: bool = False) -> dict:
        out = super().chunk(choices, usage_body, with_usage)
        out["system_fingerprint"] = None
        return out

    def _logprobs(self, index: int, result: TokenChunk) -> dict | None:
        if not self.body.logprobs or not result.logprobs:
            return None
        tok = self.host.tokenizer
        content = []
        for i, lp in enumerate(result.logprobs):
            text, raw = token_piece(tok, result.token_ids[i])
            tops = (result.top_logprobs or [])[i] if self.body.top_logprobs and result.top_logprobs else []
            top_entries = []
            for t, tlp in tops:
                t_text, t_raw = token_piece(tok, t)
                top_entries.append({"token": t_text, "logprob": tlp, "bytes": list(t_raw)})
            content.append({"token": text, "logprob": lp, "bytes": list(raw), "top_logprobs": top_entries})
        return {"content": content}

    def token_choice(self, index: int, result: TokenChunk) -> dict:
        delta = self.replies[index].feed(result.text) if result.text else {}
        return {"index": index, "delta": delta, "logprobs": self._logprobs(index, result), "finish_reason": None}

    def final_choice(self, index: int, reason: str) -> dict:
        reply = self.replies[index]
        delta = reply.feed("", final=True)  # text held back until the end (a marker that never completed)
        if reply.has_calls and reason == "stop":
            reason = "tool_calls"
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}

    def first_chunks(self, count: int) -> list[dict]:
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}], None, self.include_usage) for i in range(count)]

    async def whole(self, group: JobGroup) -> dict:
        body = await super().whole(group)
        body["object"] = "chat.completion"
        for choice in body["choices"]:
            choice.pop("delta", None)
            parsed = self.replies[choice["index"]].parser.parse(self.replies[choice["index"]].text, final=True)
            choice["message"] = message_of(parsed)
            if choice["finish_reason"] in ("stop", "tool_calls"):  # the whole text decides, not the stream's guess
                choice["finish_reason"] = "tool_calls" if parsed.calls else "stop"
        return body


def merge_choice(into: dict, choice: dict) -> None:
    """Fold one streamed choice into the accumulated one (text/content appended, logprob lists extended)."""
    for key, value in choice.items():
        if key == "text":
            into["text"] = into.get("text", "") + value
        elif key == "delta":
            delta = into.setdefault("delta", {})
            if "content" in value:
                delta["content"] = delta.get("content", "") + value["content"]
        elif key == "logprobs":
            if value is None:
                into.setdefault("logprobs", None)
                continue
            acc = into.get("logprobs") or {}
            for lk, lv in value.items():
                acc[lk] = (acc.get(lk) or []) + lv if isinstance(lv, list) else lv
            into["logprobs"] = acc
        elif key == "finish_reason":
            if value is not None or "finish_reason" not in into:
                into["finish_reason"] = value
        else:
            into[key] = value
