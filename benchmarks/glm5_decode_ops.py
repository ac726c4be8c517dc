"""Where one GLM 5.3 decode step's ops and bytes go, by module kind, on CPU (no GPU, no checkpoint).

    python benchmarks/glm5_decode_ops.py                          # contexts 256 and 4096, 20 Sinkhorn iterations
    python benchmarks/glm5_decode_ops.py --context 1024 --verbose # + the commonest aten ops of each kind

A tiny random GLM 5.3 (4 layers: 2 Kimi delta attention, 2 MLA with the pooled DSA indexer, one of them reusing
the other's selection; hyper-connections around every block; dense and MoE MLPs) prefills ``--context`` tokens
and takes one batch-1 decode step under a TorchDispatchMode that counts every aten op that is more than a view
(each is a kernel launch on the GPU where the op has no CUDA implementation) and the bytes of its tensor
arguments and results, attributed to the innermost module kind running it. The model and its weight store serve
the cuda tests too (tests/test_cuda_kda.py).
"""
from __future__ import annotations

import argparse
import collections
import math
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from count_decode_ops import VIEW_OPS

TINY_GLM5 = dict(  # a text-only GLM 5.3-Flash config: tests/test_families_next.py's keys, KDA widths the kernels take
    architectures=["Glm5NextForConditionalGeneration"], vocab_size=256, hidden_size=128, intermediate_size=128,
    rms_norm_eps=1e-6, max_position_embeddings=8192, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
    n_shared_experts=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16,
    index_topk=8, index_head_dim=16, index_n_heads=8, index_kpool=4,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
    indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse", "dense"],
    linear_num_heads=2, linear_head_dim=64, hc_mult=4, hc_sinkhorn_iters=5, swiglu_limit=1.0,
)


class RandomGlm5Weights:
    """A WeightStore making every tensor of a GLM 5.3 model up (no checkpoint, no transformers: the lent GPU
    machine's transformers predates these configs). Shapes come from the request, or, for the few tensors loaded
    without one, from the config; decay and gate parameters get values in their trained ranges."""

    model_dir = "<random GLM 5.3 weights>"

    def __init__(self, cfg: dict, seed: int = 0, std: float = 0.08):
        width, heads = cfg["linear_num_heads"] * cfg["linear_head_dim"], cfg["linear_num_heads"]
        self.unshaped = {"q_conv1d.weight": (width, 1, 4), "k_conv1d.weight": (width, 1, 4),
                         "v_conv1d.weight": (width, 1, 4), "dt_bias": (width,), "A_log": (1, 1, heads, 1),
                         "e_score_correction_bias": (cfg["n_routed_experts"],)}
        self.std, self.generator = std, torch.Generator().manual_seed(seed)

    def __iter__(self):
        return iter(())  # no listing: optional tensors count as absent

    def __contains__(self, name: str) -> bool:
        return name.endswith((".weight", "A_log", "dt_bias", "e_score_correction_bias"))

    def info(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(shape=())  # no stored layout: every tensor is made in the shape asked for

    def get(self, name: str, shape=None, dtype=None, device=None) -> torch.Tensor:
        if shape is None:
            shape = next(s for suffix, s in self.unshaped.items() if name.endswith(suffix))
        t = torch.randn(shape, generator=self.generator)
        if name.endswith("norm.weight"):
            t = 1 + 0.1 * t
        elif name.endswith("A_log"):
            t = torch.rand(shape, generator=self.generator) * math.log(16.0)
        elif not name.endswith(("dt_bias", "e_score_correction_bias", "conv1d.weight")):
            t = t * self.std
        return t.to(device=device, dtype=torch.float32 if dtype is None else dtype)


def tiny_glm5(device, dtype: torch.dtype, **overrides):
    """The tiny GLM 5.3 (:data:`TINY_GLM5` with ``overrides``) as the glm5_next plugin builds it, random weights."""
    from trellm.config import DecoderConfig
    from trellm.modules.base import LoadContext
    from trellm.plugins.architectures.glm5_next import build

    raw = {**TINY_GLM5, **overrides}
    model = build(DecoderConfig.from_hf(raw))
    model.load(LoadContext(store=RandomGlm5Weights(raw), device=torch.device(device), dtype=dtype))
    return model


class KindLog(TorchDispatchMode):
    """Aten ops (not views) and the bytes they touch, by the module kind on top of ``kinds``."""

    def __init__(self):
        super().__init__()
        self.kinds = ["other"]
        self.ops: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.names: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.tagged: list[tuple[object, str, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS:
            kind = self.kinds[-1]
            self.ops[kind] += 1
            self.names[kind][name] += 1
            self.bytes[kind] += _nbytes(args) + _nbytes(kwargs) + _nbytes(out)
        return out

    def tag(self, owner, method: str, kind: str) -> None:
        """Attribute what ``owner.method`` (a class or module attribute) runs to ``kind``."""
        fn = getattr(owner, method)
        self.tagged.append((owner, method, fn))

        def tagged(*args, **kwargs):
            self.kinds.append(kind)
            try:
                return fn(*args, **kwargs)
            finally:
                self.kinds.pop()

        setattr(owner, method, tagged)

    def untag(self) -> None:
        for owner, method, fn in reversed(self.tagged):
            setattr(owner, method, fn)


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    if isinstance(x, dict):
        return sum(_nbytes(y) for y in x.values())
    return 0


def decode_step_log(context: int, sinkhorn_iters: int) -> KindLog:
    """The log of one batch-1 decode step after a ``context``-token prefill (bf16 weights, CPU)."""
    from trellm.batch import ForwardBatch
    from trellm.cache import SequenceState
    from trellm.cache.recurrent import alloc_state_slot
    from trellm.modules import hyper, latent, moe, recurrent

    model = tiny_glm5("cpu", torch.bfloat16, hc_sinkhorn_iters=sinkhorn_iters, index_topk=64, index_kpool=16,
                      max_position_embeddings=max(8192, 2 * context))
    cache = model.make_cache(max_tokens=context + 256, page_size=64, max_slots=1)
    seq = SequenceState(cache)
    seq.reserve(context + 1)
    slots = torch.tensor([alloc_state_slot(cache)])
    log = KindLog()
    for owner, method, kind in ((hyper.HyperConnection, "forward", "hyper weights"), (hyper.HyperMix, "merge", "hyper merge"),
                                (recurrent.KimiDeltaAttention, "forward", "KDA"), (latent.SparseLatentAttention, "attention", "MLA"),
                                (latent.SparseIndexer, "select", "indexer select"),
                                (latent.SparseIndexer, "pooled", "indexer pools"),
                                (latent, "sparse_paged_attention", "sparse attention"), (moe.MoE, "forward", "MoE")):
        log.tag(owner, method, kind)
    try:
        with torch.inference_mode():
            for tokens, start in (((torch.arange(context) % 200 + 1).tolist(), 0), ([7], context)):
                batch = ForwardBatch.with_cache([tokens], [start], [seq.pages], cache)
                batch.state_slots = slots
                if start:
                    with log:
                        model.forward(batch)
                else:
                    model.forward(batch)
    finally:
        log.untag()
    return log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--sinkhorn-iters", type=int, default=20, help="GLM 5.3-Flash's hc_sinkhorn_iters")
    ap.add_argument("--verbose", action="store_true", help="the commonest aten ops of each kind")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for context in args.context:
        log = decode_step_log(context, args.sinkhorn_iters)
        print(f"# context {context}: one decode step of the tiny GLM 5.3 (2 KDA + 2 MLA layers), torch references")
        for kind, n in log.ops.most_common():
            common = ", ".join(f"{name} x{k}" for name, k in log.names[kind].most_common(5)) if args.verbose else ""
            print(f"  {kind:<17} {n:>5} ops {log.bytes[kind] / 1e6:>9.2f} MB  {common}")
        print(f"  {'total':<17} {sum(log.ops.values()):>5} ops {sum(log.bytes.values()) / 1e6:>9.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
