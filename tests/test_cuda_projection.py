"""trellm.ops.project on the GPU, through the model: tiny EXL3 models (random trellis, 128-wide heads, unpadded
layers) decoded with the CUDA routes (q/k/v + RoPE + KV write, the input norm from the sums of squares, the
residual add, the gated activation; GEMV at 1 row, mid-size at 6) against the same model under
TRELLM_OPS=reference, and replayed from a CUDA graph."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def exl3_model(arch: str, tmp_path):
    import trellm
    from trellm.modules.linear import Linear
    from trellm.quant.exl3.format import EXL3Linear
    from trellm.sdk.testing import make_tiny_hf_model

    model_dir = make_tiny_hf_model(arch, tmp_path, num_hidden_layers=2, hidden_size=256, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=128, intermediate_size=512, vocab_size=512)
    model = trellm.load(model_dir, device="cuda", dtype=torch.float16, tokenizer=False).model
    gen = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, Linear):
            m.impl = EXL3Linear.random(m.in_features, m.out_features, generator=gen, device="cuda", key=m.key)
    return model


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_exl3_model_decode_routes_vs_reference(ops, arch, tmp_path, monkeypatch):
    from trellm.batch import ForwardBatch
    from trellm.cache import KVCache
    from trellm.graph import GraphRunner

    model = exl3_model(arch, tmp_path)
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46][: 5 + i] for i in range(6)]

    def run(batch: int) -> list[torch.Tensor]:
        cache = KVCache.for_model(model, max_tokens=16 * 4 * batch, page_size=16)
        pages = [cache.allocator.alloc(4) for _ in range(batch)]
        lens = [len(p) for p in prompts[:batch]]
        out = [model.forward(ForwardBatch.with_cache(prompts[:batch], [0] * batch, pages, cache))]
        for i, tok in enumerate((7, 11, 13)):
            step = ForwardBatch.with_cache([[tok]] * batch, [n + i for n in lens], pages, cache)
            out.append(model.forward(step))
        return [o.float() for o in out]

    with torch.no_grad():
        refs = {}
        for batch in (1, 6):  # the GEMV's rows, the mid-size route's
            fused = run(batch)
            monkeypatch.setenv("TRELLM_OPS", "reference")
            refs[batch] = run(batch)
            monkeypatch.delenv("TRELLM_OPS")
            for step, (a, b) in enumerate(zip(fused, refs[batch])):
                assert rel_err(a, b) < 2e-2, (batch, step, rel_err(a, b))

        cache = KVCache.for_model(model, max_tokens=128, page_size=16)
        pages = cache.allocator.alloc(4)
        runner = GraphRunner(model, cache, batch_sizes=(1,), max_context=64)
        model.forward(ForwardBatch.with_cache([prompts[0]], [0], [pages], cache))
        for i, tok in enumerate((7, 11, 13)):
            logits = runner.forward(ForwardBatch.with_cache([[tok]], [len(prompts[0]) + i], [pages], cache))
            assert runner.graphs, "the decode step was captured"
            assert rel_err(logits.float(), refs[1][i + 1]) < 2e-2
