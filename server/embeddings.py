"""``POST /v1/embeddings``: sentence embeddings pooled from the loaded model's final hidden states.

Each input runs one forward over the generator's own paged cache (pages taken for the call and given
back after it), between generator steps, in a worker thread; the final norm is applied (as HF's
``last_hidden_state``), then the rows are pooled and L2-normalised. Pooling is the last token (what
Qwen3-Embedding and other decoder embedding models are trained for) or the mean over tokens: a
sentence-transformers ``1_Pooling/config.json`` beside the model chooses it, else the last token.
``dimensions`` keeps the first N components and normalises again (Matryoshka-trained models).
The openai client asks for ``encoding_format="base64"`` by default: little-endian float32 bytes.
"""
from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any, Literal, Union

import torch
from fastapi import APIRouter, Depends, Request
from pydantic import Field

from .errors import APIError, AsciiJSONResponse, bad_request
from .schemas import _Request

POOLING_LAST, POOLING_MEAN = "last", "mean"


class EmbeddingRequest(_Request):
    model: str = Field(..., max_length=512)
    input: Union[str, list[str], list[int], list[list[int]]] = Field(..., description="text, texts, token ids or lists of them")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="keep the first N components (then normalised again)")
    user: str | None = None


def model_pooling(model_dir: Path) -> str:
    """The pooling a sentence-transformers export declares (1_Pooling/config.json), else last-token."""
    try:
        config = json.loads((model_dir / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return POOLING_LAST
    if config.get("pooling_mode_mean_tokens"):
        return POOLING_MEAN
    return POOLING_LAST


@torch.inference_mode()
def embed_ids(generator: Any, ids: list[int], pooling: str) -> torch.Tensor:
    """One input's normalised embedding (float32, on the CPU). Call it only while no generator step runs."""
    from trellm.batch import StepBuffers
    from trellm.cache import CacheFullError, SequenceState

    cache, model = generator.cache, generator.model
    seq = SequenceState(cache, with_state_slot=True)
    try:
        seq.pages = cache.prefix_cache.alloc(cache.pages_for(len(ids)))
    except CacheFullError:
        seq.release()
        raise APIError(503, "the cache is full of running requests; retry shortly", "server_error", code="cache_full",
                       headers={"Retry-After": "1"}) from None
    try:
        batch = StepBuffers(cache.device, capacity=4 * len(ids) + 1024).build(
            [ids], [0], [seq.pages], cache, [len(ids) - 1],
            state_slots=[seq.state_slot] if generator.state_layers else None)
        hidden = model.norm.forward(model.hidden_states(batch)).float()
    finally:
        seq.release()
    pooled = hidden[-1] if pooling == POOLING_LAST else hidden.mean(dim=0)
    return pooled.cpu()


def build_embeddings_router(keys) -> APIRouter:
    """The /v1/embeddings route (inputs are read like /v1/completions prompts: at most 64)."""
    from .generation import completion_prompts
    from .routes import ready_host

    router = APIRouter()

    @router.post("/v1/embeddings", dependencies=[Depends(keys.require_api_key)], tags=["openai"])
    async def embeddings(body: EmbeddingRequest, request: Request):
        host = ready_host(request, body.model)
        prompts = await asyncio.to_thread(completion_prompts, host, body.input)
        limit = host.max_model_len
        for i, ids in enumerate(prompts):
            if len(ids) > limit:
                raise APIError(400, f"input[{i}] has {len(ids)} tokens; this model's context holds {limit}", param="input",
                               code="context_length_exceeded")
        hidden_size = int(getattr(host.lm.config, "hidden_size", 0) or 0)
        if body.dimensions is not None and hidden_size and body.dimensions > hidden_size:
            raise bad_request(f"dimensions={body.dimensions} is more than this model's {hidden_size}", param="dimensions")
        pooling = model_pooling(host.settings.model_dir)

        def run() -> list[torch.Tensor]:
            return [embed_ids(host.generator, ids, pooling) for ids in prompts]

        vectors = await host.agen.run_between_steps(run)
        data = []
        for i, v in enumerate(vectors):
            if body.dimensions is not None:
                v = v[: body.dimensions]
            v = torch.nn.functional.normalize(v, dim=0)
            value: Any = (base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii")
                          if body.encoding_format == "base64" else v.tolist())
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(len(p) for p in prompts)
        host.metrics.prompt_tokens.inc(tokens)
        return AsciiJSONResponse({"object": "list", "data": data, "model": host.model_name,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    return router
