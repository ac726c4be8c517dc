"""The CUDA routes of trellm.ops.project, checked without a GPU.

The cffi kernel library is replaced by a stub that logs every ``trellm_*`` call (its scalar arguments; NULL or
not for pointers; the residual-stream struct's fields) and returns success; the ops' CUDA implementations run on
CPU tensors. A 2-layer EXL3 Qwen3 (128-wide heads, unpadded layers) then takes one decode step of 1, 5, 6, 64 and
65 sequences: each row count must reach the kernels its route promises (GEMV to 5 rows, mid-size 6..64,
decode + cuBLAS above; the input norm from the sums of squares, the residual add, the gated activation at 1 row,
q/k/v with RoPE and the KV write). The outputs are garbage: only the calls are checked.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("cffi")

GEMV = ["exl3_matmul_small_qkv_rope", "paged_attention", "exl3_matmul_small", "exl3_matmul_small_multi"]
MID = ["exl3_matmul_mid_qkv_rope", "paged_attention", "exl3_matmul_mid", "exl3_matmul_mid", "gated_activation",
       "exl3_matmul_mid"]
CUBLAS = ["hadamard_128", "exl3_decode_tiles", "hadamard_128"]  # one projection: W decoded, then torch.matmul
LAYER = {
    1: GEMV + ["exl3_matmul_small_gated"],
    5: GEMV + ["gated_activation", "exl3_matmul_small"],
    6: MID,
    64: MID,
    65: 3 * CUBLAS + ["rotary_qk", "paged_attention"] + CUBLAS + ["rms_norm"] + 2 * CUBLAS + ["gated_activation"] + CUBLAS,
}
HEAD = {1: ["exl3_matmul_small"], 5: ["exl3_matmul_small"], 6: ["exl3_matmul_mid"], 64: ["exl3_matmul_mid"], 65: CUBLAS}


@pytest.fixture(scope="module")
def exl3_qwen3(tmp_path_factory):
    import trellm
    from trellm.modules.linear import Linear
    from trellm.quant.exl3.format import EXL3Linear
    from trellm.sdk.testing import make_tiny_hf_model

    d = make_tiny_hf_model("Qwen3ForCausalLM", tmp_path_factory.mktemp("q3"), num_hidden_layers=2, hidden_size=256,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=128, intermediate_size=512,
                           vocab_size=512)
    model = trellm.load(d, device="cpu", dtype=torch.float16, tokenizer=False).model
    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, Linear):
            m.impl = EXL3Linear.random(m.in_features, m.out_features, generator=gen, key=m.key)
    return model


@pytest.fixture
def stub_kernels(monkeypatch):
    """The log of kernel calls [(name, args)], with the stub library and the CUDA implementations in place."""
    from trellm.kernels_cuda import binding

    calls: list[tuple[str, list]] = []
    ffi = binding.ffi()

    def arg(a):
        if isinstance(a, ffi.CData):
            t = ffi.typeof(a)
            if t.kind == "pointer" and a != ffi.NULL and t.item.kind == "struct":
                return {name: arg(getattr(a, name)) for name, _ in t.item.fields}
            return "NULL" if t.kind == "pointer" and a == ffi.NULL else "ptr"
        return a

    class StubLibrary:
        def __getattr__(self, name):
            def call(*args):
                calls.append((name.removeprefix("trellm_"), [arg(a) for a in args]))
                return 0

            return call

    def expect(t, name, *, dtype=None, shape=None, device=None, contiguous=True, optional=False):
        """binding.expect without the CUDA-device check."""
        if t is None:
            assert optional, name
            return
        assert dtype is None or t.dtype in (dtype if isinstance(dtype, tuple) else (dtype,)), (name, t.dtype)
        assert shape is None or (t.dim() == len(shape) and all(s in (None, d) for s, d in zip(shape, t.shape))), name
        assert not contiguous or t.is_contiguous(), name

    monkeypatch.setattr(binding, "_lib", StubLibrary())
    monkeypatch.setattr(binding, "expect", expect)
    monkeypatch.setattr(binding, "_stream", lambda: ffi.NULL)
    monkeypatch.setattr(binding, "_num_sms", lambda device: 132)
    from trellm import ops
    from trellm.kernels_cuda import ops as _cuda_ops  # noqa: F401  (registers the CUDA implementations)
    from trellm.ops.projection import ProjectOp

    def cuda_route(self, *args, **kwargs):
        return self.impls.get("cuda", self.reference)(*args, **kwargs)

    monkeypatch.setattr(ops.Op, "__call__", cuda_route)
    monkeypatch.setattr(ProjectOp, "__call__", cuda_route)
    return calls


@pytest.mark.parametrize("rows", [1, 5, 6, 64, 65])
def test_decode_step_kernels(exl3_qwen3, stub_kernels, rows):
    from trellm.batch import ForwardBatch
    from trellm.cache import KVCache

    cache = KVCache.for_model(exl3_qwen3, max_tokens=rows * 32, page_size=16)
    step = ForwardBatch.with_cache([[3]] * rows, [7] * rows, [cache.allocator.alloc(2) for _ in range(rows)], cache)
    with torch.no_grad():
        exl3_qwen3.forward(step)
    launches = [(name, args) for name, args in stub_kernels if not name.endswith(("_workspace", "_splits_for"))]
    names = [name for name, _ in launches]
    # the first input norm, two blocks (past 64 rows no sums of squares: the second block's norm reads h), the final
    # norm (an RMSNorm alone: the last down projection added the residual), the head
    between = ["rms_norm"] if rows > 64 else []
    assert names == ["rms_norm"] + LAYER[rows] + between + LAYER[rows] + ["rms_norm"] + HEAD[rows], names
    if rows > 64:
        return
    # the fused steps' arguments: the residual stream struct of each EXL3 launch
    stream = [next((a for a in args if isinstance(a, dict)), {}) for name, args in launches if name.startswith("exl3")]
    assert len(stream) == 9 and stream[0] == {} and stream[8] == {}  # layer 1's q/k/v takes x normed; the head
    qkv, o_proj, gate_up, down = stream[4:8]  # layer 2's, in order
    assert qkv["ssq_in"] == "ptr" and qkv["norm_weight"] == "ptr"  # its input norm from layer 1's sums
    assert o_proj["residual"] == "ptr" and o_proj["ssq_out"] == "ptr"  # the residual add, the sums for the next norm
    assert gate_up["ssq_in"] == "ptr"
    assert down["residual"] == "ptr" and down["ssq_out"] == "ptr"
