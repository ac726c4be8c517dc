"""Count what one batch-1 decode step launches, per decoder layer, on CPU (no GPU needed).

A tiny random Llama (or Qwen3 with ``--arch Qwen3ForCausalLM``) is loaded through trellm, a prompt
is prefilled into the paged cache, and one decode step runs under a TorchDispatchMode that logs
every aten op, plus a hook on ``trellm.ops`` that logs every trellm op. A trellm op counts as one
kernel (its CUDA implementation is one launch; the aten ops of its CPU reference are not counted);
an aten op outside any trellm op counts as one kernel unless it only makes a view. That sum is a
good proxy for the kernels a CUDA graph of the step holds. (``paged_attention`` merges its key splits
inside the kernel; only without its arrival counters does a second, merge kernel run.)

Reference figures (tiny Llama / Qwen3, per decoder layer): 18 / 20 ops before the decode-step fusion
(2 norms + 2 adds, cos/sin gathers, two RoPEs and a KV write), 12 / 12 after (7 matmuls, 2
add_rms_norm, rotary_qk_write_kv, paged_attention, gated_activation).

    python benchmarks/count_decode_ops.py [--arch LlamaForCausalLM] [--verbose]
"""
from __future__ import annotations

import argparse
import collections
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that only make views or metadata: no kernel on the GPU.
VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "alias", "t", "transpose", "permute", "expand", "slice", "select",
    "unsqueeze", "squeeze", "as_strided", "detach", "empty", "empty_like", "new_empty", "empty_strided",
    "unbind", "split", "split_with_sizes", "chunk", "narrow", "lift_fresh", "_reshape_alias", "flatten",
    "is_nonzero", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_local_scalar_dense",
}


class OpLog:
    """Ops seen, as (layer, kind, name); ``layer`` is None outside decoder layers."""

    def __init__(self):
        self.layer: int | None = None
        self.depth = 0  # > 0 while inside a trellm op
        self.events: list[tuple[int | None, str, str]] = []

    def add(self, kind: str, name: str) -> None:
        self.events.append((self.layer, kind, name))


class AtenLogger(TorchDispatchMode):
    def __init__(self, log: OpLog):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.log.depth == 0 and name not in VIEW_OPS:
            self.log.add("aten", name)
        return func(*args, **(kwargs or {}))


def hook_trellm_ops(log: OpLog) -> None:
    """Wrap every trellm op so its call is logged once and its reference's aten ops are not."""
    from trellm.ops import Op

    original = Op.__call__

    def logged(self, *args, **kwargs):
        if log.depth == 0:
            log.add("trellm", self.name)
        log.depth += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            log.depth -= 1

    Op.__call__ = logged


def hook_layers(model, log: OpLog) -> None:
    """Tag ops with the index of the decoder layer running them (whichever entry point it uses)."""
    for i, layer in enumerate(model.layers):
        for method in ("forward",):
            fn = getattr(layer, method, None)
            if fn is None:
                continue

            def tagged(*args, _fn=fn, _i=i, **kwargs):
                outer, log.layer = log.layer, _i
                try:
                    return _fn(*args, **kwargs)
                finally:
                    log.layer = outer

            setattr(layer, method, tagged)


def decode_step_ops(arch: str, layers: int) -> tuple[OpLog, int]:
    import trellm
    from trellm.batch import ForwardBatch
    from trellm.cache import KVCache
    from trellm.sdk.testing import make_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_hf_model(arch, tmp, num_hidden_layers=layers)
        lm = trellm.load(model_dir, device="cpu", dtype=torch.float32, tokenizer=False)
    model = lm.model
    page_size = 16
    cache = KVCache.for_model(model, max_tokens=64, page_size=page_size)
    pages = cache.allocator.alloc(4)
    prompt = [1, 5, 9, 13, 17, 21, 25]
    with torch.no_grad():
        model.forward(ForwardBatch.with_cache([prompt], [0], [pages], cache))
        step = ForwardBatch.with_cache([[42]], [len(prompt)], [pages], cache)
        log = OpLog()
        hook_trellm_ops(log)
        hook_layers(model, log)
        with AtenLogger(log):
            model.forward(step)
    return log, len(model.layers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="LlamaForCausalLM")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--verbose", action="store_true", help="print every op in order")
    args = ap.parse_args()

    log, n_layers = decode_step_ops(args.arch, args.layers)
    per_layer: dict[int | None, list[str]] = collections.defaultdict(list)
    for layer, kind, name in log.events:
        per_layer[layer].append(f"{kind}.{name}")
    if args.verbose:
        for layer, kind, name in log.events:
            print(f"  layer {'-' if layer is None else layer}: {kind}.{name}")
    print(f"# {args.arch}, {n_layers} layers, one batch-1 decode step")
    counts = [len(per_layer[i]) for i in range(n_layers)]
    for i in range(n_layers):
        tally = collections.Counter(per_layer[i])
        print(f"layer {i}: {counts[i]} ops: " + ", ".join(f"{n} x{c}" if c > 1 else n for n, c in tally.items()))
    outside = per_layer[None]
    print(f"outside layers: {len(outside)} ops: " + ", ".join(outside))
    per = counts[0] if counts else 0
    matmuls = sum(1 for e in per_layer[0] if e in ("aten.mm", "aten.addmm", "aten.linear", "trellm.exl3_matmul"))
    print(f"ops per layer: {per} ({matmuls} matmuls + {per - matmuls} others); total per step: "
          f"{sum(counts) + len(outside)}; a 32-layer model: {32 * per + len(outside)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
