"""Decode steps a CUDA graph can capture, checked on the CPU (tests/host_reads.py): a whole cached decode step of a
tiny hybrid model reads no tensor on the host and copies nothing to the device outside the ops the CUDA backend runs
as kernels, with the MoE experts on their sync-free pair path as on CUDA; and it gives the logits of the plain CPU
step (experts grouped by expert). NemotronH's ungated experts and Qwen 3.8's rotations and per-layer embeddings used to read the host.
The GPU tests that capture these steps: tests/test_graph_hybrid.py (``test_*_on_cuda``)."""
from __future__ import annotations

import pytest
import torch

import trellm
from trellm.batch import ForwardBatch
from trellm.cache import SequenceState
from trellm.cache.recurrent import alloc_state_slot
from trellm.ops import moe as moe_ops
from trellm.sdk.testing import make_tiny_hf_model, torch_threads

from host_reads import HostReads, cuda_kernel_ops
from test_hybrid_families import FAMILIES

PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 2, 12, 13], [14, 15, 16])  # 2: the Qwen 3.8 checkpoint's EOS


def tiny_model(name: str, tmp_path):
    if name == "qwen4_exp":
        from test_families_next import qwen4_exp_checkpoint

        return qwen4_exp_checkpoint(tmp_path)
    arch, cfg = FAMILIES[name]
    return make_tiny_hf_model(arch, tmp_path, **cfg)


def prefilled(model) -> tuple[object, list[SequenceState], torch.Tensor]:
    """A cache holding :data:`PROMPTS` (one prefill batch), their sequences and their state slots."""
    cache = model.make_cache(max_tokens=256, page_size=16, max_slots=len(PROMPTS) + 1)
    seqs = []
    for p in PROMPTS:
        seqs.append(SequenceState(cache))
        seqs[-1].reserve(len(p) + 2)
    slots = torch.tensor([alloc_state_slot(cache) for _ in PROMPTS])
    batch = ForwardBatch.with_cache(list(PROMPTS), [0] * len(PROMPTS), [s.pages for s in seqs], cache)
    batch.state_slots = slots
    model.forward(batch)
    for s, p in zip(seqs, PROMPTS):
        s.length = len(p)
    return cache, seqs, slots


def decode_batch(cache, seqs, slots) -> ForwardBatch:
    """The next decode step of the prefilled sequences (its inputs are on the device before the step runs)."""
    batch = ForwardBatch.with_cache([[3], [4]], [s.length for s in seqs], [s.pages for s in seqs], cache)
    batch.state_slots = slots
    return batch


@pytest.mark.parametrize("name", ["nemotron_h", "qwen4_exp", "qwen3_5_moe", "qwen3_next", "lfm2_moe", "qwen3_5",
                                  "olmo_hybrid"])
def test_decode_step_reads_nothing_on_the_host(tmp_path, monkeypatch, name):
    """The model loaded as on CUDA (its dense experts stacked into pair sets, the pair path taken): its decode step
    reads no tensor on the host outside kernel-backed ops (experts without a pair path would group their rows,
    reading the counts) and copies nothing to the device, and gives the grouped CPU step's logits."""
    monkeypatch.setattr(moe_ops, "PAIR_DEVICE_TYPES", ("cuda", "cpu"))
    with torch_threads(1):
        lm = trellm.load(tiny_model(name, tmp_path), device="cpu", dtype=torch.float32, tokenizer=False)
        kernels = cuda_kernel_ops()
        step = decode_batch(*prefilled(lm.model))
        with HostReads(except_in=kernels) as reads:
            logits = lm.model.forward(step)
        assert not reads.found, "\n".join(f"{what}\n{where}" for what, where in reads.found[:3])
        monkeypatch.setattr(moe_ops, "PAIR_DEVICE_TYPES", ("cuda",))  # the CPU's own route: rows grouped by expert
        grouped = lm.model.forward(decode_batch(*prefilled(lm.model)))
    torch.testing.assert_close(logits, grouped, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_leaves_nemotron_routed_experts_whole(tmp_path):
    """NemotronH's routed experts (ungated ExpertMLPs, no MoE block to spread them) run whole on every rank, as any
    routed expert does; its Mamba mixer splits by heads."""
    from trellm.distributed.plan import PlanComm
    from trellm.distributed.sharding import shard_module

    lm = trellm.load(tiny_model("nemotron_h", tmp_path), device="cpu", dtype=torch.float32, tokenizer=False)
    mamba, moe = lm.model.layers[0].attn, lm.model.layers[2].attn
    shapes = [tuple(m.up_proj.impl.weight.shape) for m in moe.experts.experts]
    in_proj = mamba.in_proj.impl.weight.shape[0]
    for block in lm.model.layers:
        shard_module(block, PlanComm(0, 2, torch.device("cpu")))
    assert [tuple(m.up_proj.impl.weight.shape) for m in moe.experts.experts] == shapes
    assert mamba.in_proj.impl.weight.shape[0] < in_proj
