"""What one decode step of each windowed-entry attention layer reads and costs as the context grows, on CPU.

    python benchmarks/window_entries_decode.py                       # contexts 256 1024 4096, both routes
    python benchmarks/window_entries_decode.py --context 4096 --steps 8

Tiny random checkpoints (written with transformers, as the tests write them) of the three families whose
attention reads per-window entries: DeepSeek V4 (CSA windows of 4 with an indexer keeping 64, HCA windows of 128,
a 128-token sliding window), GLM 5.3-Flash (the pooled DSA indexer, pools of 16, top 64) and Qwen 3.8-Flash-Next
(QSA blocks of 4, budget 64). Each prefills ``--context`` tokens into a paged cache (bf16), then takes batch-1
decode steps; per attention layer kind it prints the bytes its aten ops touch in one step (arguments and results
of every op that is more than a view, under a TorchDispatchMode; an indexing op counts the rows it moves, not
the page pool it indexes) and its wall time per step (median of
``--steps``, one thread). Two routes in the same process:

- ``cached``: each window's entry is folded once, by the step that completes it, and read from the entry pages;
- ``rebuild``: every complete window of the context is folded again at every step (the former route, emulated
  by handing the layers every window as if the step had completed it all).

A layer's bytes that stay flat from 256 to 4096 tokens do not grow with the context; what grows in ``cached``
is what attention reads by design (HCA's every entry, the dense Qwen attention's whole K/V).
"""
from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from pathlib import Path

import torch

from count_decode_ops import VIEW_OPS
from glm5_decode_ops import KindLog, _nbytes

# ops that read or write a few rows of their first argument (a cache's page pool): only those rows move
GATHERS = {"index", "index_select", "gather"}
SCATTERS = {"index_put_", "index_put", "index_copy_", "scatter_", "index_fill_"}

V4 = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32, head_dim=64,
          num_key_value_heads=1, o_groups=2, o_lora_rank=16, index_topk=64, index_head_dim=32, index_n_heads=8,
          num_hidden_layers=3, sliding_window=128, hc_mult=3, hc_sinkhorn_iters=5, max_position_embeddings=16384,
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
          mlp_layer_types=["hash_moe", "moe", "moe"])
GLM5_NEXT = dict(moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                 kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16,
                 index_topk=64, index_head_dim=32, index_n_heads=8, index_kpool=16, max_position_embeddings=16384,
                 layer_types=["linear_attention", "indexed_attention"], indexer_types=["full", "full"],
                 mlp_layer_types=["dense", "sparse"], linear_head_dim=16, linear_num_heads=4, hc_mult=4,
                 hc_sinkhorn_iters=5, pad_token_id=0, image_token_id=250, video_token_id=251, image_start_token_id=252,
                 image_end_token_id=253, video_start_token_id=254, video_end_token_id=255,
                 vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                                    projection_intermediate_size=64))
QWEN4_EXP = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=16384,
                 num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"], linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2, hc_count=3, hc_lowrank=16,
                 indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=64, indexer_compress_ratio=4,
                 ple_layer_ids=[], eos_token_id=2,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "mrope_section": [2, 1, 1], "mrope_interleaved": True})
FAMILIES = {
    "deepseek_v4": ("DeepseekV4ForCausalLM", V4),
    "glm5_next": ("Glm5NextForConditionalGeneration", GLM5_NEXT),
    "qwen4_exp": ("Qwen4ExpForConditionalGeneration", QWEN4_EXP),
}


def checkpoint(family: str, root: Path) -> Path:
    from trellm.sdk.testing import make_tiny_hf_model

    arch, cfg = FAMILIES[family]
    if family == "qwen4_exp":  # the text model under its only architecture name
        return make_tiny_hf_model(arch, root / family, text_config=cfg, image_token_id=250, video_token_id=251,
                                  vision_start_token_id=252, vision_end_token_id=253,
                                  vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                                                     out_hidden_size=64, patch_size=14))
    return make_tiny_hf_model(arch, root / family, **cfg)


def layer_kinds():
    """(class, method, how to name the layer kind from the instance) of every layer whose entries are measured."""
    from trellm.modules import compressed, latent
    from trellm.plugins.architectures import qwen4_exp

    short = {compressed.SLIDING: "V4 sliding", compressed.CSA: "V4 CSA", compressed.HCA: "V4 HCA"}
    return [(compressed.CompressedAttention, "forward", lambda m: short[m.kind]),
            (latent.SparseLatentAttention, "attention", lambda m: "GLM 5.3 MLA+pooled DSA"),
            (qwen4_exp.IndexedAttention, "forward", lambda m: "Qwen 3.8 QSA")]


class MovedBytes(KindLog):
    """:class:`KindLog` counting what indexing ops move, not the page pool they index: a gather's rows (its
    result and indices), a scatter's values and indices. (Counting the pool would grow with the cache's size.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS:
            kind = self.kinds[-1]
            moved = _nbytes(args[1:]) + _nbytes(kwargs)
            if name not in SCATTERS:
                moved += _nbytes(out)
            if name not in GATHERS | SCATTERS:
                moved += _nbytes(args[:1])
            self.ops[kind] += 1
            self.names[kind][name] += 1
            self.bytes[kind] += moved
        return out


class Timed:
    """Wraps each measured layer's method: attributes its ops to the layer kind and times it."""

    def __init__(self, log: KindLog):
        self.log, self.seconds, self.undo = log, collections.defaultdict(list), []
        for cls, method, name_of in layer_kinds():
            fn = getattr(cls, method)
            self.undo.append((cls, method, fn))

            def wrapped(module, *args, fn=fn, name_of=name_of, **kwargs):
                kind = name_of(module)
                self.log.kinds.append(kind)
                t0 = time.perf_counter()
                try:
                    return fn(module, *args, **kwargs)
                finally:
                    self.seconds[kind].append(time.perf_counter() - t0)
                    self.log.kinds.pop()

            setattr(cls, method, wrapped)

    def close(self) -> None:
        for cls, method, fn in reversed(self.undo):
            setattr(cls, method, fn)


def every_window(batch, rate: int, fold_values: int):
    """The former route's work: every complete window of each sequence's context, as if this step completed them."""
    from trellm.cache.indexed import CompletedWindows

    counts = (batch.context_lens // rate).long()
    seq = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    window = torch.cat([torch.arange(int(n)) for n in counts])
    return CompletedWindows(rate, seq, window, torch.zeros_like(seq))


def rebuild_route(on: bool) -> None:
    import trellm.modules.compressed as compressed
    import trellm.modules.latent as latent
    import trellm.plugins.architectures.qwen4_exp as qwen4_exp
    from trellm.cache.indexed import completed_windows

    for module in (compressed, latent, qwen4_exp):
        module.completed_windows = every_window if on else completed_windows


def measure(lm, context: int, steps: int) -> tuple[dict, dict]:
    """(MB per decode step, median ms per decode step) by layer kind after a ``context``-token prefill."""
    from trellm.batch import ForwardBatch
    from trellm.cache import SequenceState

    cache = lm.new_cache(max_tokens=context + steps + 64, page_size=256)
    seq = SequenceState(cache, with_state_slot=True)
    seq.reserve(context + steps + 2)
    slots = None if seq.state_slot is None else [seq.state_slot]
    prompt = (torch.arange(context) % 197 + 3).tolist()
    log = MovedBytes()
    timed = Timed(log)
    try:
        with torch.inference_mode():
            for start in range(0, context, 512):
                chunk = prompt[start:start + 512]
                lm.model.forward(ForwardBatch.with_cache([chunk], [start], [seq.pages], cache, state_slots=slots))
            for i in range(steps + 2):  # a warm-up step, the step whose bytes are counted, the timed ones
                batch = ForwardBatch.with_cache([[7 + i]], [context + i], [seq.pages], cache, state_slots=slots)
                if i == 1:
                    with log:
                        lm.model.forward(batch)
                else:
                    lm.model.forward(batch)
                if i < 2:
                    timed.seconds.clear()
    finally:
        timed.close()
        seq.release()
    mb = {kind: log.bytes[kind] / 1e6 for kind in timed.seconds}
    ms = {kind: 1e3 * statistics.median(t) * len(t) / steps for kind, t in timed.seconds.items()}
    return mb, ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--family", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--steps", type=int, default=5, help="decode steps timed per context")
    args = ap.parse_args()
    import trellm

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.family:
            lm = trellm.load(checkpoint(family, Path(tmp)), device="cpu", dtype=torch.bfloat16, tokenizer=False)
            print(f"# {family}: one batch-1 decode step per attention layer kind (MB touched, ms), bf16, CPU, 1 thread")
            for context in args.context:
                rows = {}
                for route in ("rebuild", "cached"):
                    rebuild_route(route == "rebuild")
                    rows[route] = measure(lm, context, args.steps)
                rebuild_route(False)
                for kind in rows["cached"][0]:
                    (mb0, ms0), (mb1, ms1) = ((rows[r][0][kind], rows[r][1][kind]) for r in ("rebuild", "cached"))
                    print(f"  context {context:>5}  {kind:<24} rebuild {mb0:>8.2f} MB {ms0:>7.2f} ms   "
                          f"cached {mb1:>8.2f} MB {ms1:>7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
