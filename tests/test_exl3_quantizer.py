"""EXL3 quantizer: Viterbi tile encoder, block LDL, and the layer round trip at K = 1..8."""
from __future__ import annotations

import pytest
import torch

from trellm.ops import exl3 as ops
from trellm.quant.exl3 import EXL3Linear, dequantize, quantize_group, quantize_linear
from trellm.quant.exl3.quantize import (
    block_ldl,
    column_scale_shape,
    compensated_weights,
    hessian_form,
    out_scale_loss_ratio,
    rate_distortion_bound,
    relative_mse,
)
from trellm.quant.exl3.viterbi import encode_tiles


def _ring_ok(states: torch.Tensor, K: int) -> bool:
    mask = (1 << (16 - K)) - 1
    return bool(torch.equal(states[:, 1:] >> K, states[:, :-1] & mask) and torch.equal(states[:, 0] >> K, states[:, 255] & mask))


@pytest.mark.parametrize("K", [2, 5, 8])
def test_viterbi_recovers_a_valid_trellis_exactly(K):
    trellis = torch.randint(-32768, 32767, (6, 16 * K), dtype=torch.int16, generator=torch.Generator().manual_seed(K))
    target = ops.exl3_codebook_decode(ops.unpack_trellis(trellis), "mcg").float()
    states, values = encode_tiles(target, K, "mcg")
    assert _ring_ok(states, K)
    assert torch.equal(values, target)


@pytest.mark.parametrize("K", [6, 8])
def test_cpu_encoder_matches_torch_reference(K):
    target = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)) * 1.2
    ref = ops.trellis_viterbi(target, K, "3inst")  # the op's torch reference on CPU
    got, values = encode_tiles(target, K, "3inst")
    assert _ring_ok(ref.long(), K) and _ring_ok(got.long(), K)
    err_ref = (ops.exl3_codebook_decode(ref, "3inst").float() - target).pow(2).sum(1)
    err_got = (values - target).pow(2).sum(1)
    torch.testing.assert_close(err_got, err_ref, rtol=0.02, atol=1e-3)  # float cost order differs


def test_block_ldl_factorises_the_hessian():
    x = torch.randn(512, 128, dtype=torch.float64)
    h = x.t() @ x / 512 + 0.1 * torch.eye(128, dtype=torch.float64)
    u = block_ldl(h.float()).double() + torch.eye(128, dtype=torch.float64)
    # U unit block-lower: U^-1 H U^-T is block diagonal (16x16 blocks)
    uinv = torch.linalg.inv(u)
    d = uinv @ h @ uinv.t()
    mask = torch.block_diag(*[torch.ones(16, 16, dtype=torch.bool)] * 8)
    assert d[~mask].abs().max() < 1e-3 * d.abs().max()
    assert torch.equal(u.triu(1)[~mask], torch.zeros_like(u)[~mask])


def test_layer_roundtrip_error_falls_with_K():
    """A random 128x128 layer with correlated inputs: output error (and weight MSE) fall with every K."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(128, 128, generator=gen)
    mix = torch.randn(128, 128, generator=gen) * 0.2 + torch.eye(128)
    x = torch.randn(1024, 128, generator=gen) @ mix
    h = x.t() @ x / x.shape[0]
    ref = x @ w.t()
    out_err, w_err = [], []
    for K in range(1, 9):
        (qt,), stats = quantize_group([w], h, K, "mul1", seed=K)
        assert qt.trellis.shape == (8, 8, 16 * K) and qt.trellis.dtype == torch.int16
        dense = dequantize(qt).t()
        out_err.append(((x @ dense.t() - ref).pow(2).sum() / ref.pow(2).sum()).item())
        w_err.append(relative_mse(w, dense))
        assert stats.proxy_error == pytest.approx(out_err[-1], rel=0.35)
    print("\nK  output-rel-MSE  weight-rel-MSE  2^-2K")
    for K, (o, e) in enumerate(zip(out_err, w_err), start=1):
        print(f"{K}  {o:.6f}  {e:.6f}  {rate_distortion_bound(K):.6f}")
    assert all(a > b for a, b in zip(out_err, out_err[1:])), out_err
    # within a small factor of the Gaussian rate-distortion bound where fp16 resolution does not dominate
    for K in range(1, 6):
        assert out_err[K - 1] < 2.0 * rate_distortion_bound(K)


def test_quantize_linear_padding_bias_and_forward():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(100, 72, generator=gen)  # padded to 128x128 in storage
    b = torch.randn(100, generator=gen)
    qt = quantize_linear(w, None, 5, "3inst", bias=b)
    assert qt.trellis.shape == (8, 8, 80) and qt.bias.shape == (128,)
    assert torch.all(qt.svh[100:] == 0)
    tensors = qt.state_dict("layer")
    assert set(tensors) == {"layer.trellis", "layer.suh", "layer.svh", "layer.bias"}
    lin = EXL3Linear.from_quantized(qt, 72, 100)
    x = torch.randn(4, 72, generator=gen)
    y = lin.forward(x)
    torch.testing.assert_close(y, x @ lin.dense_weight().t() + qt.bias[:100].float(), rtol=1e-4, atol=1e-4)
    assert relative_mse(x @ w.t() + b, y) < 0.01
    # uncalibrated (no Hessian): weight error near the Gaussian rate-distortion bound 2^-2K
    assert relative_mse(w, lin.dense_weight()) < 1.6 * rate_distortion_bound(5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="1..8"):
        quantize_group([torch.randn(128, 128)], None, 9)
    with pytest.raises(ValueError, match="codebook"):
        quantize_group([torch.randn(128, 128)], None, 4, "foo")


def test_hessian_form_is_the_trace_without_the_n_by_n_product(monkeypatch):
    import trellm.quant.exl3.quantize as q

    monkeypatch.setattr(q, "SLAB_ELEMENTS", 64 * 128)  # several slabs even for this small matrix
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 384, generator=gen, dtype=torch.float64).float()
    a = torch.randn(64, 64, generator=gen)
    h = a @ a.t()
    assert hessian_form(x, h) == pytest.approx(torch.trace(x.t().double() @ h.double() @ x.double()).item(), rel=1e-5)


def test_scale_refit_lowers_the_output_error():
    """Same trellis (same seed), refit on and off: the refit scales only ever help, here by a few percent."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(128, 128, generator=gen) * torch.linspace(0.2, 2.0, 128)[:, None]
    x = torch.randn(1024, 128, generator=gen) @ (torch.randn(128, 128, generator=gen) * 0.3 + torch.eye(128))
    h = x.t() @ x / x.shape[0]
    ref = x @ w.t()
    errs = {}
    for refit in (False, True):
        (qt,), stats = quantize_group([w], h, 2, "mul1", seed=1, refit=refit)
        errs[refit] = ((x @ dequantize(qt) - ref).pow(2).sum() / ref.pow(2).sum()).item()
        assert stats.proxy_error == pytest.approx(errs[refit], rel=0.02)  # the proxy is the real output error
    print(f"\nK=2 output rel. MSE: no refit {errs[False]:.5f}, refit {errs[True]:.5f}")
    assert errs[True] < 0.99 * errs[False]


def test_compensated_weights_reproduce_the_dense_outputs_from_the_quantized_inputs():
    """W* maps the perturbed inputs x to W x_ref far better than W does; with unperturbed inputs it is W itself."""
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(64, 64, generator=gen) / 8
    x_ref = torch.randn(8192, 64, generator=gen) @ (torch.eye(64) + mix)
    x = x_ref @ (torch.eye(64) + 0.2 * torch.randn(64, 64, generator=gen) / 8) + 0.05 * torch.randn(8192, 64, generator=gen)
    w = torch.randn(32, 64, generator=gen)
    h, cross = x.t() @ x / len(x), x.t() @ x_ref / len(x)
    target = x_ref @ w.t()
    (w_star,) = compensated_weights([w], h, cross)
    err_plain = (x @ w.t() - target).pow(2).mean().item()
    err_star = (x @ w_star.t() - target).pow(2).mean().item()
    assert err_star < 0.1 * err_plain, (err_plain, err_star)
    (w_half,) = compensated_weights([w], h, cross, strength=0.5)
    assert torch.allclose(w_half, (w + w_star) / 2, atol=1e-5)
    h_ref = x_ref.t() @ x_ref / len(x_ref)
    (same,) = compensated_weights([w], h_ref, h_ref)
    assert torch.allclose(same, w, atol=1e-6)


def _predicted_loss(t: torch.Tensor, rms: torch.Tensor, s: torch.Tensor) -> float:
    """The loss column_scale_shape weighs scales by: (sum s t^2) (sum rms^2 / t^2)."""
    return ((s * t.square()).sum() * (rms.square() / t.square()).sum()).item()


def test_out_scale_choice_follows_the_sensitivity():
    """Sensitive light columns keep the scales, sensitive heavy ones drop them, a flat sensitivity is a tie
    (kept); "fit" beats both fixed choices on the loss it is derived from."""
    rms = torch.logspace(-1, 0.5, 256)
    assert out_scale_loss_ratio(rms, rms**-2) < 0.5 and out_scale_loss_ratio(rms, rms**2) > 2
    assert out_scale_loss_ratio(rms, torch.ones(256)) == pytest.approx(1.0)
    assert column_scale_shape(rms, rms**-2, "auto")[1] == "always"
    assert column_scale_shape(rms, torch.ones(256), "auto")[1] == "always"
    never, choice = column_scale_shape(rms, rms**2, "auto")
    assert choice == "never" and torch.equal(never, torch.ones(256))
    assert column_scale_shape(rms, None, "auto")[1] == "always"  # no sensitivity (attention, down): always
    assert column_scale_shape(rms, torch.zeros(256), "fit")[1] == "always"  # says nothing: always
    assert column_scale_shape(rms, rms**2, "never")[1] == "never"
    s = torch.rand(256, generator=torch.Generator().manual_seed(0)) * rms**2 + 0.5
    fit, choice = column_scale_shape(rms, s, "fit")
    assert choice == "fit"
    assert _predicted_loss(fit, rms, s) < 0.99 * min(_predicted_loss(rms, rms, s), _predicted_loss(torch.ones(256), rms, s))
    with pytest.raises(ValueError, match="out_scales must be one of .*'sometimes'"):
        column_scale_shape(rms, s, "sometimes")


def test_auto_out_scales_are_stored_in_svh_and_load_back(tmp_path):
    """gate and up of one group, the gate's heavy channels sensitive (auto drops its scales), the up's light
    ones (auto keeps them): the choice is in the stored svh, the file loads through the EXL3 format and
    decodes to the quantizer's own dequantization, with the output error the quantizer reported; and on
    the gate the dropped scales cut the sensitivity-weighted error below what the plain scales give."""
    from safetensors.torch import save_file

    from trellm.quant.exl3.format import EXL3Format
    from trellm.weights import WeightStore

    gen = torch.Generator().manual_seed(5)
    rms = torch.logspace(-1, 0.5, 128)
    gate = torch.randn(128, 128, generator=gen) * rms[:, None]  # HF [out, in]: row j is output channel j
    up = torch.randn(128, 128, generator=gen) * rms[:, None]
    x = torch.randn(2048, 128, generator=gen) @ (torch.randn(128, 128, generator=gen) * 0.2 + torch.eye(128))
    h = x.t() @ x / x.shape[0]
    sens = [rms**2, rms**-2]
    runs = {}
    for mode in ("always", "auto"):
        runs[mode] = quantize_group([gate, up], h, 3, "mul1", seed=2, out_scales=mode, sensitivities=sens, refit=False)
    qts, stats = runs["auto"]
    assert stats.extra["out_scales"] == ["never", "always"] and runs["always"][1].extra["out_scales"] == ["always"] * 2
    gate_svh, up_svh = qts[0].svh.float().abs(), qts[1].svh.float().abs()
    assert gate_svh.std() / gate_svh.mean() < 1e-3  # one magnitude: no per-channel scales
    up_rms = up.pow(2).mean(1).sqrt()  # each output channel's own RMS
    torch.testing.assert_close(up_svh / up_svh.mean(), up_rms / up_rms.mean(), rtol=2e-3, atol=0)

    save_file({**qts[0].state_dict("mlp.gate_proj"), **qts[1].state_dict("mlp.up_proj")}, str(tmp_path / "model.safetensors"))
    store = WeightStore(tmp_path)
    num = den = 0.0
    for key, qt, w in (("mlp.gate_proj", qts[0], gate), ("mlp.up_proj", qts[1], up)):
        loaded = EXL3Format().load_linear(store, key, 128, 128, False, torch.device("cpu"), torch.float32)
        decoded = loaded.dense_weight()
        torch.testing.assert_close(decoded, dequantize(qt).t(), rtol=0, atol=1e-5)
        num += (x @ (decoded - w).t()).pow(2).sum().item()
        den += (x @ w.t()).pow(2).sum().item()
    assert num / den == pytest.approx(stats.proxy_error, rel=0.02)

    def gate_weighted_error(qt) -> float:
        err = (x @ (dequantize(qt).t() - gate).t()).pow(2).mean(0)  # per output channel
        return (err * sens[0]).sum().item()

    always, auto = gate_weighted_error(runs["always"][0][0]), gate_weighted_error(qts[0])
    print(f"\ngate, sensitivity-weighted output error at 3 bpw: scales {always:.4g}, dropped {auto:.4g}")
    assert auto < 0.8 * always


def test_drift_lowers_the_global_scale():
    """scale_drift searches on the sample scaled up by LDLQ_DRIFT[K], so g comes out smaller; the measured
    drift (RMS of LDLQ's strip targets over the weight's) is reported, and at K = 1 it is a few percent."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(128, 128, generator=gen)
    x = torch.randn(2048, 128, generator=gen) @ (torch.randn(128, 128, generator=gen) * 0.1 + torch.eye(128))
    h = x.t() @ x / x.shape[0]
    _, plain = quantize_group([w], h, 1, "mul1", seed=3)
    _, drift = quantize_group([w], h, 1, "mul1", seed=3, drift=True)
    assert drift.scale < plain.scale
    assert 1.0 < plain.extra["ldlq_drift"] < 1.3 and plain.extra["out_scales"] == ["always"]
