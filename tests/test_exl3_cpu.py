"""EXL3 on CPU: no kernel runs the format there, so a load decodes each weight once (not at every forward) and
says how much memory that takes; the logits are the per-forward decode's."""
from __future__ import annotations

import json

import pytest
import torch

import trellm
from trellm.modules.linear import Linear
from trellm.ops.exl3 import exl3_decode_tiles
from trellm.quant.exl3 import EXL3Linear
from trellm.sdk.testing import make_tiny_hf_model

from test_tensor_parallel import EXL3_SMALL, _exl3_from_dense


@pytest.fixture
def exl3_dir(tmp_path):
    dense = make_tiny_hf_model("LlamaForCausalLM", tmp_path / "dense", **dict(EXL3_SMALL, num_hidden_layers=2))
    out = _exl3_from_dense(dense, tmp_path / "exl3")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "exl3", "bits": 2}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_exl3_on_cpu_decodes_once_at_load_and_matches_the_per_forward_decode(exl3_dir, monkeypatch):
    decodes = []
    decode = exl3_decode_tiles.reference
    monkeypatch.setattr(exl3_decode_tiles, "reference", lambda *a: decodes.append(a[0].shape) or decode(*a))
    with pytest.warns(UserWarning, match=r"EXL3 weights on cpu \(no kernel there\): decoded once at load to float32, "
                                         r"[\d.]+ MiB of memory") as note:
        lm = trellm.load(exl3_dir, device="cpu", dtype=torch.float32, tokenizer=False)
    impls = [m.impl for m in lm.model.modules() if isinstance(m, Linear)]
    assert len(impls) == 2 * 7 + 1 and all(isinstance(w, EXL3Linear) and w.decoded is not None for w in impls)
    held = sum(w.decoded.numel() * 4 for w in impls)
    assert f"{held / 2**20:.2f} MiB" in str(note[0].message) and note[0].filename == __file__
    assert all(w.nbytes() == w.decoded_nbytes() + w.trellis.numel() * 2 + (w.padded_in + w.padded_out) * 2 for w in impls)
    assert len(decodes) == len(impls)  # one decode per weight, at load

    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    got = lm.logits(ids)
    greedy = list(lm.generate_ids(ids[0].tolist(), max_new_tokens=6, stop_token_ids=[]))
    assert len(decodes) == len(impls)  # none while running

    for w in impls:  # back to the reference route: every forward decodes every weight
        w.decoded = None
    want = lm.logits(ids)
    assert len(decodes) > len(impls)
    span = (want.max() - want.min()).item()
    assert (got - want).abs().max().item() <= 1e-5 * span
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert list(lm.generate_ids(ids[0].tolist(), max_new_tokens=6, stop_token_ids=[])) == greedy


def test_decode_slices_the_output_columns_into_bounded_pieces(monkeypatch):
    # The bit unpacking takes 8 bytes per bit of every weight: a large head is decoded 128-column blocks at a
    # time, to the same dense weight as in one piece (padding of both dims included).
    import trellm.quant.exl3.format as fmt

    w = EXL3Linear.random(256, 640, K=3, generator=torch.Generator().manual_seed(2))
    w = EXL3Linear(w.trellis, w.suh, w.svh, w.codebook, 200, 600, bias=torch.randn(600).half())
    whole = w.dense_weight()
    monkeypatch.setattr(fmt, "_DECODE_BYTES", 8 * 256 * 3 * 256)  # two 128-column blocks a piece: 3 pieces
    pieces = []
    decode = exl3_decode_tiles.reference
    monkeypatch.setattr(exl3_decode_tiles, "reference", lambda *a: pieces.append(a[0].shape[1] * 16) or decode(*a))
    w.decode(torch.bfloat16)
    assert pieces == [256, 256, 128]
    assert w.decoded.shape == (600, 200) and w.decoded.dtype == torch.bfloat16
    torch.testing.assert_close(w.decoded, whole.bfloat16(), rtol=0, atol=0)
    x = torch.randn(3, 200, dtype=torch.bfloat16)
    torch.testing.assert_close(w.forward(x), torch.nn.functional.linear(x, w.decoded, w.bias[:600].bfloat16()))
