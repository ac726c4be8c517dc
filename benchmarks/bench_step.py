"""Time one decode step of bench_decode's model (PDL on unless TRELLM_PDL=0), the graph captured first in
a fresh process: the A/B unit for knobs read at launch (env) or baked into a build (TRELLM_NVCC_FLAGS).

    python benchmarks/bench_step.py BITS [LABEL [BATCH]]

Knobs compared this way (NOTES): TRELLM_GEMV_EARLY_STAGES, TRELLM_PDL, TRELLM_EXL3_MID (batched steps).
Run variants interleaved (A B A B), each in its own process: one process's clocks and allocator drift.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from bench_decode import Model  # noqa: E402
from common import time_graph  # noqa: E402

from trellm.kernels_cuda import ops as _cuda_ops  # noqa: E402,F401

bits, label = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else ""
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
model = Model(32, bits, 6, 513)
# A batched step: `batch` sequences of 512 cached tokens each, reading the same KV pages (random data, so
# the attention reads are real; their KV writes land on one slot, which does not change the timing).
model.block_table = model.block_table.expand(batch, -1).contiguous()
tok = torch.full((batch,), 123, device="cuda")
pos = torch.full((batch,), 512, device="cuda")
cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
ctx = torch.full((batch,), 513, device="cuda", dtype=torch.int32)
t = time_graph(lambda: model.forward(tok, pos, cu, ctx, all_logits=batch > 1), reps=20)
print(f"{label} step K={bits} batch {batch}: {t * 1e3:.3f} ms = {batch / t:.0f} tokens/s", flush=True)
