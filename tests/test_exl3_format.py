"""EXL3 format: golden vectors (bit-exact decode, dense weight, probes), packing, loader detection."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trellm.errors import WeightError
from trellm.ops import exl3 as ops
from trellm.quant.exl3 import MARKER_VALUES, EXL3Format, EXL3Linear, unpack_signs
from trellm.weights import WeightStore

GOLDEN = Path(__file__).parent / "data" / "golden"
CASES = [(K, cb) for K in (2, 4) for cb in ("3inst", "mcg", "mul1")]


def golden(K: int, cb: str) -> dict[str, torch.Tensor]:
    return load_file(GOLDEN / f"exl3_k{K}_{cb}_256x256.safetensors")


def test_codebooks_all_states_bit_exact():
    ref = load_file(GOLDEN / "exl3_codebooks_all_states.safetensors")
    states = torch.arange(65536, dtype=torch.int32)
    for cb in ops.CODEBOOKS:
        got = ops.exl3_codebook_decode(states, cb)
        assert got.dtype == torch.float16
        assert torch.equal(got.view(torch.int16), ref[f"codebook.{cb}"].view(torch.int16)), cb


@pytest.mark.parametrize("K,cb", CASES)
def test_golden_decode_dense_and_probe(K, cb):
    g = golden(K, cb)
    trellis = g["layer.trellis"]
    assert trellis.shape[-1] // 16 == K
    marker = [name for name in MARKER_VALUES if f"layer.{name}" in g]
    assert marker == ([] if cb == "3inst" else [cb])
    w_hat = ops.exl3_decode_tiles(trellis, cb)
    assert torch.equal(w_hat.view(torch.int16), g["expected.w_hat"].view(torch.int16))
    lin = EXL3Linear(trellis, g["layer.suh"], g["layer.svh"], cb, 256, 256)
    torch.testing.assert_close(lin.dense_weight().t(), g["expected.weight"], rtol=0, atol=1e-5)
    y = ops.exl3_matmul(g["probe.x"], trellis, g["layer.suh"], g["layer.svh"], cb)
    torch.testing.assert_close(y, g["probe.y"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.forward(g["probe.x"]), g["probe.y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K", range(1, 9))
def test_pack_unpack_roundtrip(K):
    trellis = torch.randint(-32768, 32767, (2, 3, 16 * K), dtype=torch.int16, generator=torch.Generator().manual_seed(K))
    states = ops.unpack_trellis(trellis)
    # consecutive states overlap in 16-K bits, and the ring closes (tail-biting)
    mask = (1 << (16 - K)) - 1
    assert torch.equal(states[..., 1:] >> K, states[..., :-1] & mask)
    assert torch.equal(states[..., 0] >> K, states[..., 255] & mask)
    assert torch.equal(ops.pack_trellis(states, K), trellis)


def test_documented_bit_layout_examples():
    codes = torch.arange(256) % 16
    states = sum((torch.roll(codes, i) << (4 * i)) for i in range(4)) & 0xFFFF
    words = ops.pack_trellis(states, 4)
    assert [int(w) & 0xFFFF for w in words[:5]] == [0x4567, 0x0123, 0xCDEF, 0x89AB, 0x4567]
    assert [int(s) for s in ops.unpack_trellis(words)[:5]] == [0xDEF0, 0xEF01, 0xF012, 0x0123, 0x1234]
    words3 = ops.pack_trellis(torch.arange(256) % 8, 3)
    assert [int(w) & 0xFFFF for w in words3[:6]] == [0x7705, 0x0539, 0x0539, 0x3977, 0x3977, 0x7705]
    expect = {"3inst": [-1.025, 2.066, -0.4102, -0.664, -2.2], "mcg": [3.434, 1.075, -0.564, -1.788, 1.515],
              "mul1": [-2.012, -0.3064, -0.04242, -0.2996, -0.577]}
    for cb, vals in expect.items():
        got = ops.exl3_codebook_decode(torch.tensor([0xDEF0, 0xEF01, 0xF012, 0x0123, 0x1234]), cb).float()
        torch.testing.assert_close(got, torch.tensor(vals), rtol=2e-3, atol=1e-3)


def test_tile_permutation_matches_doc():
    assert ops.TILE_PERM[:16].tolist() == [0, 16, 128, 144, 8, 24, 136, 152, 32, 48, 160, 176, 40, 56, 168, 184]
    assert sorted(ops.TILE_PERM.tolist()) == list(range(256))


def test_hadamard_is_orthonormal_and_symmetric():
    h = ops.hadamard_matrix()
    torch.testing.assert_close(h @ h, torch.eye(128), atol=1e-6, rtol=0)
    assert torch.equal(h, h.t())
    x = torch.randn(3, 256, dtype=torch.float16)
    y = ops.hadamard_128(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(ops.hadamard_128(y).float(), x.float(), atol=2e-2, rtol=0)


def _save_layer(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> WeightStore:
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors")
    return WeightStore(tmp_path)


def test_format_detects_and_loads_with_padding(tmp_path):
    g = golden(4, "mul1")
    bias = torch.randn(256, dtype=torch.float16)
    store = _save_layer(tmp_path, {
        "m.trellis": g["layer.trellis"], "m.suh": g["layer.suh"], "m.svh": g["layer.svh"],
        "m.mul1": g["layer.mul1"], "m.bias": bias, "dense.weight": torch.zeros(2, 2),
    })
    fmt = EXL3Format()
    assert fmt.detect(store, "m") and not fmt.detect(store, "dense")
    # true module 200 -> 250 inside the padded 256x256 tensors
    lin = fmt.load_linear(store, "m", 200, 250, True, torch.device("cpu"), torch.float32)
    assert lin.codebook == "mul1" and lin.bits == 4
    x = torch.randn(2, 3, 200)
    y = lin.forward(x)
    assert y.shape == (2, 3, 250)
    ref = torch.nn.functional.pad(x, (0, 56)) @ g["expected.weight"] + bias.float()
    torch.testing.assert_close(y, ref[..., :250], rtol=1e-4, atol=1e-4)
    assert lin.dense_weight().shape == (250, 200)


def test_legacy_packed_signs_and_marker_warning(tmp_path):
    g = golden(2, "mcg")
    su = torch.randint(-32768, 32767, (16,), dtype=torch.int16)
    store = _save_layer(tmp_path, {
        "m.trellis": g["layer.trellis"], "m.su": su, "m.svh": g["layer.svh"],
        "m.mcg": torch.tensor(12345, dtype=torch.int32),
    })
    with pytest.warns(UserWarning, match="not the locked"):
        lin = EXL3Format().load_linear(store, "m", 256, 256, False, torch.device("cpu"), torch.float32)
    signs = unpack_signs(su)
    assert torch.equal(lin.suh, signs)
    assert float(signs[0]) == (-1.0 if int(su[0]) & 1 else 1.0)
    assert lin.codebook == "mcg"


def test_bad_tensors_raise_clear_errors(tmp_path):
    g = golden(2, "3inst")
    store = _save_layer(tmp_path, {
        "m.trellis": g["layer.trellis"], "m.suh": g["layer.suh"].float(), "m.svh": g["layer.svh"],
    })
    with pytest.raises(WeightError, match="m.suh"):
        EXL3Format().load_linear(store, "m", 256, 256, False, torch.device("cpu"), torch.float32)
    with pytest.raises(WeightError, match="trellis"):
        EXL3Linear(g["layer.trellis"].int(), g["layer.suh"], g["layer.svh"], "3inst", 256, 256, key="x")
    with pytest.raises(WeightError, match="smaller"):
        EXL3Linear(g["layer.trellis"], g["layer.suh"], g["layer.svh"], "3inst", 300, 256, key="x")


def test_grouped_weights_match_separate_forwards():
    # q/k/v-style projections of one x: EXL3 layers of one K group into one EXL3Group (one exl3_matmul_group
    # call) that gives exactly what each layer's own forward gives, padding and output trimming included;
    # layers of another K or codebook stay a WeightList (one call each).
    from trellm.ops import project
    from trellm.ops.projection import WeightList, group_weights
    from trellm.quant.exl3.format import EXL3Group

    gen = torch.Generator().manual_seed(5)

    def layer(n_out: int, K: int, cb: str = "mcg") -> EXL3Linear:
        k, n = 256, -(-n_out // 128) * 128
        t = torch.randint(-32768, 32767, (k // 16, n // 16, 16 * K), dtype=torch.int16, generator=gen)
        suh = (torch.randn(k, generator=gen) * 0.1).half()
        svh = (torch.rand(n, generator=gen) + 0.5).half()
        return EXL3Linear(t, suh, svh, cb, 200, n_out, bias=torch.randn(n_out, generator=gen).half())

    x = torch.randn(3, 200, generator=gen)
    same = [layer(256, 4), layer(100, 4), layer(128, 4)]
    grouped = group_weights(same)
    assert isinstance(grouped, EXL3Group) and not grouped.unpadded
    for got, w in zip(project(x, grouped), same):
        assert got.shape == (3, w.out_features)
        torch.testing.assert_close(got, w.forward(x), rtol=0, atol=0)
    mixed = [layer(128, 4), layer(128, 2), layer(128, 4, "mul1")]
    assert type(group_weights(mixed)) is WeightList
    for got, w in zip(project(x, group_weights(mixed)), mixed):
        torch.testing.assert_close(got, w.forward(x), rtol=0, atol=0)


def test_gated_projection_matches_activation_then_forward():
    # A gated MLP's down projection: project(gate, down, pre=GatedAct(up, act)) gives down(gated_activation(gate,
    # up)) for EXL3 (padding of the stored k and trimming of n included) and dense weights; with a Residual the
    # add is left to the next norm (a Hidden whose value is the sum).
    from trellm import ops
    from trellm.modules.linear import DenseLinear
    from trellm.ops.projection import GatedAct, Hidden, Residual

    gen = torch.Generator().manual_seed(6)
    k, n, in_features, out_features = 256, 256, 200, 100
    t = torch.randint(-32768, 32767, (k // 16, n // 16, 16 * 4), dtype=torch.int16, generator=gen)
    down = EXL3Linear(t, (torch.randn(k, generator=gen) * 0.1).half(), (torch.rand(n, generator=gen) + 0.5).half(),
                      "mcg", in_features, out_features, bias=torch.randn(out_features, generator=gen).half())
    gate, up = torch.randn(2, 3, in_features, generator=gen), torch.randn(2, 3, in_features, generator=gen)
    for act in ("silu", "gelu_tanh", "relu"):
        got = ops.project(gate, down, pre=GatedAct(up, act))
        assert got.shape == (2, 3, out_features)
        torch.testing.assert_close(got, down.forward(ops.gated_activation(gate, up, act)), rtol=1e-5, atol=1e-5)
    dense = DenseLinear(torch.randn(out_features, in_features, generator=gen), None)
    want = dense.forward(ops.gated_activation(gate, up, "silu"))
    torch.testing.assert_close(ops.project(gate, dense, pre=GatedAct(up, "silu")), want)
    residual = torch.randn(2, 3, out_features, generator=gen)
    summed = ops.project(gate, dense, pre=GatedAct(up, "silu"), post=Residual(residual))
    assert isinstance(summed, Hidden) and summed.residual is residual
    torch.testing.assert_close(summed.value(), want + residual)


def test_gated_mlp_routes_the_down_projection_through_gated_act(monkeypatch):
    from trellm import ops
    from trellm.modules import layers
    from trellm.modules.linear import DenseLinear
    from trellm.ops.projection import GatedAct

    pres = []
    real = layers.project

    def spy(x, weights, pre=None, post=None):
        pres.append(pre)
        return real(x, weights, pre, post)

    monkeypatch.setattr(layers, "project", spy)
    mlp = layers.GatedMLP("mlp", 64, 128, activation="gelu_tanh")
    gen = torch.Generator().manual_seed(7)
    for lin, (i, o) in ((mlp.gate_proj, (64, 128)), (mlp.up_proj, (64, 128)), (mlp.down_proj, (128, 64))):
        lin.impl = DenseLinear(torch.randn(o, i, generator=gen) * 0.1, None)
    x = torch.randn(5, 64, generator=gen)
    y = mlp.forward(x)
    want = mlp.down_proj(ops.gated_activation(mlp.gate_proj(x), mlp.up_proj(x), "gelu_tanh"))
    torch.testing.assert_close(y, want)
    assert [type(p) for p in pres] == [type(None), GatedAct] and pres[1].activation == "gelu_tanh"
