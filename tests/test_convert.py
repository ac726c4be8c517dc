"""`trellm convert`: a tiny random Llama to EXL3 on CPU, loaded back; resume; clear errors."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trellm
from trellm.convert import ConversionError, ConversionInterrupted, PlanGroup, allocate_bits, convert
from trellm.errors import UnknownArchitectureError

FAST = dict(device="cpu", progress=False, cal_rows=8, cal_cols=64, head_bits=6)


def make_tiny_llama(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init: every layer matters to the logits
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 if "embed" in name else 0.1)
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny Llama converted at 4 bpw; records how many decoder layers held weights at each layer's turn."""
    import trellm.convert as conv

    root = tmp_path_factory.mktemp("convert")
    src = make_tiny_llama(root / "dense")
    loaded_layers = []
    quantize_layer = conv._quantize_layer

    def counting(layer, *args, **kwargs):
        model_layers = [m for m in layer_owner[0].layers] if layer_owner else []
        loaded_layers.append(sum(any(lin.impl is not None for lin in conv.layer_linears(m)) for m in model_layers))
        return quantize_layer(layer, *args, **kwargs)

    layer_owner = []
    plan_groups = conv._plan_groups

    def remember_model(model, stream):
        layer_owner.append(model)
        return plan_groups(model, stream)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(conv, "_quantize_layer", counting)
        mp.setattr(conv, "_plan_groups", remember_model)
        summary = convert(src, root / "q4", root / "work", 4.0, **FAST)
    summary["loaded_layers"] = loaded_layers
    return src, root, summary


def test_layers_are_streamed_one_at_a_time(converted):
    _, _, summary = converted
    assert summary["loaded_layers"] == [1, 1]  # 2 layers: only the one being quantized holds weights


def _kl(dense_dir: Path, quant_dir: Path) -> tuple[float, float]:
    dense = trellm.load(dense_dir, device="cpu", dtype=torch.float32, tokenizer=False)
    quant = trellm.load(quant_dir, device="cpu", dtype=torch.float32, tokenizer=False)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    p, q = dense.logits(ids).log_softmax(-1), quant.logits(ids).log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    agree = (p.argmax(-1) == q.argmax(-1)).float().mean().item()
    return kl, agree


def test_convert_tiny_llama_loads_and_matches_dense(converted):
    src, root, summary = converted
    out = root / "q4"
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "quantization_config.json", "tokenizer_config.json"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "exl3" and qc["bits"] == 4.0 and qc["head_bits"] == 6 and qc["codebook"] == "mul1"
    storage = json.loads((out / "quantization_config.json").read_text())["tensor_storage"]
    assert storage["lm_head"]["bits_per_weight"] == 6 and storage["lm_head"]["mul1_multiplier"] == 0x83DCD12D
    assert storage["model.layers.0.self_attn.k_proj"]["stored_tensors"]["model.layers.0.self_attn.k_proj.trellis"]["shape"] == [8, 8, 64]
    store = trellm.weights.WeightStore(out)
    assert "model.embed_tokens.weight" in store and "lm_head.trellis" in store  # tied head written as lm_head.*
    assert "model.layers.0.mlp.down_proj.weight" not in store
    kl, agree = _kl(src, out)
    print(f"\n4 bpw tiny Llama: KL(dense||quant) = {kl:.5f}, top-1 agreement {agree:.3f}, {summary['seconds']}s")
    assert kl < 0.05 and agree > 0.8
    assert all(layer["rfn"] < 0.2 for layer in summary["layers"] if "rfn" in layer)


def test_summary_times_each_phase(converted):
    """Every layer's time split by phase (disjoint: they add up to no more than the layer's seconds), and the
    job's totals, which also hold the setup and the output's compile."""
    summary = converted[2]
    layer, head = summary["layers"][0], summary["layers"][-1]
    steps = {"regularize", "scale_search", "ldl", "viterbi", "refit", "hessian_passes", "target", "io"}
    assert steps | {"dense_pass", "advance"} <= set(layer["phases"])
    assert steps <= set(head["phases"]) and "dense_pass" not in head["phases"]
    for entry in summary["layers"]:
        assert 0 < sum(entry["phases"].values()) <= entry["seconds"] + 0.01
    assert {"setup", "compile"} | set(layer["phases"]) <= set(summary["phases"])


def test_interrupt_and_resume_is_byte_identical(converted):
    src, root, _ = converted
    work = root / "work_resume"
    with pytest.raises(ConversionInterrupted):
        convert(src, root / "q4_resumed", work, 4.0, stop_after_layer=0, **FAST)
    assert json.loads((work / "ckpt" / "job.json").read_text())["next_layer"] == 1
    assert not (root / "q4_resumed").exists()
    with pytest.raises(ConversionError, match="different bits"):
        convert(src, root / "q4_resumed", work, 5.0, resume=True, **FAST)
    convert(src, root / "q4_resumed", work, 4.0, resume=True, **FAST)
    for name in ("model.safetensors", "config.json", "quantization_config.json"):
        assert (root / "q4_resumed" / name).read_bytes() == (root / "q4" / name).read_bytes(), name


def test_resume_redoes_the_layers_after_the_last_checkpoint(converted, tmp_path, monkeypatch):
    """Checkpoints are written about every CHECKPOINT_SECONDS (always after the first layer): a job that
    crashes later resumes from the last one, redoes the layers after it and still writes the same bytes."""
    import trellm.convert as conv

    src, root, _ = converted
    monkeypatch.setattr(conv, "CHECKPOINT_SECONDS", float("inf"))
    quantize_head = conv._quantize_head

    def power_cut(*args, **kwargs):
        raise RuntimeError("power cut")

    monkeypatch.setattr(conv, "_quantize_head", power_cut)
    with pytest.raises(RuntimeError, match="power cut"):
        convert(src, tmp_path / "q", tmp_path / "w", 4.0, **FAST)
    assert json.loads((tmp_path / "w" / "ckpt" / "job.json").read_text())["next_layer"] == 1
    assert (tmp_path / "w" / "qtensors" / "model.layers.1.safetensors").is_file()  # done, but after the checkpoint
    monkeypatch.setattr(conv, "_quantize_head", quantize_head)
    convert(src, tmp_path / "q", tmp_path / "w", 4.0, resume=True, **FAST)
    assert (tmp_path / "q" / "model.safetensors").read_bytes() == (root / "q4" / "model.safetensors").read_bytes()


def test_capture_passes_end_where_nothing_they_record_is_left(converted, tmp_path, monkeypatch):
    """A sequential capture pass stops at the first linear after the groups it records (o_proj's pass at gate/up,
    gate/up's at down_proj; down_proj's runs to the end): layer 0 quantized with the passes cut short and with
    every pass run through the whole layer writes the same bytes."""
    import trellm.convert as conv

    src = converted[0]
    ends = []
    cut_short = conv._PassEnd.forward

    def counted(self, x):
        ends.append(self.out_features)
        return cut_short(self, x)

    written = {}
    for run, forward in (("cut", counted), ("whole", lambda self, x: self.inner.forward(x))):
        monkeypatch.setattr(conv._PassEnd, "forward", forward)
        with pytest.raises(ConversionInterrupted):
            convert(src, tmp_path / run, tmp_path / f"w_{run}", 4.0, stop_after_layer=0, **FAST)
        written[run] = (tmp_path / f"w_{run}" / "qtensors" / "model.layers.0.safetensors").read_bytes()
    assert ends == [128, 128]  # gate_proj's call ends o_proj's pass, down_proj's ends gate/up's
    assert written["cut"] == written["whole"]


def test_sequential_hessians_and_error_target(converted, tmp_path, monkeypatch):
    """Layer 0 quantized twice: plain (one dense pass for every group's Hessian, the dense weights as targets) and
    sequential with the error target. q/k/v see the embedding in both (same Hessian, and their inputs agree with
    the dense model's, so the target is the dense weight itself, up to the float16 rounding of the kept dense
    inputs); o_proj comes after the quantized q/k/v, so its
    Hessian must differ and its target must move off the dense weight."""
    import trellm.convert as conv

    src = converted[0]
    seen: dict[str, list] = {}
    real = conv.quantize_group

    def spy(weights, hessian, bits, *args, **kwargs):
        seen[run].append((weights, hessian))
        return real(weights, hessian, bits, *args, **kwargs)

    monkeypatch.setattr(conv, "quantize_group", spy)
    dense = load_file(str(src / "model.safetensors"))
    for run, kw in (("plain", dict(sequential=False, error_target=0.0)), ("new", dict(sequential=True, error_target=1.0))):
        seen[run] = []
        with pytest.raises(ConversionInterrupted):
            convert(src, tmp_path / run, tmp_path / f"w_{run}", 3.0, stop_after_layer=0, scale_search=False,
                    **dict(FAST, **kw))
    (qkv_plain, h_qkv_plain), (o_plain, h_o_plain) = seen["plain"][:2]
    (qkv_new, h_qkv_new), (o_new, h_o_new) = seen["new"][:2]
    o_dense = dense["model.layers.0.self_attn.o_proj.weight"].float()
    assert torch.equal(o_plain[0], o_dense) and torch.equal(h_qkv_plain, h_qkv_new)
    q_dense = dense["model.layers.0.self_attn.q_proj.weight"].float()
    q_moved = ((qkv_new[0] - q_dense).norm() / q_dense.norm()).item()
    print(f"\nq_proj target off the dense weight by {q_moved:.2e} (float16 rounding of the kept dense inputs)")
    assert q_moved < 2e-3  # the same inputs up to the kept rows' float16 rounding: the dense weight, nearly
    assert (h_o_new - h_o_plain).norm() > 1e-3 * h_o_plain.norm()  # sequential: o_proj sees the quantized q/k/v
    assert (o_new[0] - o_dense).norm() > 1e-2 * o_dense.norm()  # error target: o_proj compensates their error


def test_kept_dense_inputs_are_float16_when_they_fit():
    from trellm.convert import _compact_rows

    rows = torch.randn(64, 32) * 100
    kept = _compact_rows(rows)
    assert kept.dtype == torch.float16 and kept.device.type == "cpu"
    torch.testing.assert_close(kept.float(), rows, rtol=1e-3, atol=0)
    rows[3, 4], rows[5, 6] = 1e6, float("inf")  # beyond float16: kept exact in float32 (the inf is skipped later)
    assert _compact_rows(rows).dtype == torch.float32


def test_gated_sensitivity_is_the_slope_of_the_gated_product(converted):
    """Per intermediate channel: E[silu(g)^2] |down[:, j]|^2 for up, E[(silu'(g) u)^2] |down[:, j]|^2 for gate."""
    from trellm.convert import GatedSensitivity

    model = trellm.load(converted[0], device="cpu", dtype=torch.float32, tokenizer=False).model
    mlp = model.layers[0].mlp
    x = torch.randn(3000, 128, generator=torch.Generator().manual_seed(2))
    sens = GatedSensitivity(mlp)
    with torch.inference_mode():
        sens.add(x[:1000])
        sens.add(x[1000:])  # accumulates over calls (and inside, over CHUNK_ROWS chunks)
        got = sens.result()
    wg, wu = mlp.gate_proj.impl.dense_weight(), mlp.up_proj.impl.dense_weight()
    g, u = x @ wg.t(), x @ wu.t()
    sg = torch.sigmoid(g)
    down = mlp.down_proj.impl.dense_weight().pow(2).sum(0)
    torch.testing.assert_close(got[mlp.up_proj.key], (g * sg).pow(2).mean(0) * down, rtol=1e-4, atol=0)
    torch.testing.assert_close(got[mlp.gate_proj.key], (sg * (1 + g * (1 - sg)) * u).pow(2).mean(0) * down, rtol=1e-4, atol=0)


def test_auto_out_scales_conversion(converted, tmp_path, monkeypatch):
    """out_scales="auto" with the margin at 0 (every gate and up drops its scales; the tiny Llama's own
    sensitivities keep them): the summary names exactly those, quantization_config records the mode, the
    model loads and stays close to the dense one, and a resume may not change the mode."""
    import trellm.quant.exl3.quantize as quant

    src = converted[0]
    monkeypatch.setattr(quant, "OUT_SCALES_MAX_RATIO", 0.0)
    summary = convert(src, tmp_path / "q", tmp_path / "w", 4.0, out_scales="auto", scale_search=False, **FAST)
    dropped = sorted(k for layer in summary["layers"] for k, c in layer.get("out_scales", {}).items() if c == "never")
    assert dropped == [f"model.layers.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up")]
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["out_scales"] == "auto"
    kl, agree = _kl(src, tmp_path / "q")
    assert kl < 0.05 and agree > 0.8
    with pytest.raises(ConversionError, match="different out_scales"):
        convert(src, tmp_path / "q2", tmp_path / "w", 4.0, resume=True, out_scales="fit", scale_search=False, **FAST)
    with pytest.raises(ConversionError, match="out_scales must be one of always, never, auto, fit, got 'often'"):
        convert(src, tmp_path / "q3", tmp_path / "w3", 4.0, out_scales="often", **FAST)


def test_fractional_bits_mix_and_cli(converted, capsys):
    src, root, _ = converted
    from trellm.cli import main

    rc = main(["convert", "-i", str(src), "-o", str(root / "q45"), "-w", str(root / "w45"), "-b", "4.5", "-hb", "16",
               "-d", "cpu", "--cal-rows", "4", "--cal-cols", "32", "--no-scale-search", "-q"])
    assert rc == 0
    out = root / "q45"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 4.5
    store = trellm.weights.WeightStore(out)
    ks = {store.info(n).shape[-1] // 16 for n in store if n.endswith(".trellis")}
    assert ks == {4, 5}
    assert "lm_head.weight" in store and "lm_head.trellis" not in store  # head_bits 16: unquantized
    quant = trellm.load(out, device="cpu", tokenizer=False)
    assert torch.isfinite(quant.logits([[1, 2, 3]])).all()


def test_allocate_bits_hits_fractional_target():
    groups = [PlanGroup(layer=i // 2, keys=[str(i)], numel=1000 * (1 + i % 2), priority=2 - i % 2, bits=0) for i in range(8)]
    avg = allocate_bits(groups, 3.5, 4)
    assert 3.4 <= avg <= 3.5 and {g.bits for g in groups} == {3, 4}
    assert allocate_bits(groups, 8.0, 4) == 8.0


def test_errors_name_the_problem(converted, tmp_path, monkeypatch):
    src, root, _ = converted
    with pytest.raises(ConversionError, match="not empty"):
        convert(src, root / "q4", tmp_path / "w", 4.0, **FAST)
    with pytest.raises(ConversionError, match="bits must be between 1 and 8"):
        convert(src, tmp_path / "o", tmp_path / "w", 9.0, **FAST)
    with pytest.raises(ConversionError, match="head_bits"):
        convert(src, tmp_path / "o", tmp_path / "w", 4.0, **dict(FAST, head_bits=10))
    with pytest.raises(ConversionError, match="error_target must be a number between 0 and 1, got 1.5"):
        convert(src, tmp_path / "o", tmp_path / "w", 4.0, **dict(FAST, error_target=1.5))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(UnknownArchitectureError, match="NoSuchModelForCausalLM"):
        convert(bad, tmp_path / "o", tmp_path / "w", 4.0, **FAST)

    import shutil

    import trellm.convert as conv

    monkeypatch.setattr(conv.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 1000))
    with pytest.raises(ConversionError, match="not enough disk space"):
        convert(src, tmp_path / "o", tmp_path / "w", 4.0, **FAST)
    monkeypatch.undo()

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)  # the first write of the job (args.json)
    with pytest.raises(ConversionError, match="disk full"):
        convert(src, tmp_path / "o", tmp_path / "w", 4.0, **FAST)


@pytest.fixture(scope="module")
def head128_exl3_llama(tmp_path_factory):
    """A 2-layer Llama with 128-wide heads, converted to 4 bpw once for this module: the shapes the fused
    decode routes of the CUDA GEMV take (one 128-column group is one head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("head128")
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(root / "dense")
    convert(root / "dense", root / "q4", root / "work", 4.0, **FAST)
    return trellm.load(root / "q4", device="cpu", dtype=torch.float32, tokenizer=False)


def test_exl3_qkv_route_matches_separate_ops(head128_exl3_llama, monkeypatch):
    # 128-wide heads, a plain paged cache: attention projects q/k/v with a RopeKV post step (on CUDA one GEMV
    # launch with the per-head norm, RoPE and the KV-page write; exl3_qkv_rope_write_kv). On CPU it is the
    # references composed, so the tokens of a cached decode equal the separate ops' bit for bit, and the
    # route must actually be taken.
    from trellm.modules.layers import Attention

    model = head128_exl3_llama
    fused_calls = []
    route = Attention._rope_kv

    def counted(self, batch):
        post = route(self, batch)
        fused_calls.append(post is not None)
        return post

    monkeypatch.setattr(Attention, "_rope_kv", counted)
    prompt = [5, 17, 99, 3, 42]
    fused = list(model.generate_ids(prompt, max_new_tokens=6, stop_token_ids=[]))
    assert any(fused_calls), "the fused q/k/v route was not taken"
    monkeypatch.setattr(Attention, "_rope_kv", lambda self, batch: None)
    separate = list(model.generate_ids(prompt, max_new_tokens=6, stop_token_ids=[]))
    assert fused == separate


def test_exl3_summed_route_matches_add_rms_norm(head128_exl3_llama, monkeypatch):
    # Pre-norm blocks hand their sub-layers the input norm unapplied (Normed: on CUDA the EXL3 q/k/v and gate/up
    # launches norm x from the sums of squares) and the residual (o_proj and down add it in their finishing step,
    # exl3_matmul_add / exl3_matmul_gated_add). On CPU those are the references composed, so a cached decode
    # gives the tokens of blocks that add and norm on their own, and the route must be taken.
    from trellm.modules import decoder, layers
    from trellm.ops.projection import GatedAct, Normed, Residual

    model = head128_exl3_llama
    calls = {"normed": 0, "residual": 0, "gated_residual": 0}
    real = layers.project

    def counted(x, weights, pre=None, post=None):
        calls["normed"] += isinstance(x, Normed)
        calls["residual"] += isinstance(post, Residual)
        calls["gated_residual"] += isinstance(post, Residual) and isinstance(pre, GatedAct)
        return real(x, weights, pre, post)

    monkeypatch.setattr(layers, "project", counted)
    prompt = [7, 1, 200, 33]
    summed = list(model.generate_ids(prompt, max_new_tokens=6, stop_token_ids=[]))
    steps = calls["gated_residual"] // 2  # forward passes: two blocks each
    assert steps >= 6 and calls["residual"] == 2 * calls["gated_residual"], calls
    # on CPU a projection's residual add is left to the next norm (add_rms_norm, a tensor): only the first block's
    # input, the embeddings, reaches the projections unnormed (on CUDA every block's does: test_projection_routes)
    assert calls["normed"] == steps, calls

    class NoSublayer:  # the blocks see no sub-layer that takes part in the residual stream
        pass

    monkeypatch.setattr(decoder, "Sublayer", NoSublayer)
    for name in calls:
        calls[name] = 0
    separate = list(model.generate_ids(prompt, max_new_tokens=6, stop_token_ids=[]))
    assert calls["residual"] == calls["normed"] == 0, calls
    assert summed == separate


def test_calibration_rows_hold_a_short_source_once(smollm2_dir):
    """A source shorter than a row (at 8,192-token rows, most written sources of the mix: its technical text is
    about 3,300 SmolLM2 tokens) gives rows holding it once: wrapped round into itself inside a row, it put the
    model in copy mode. Longer rows keep their width."""
    from trellm.convert import calibration_rows
    from trellm.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(smollm2_dir)
    rows = calibration_rows(tokenizer, 49152, 16, 8192)
    assert len(rows) == 16
    assert {len(r) for r in rows} > {8192} and max(len(r) for r in rows) == 8192
    for row in rows:
        windows = [tuple(row[i : i + 128]) for i in range(len(row) - 127)]
        assert len(set(windows)) == len(windows)  # no 128-token stretch twice in one row
