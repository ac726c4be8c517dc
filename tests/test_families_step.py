"""Parity of HyperCLOVA X with images, Step 3.5 / 3.7 Flash and DeciLM (Nemotron-Super) against their references (issue 30).

HyperCLOVA X vision is held against transformers with and without images (the Qwen2.5-VL tower of
tests/test_vision_qwen.py: 4-pixel patches merged 2x2, 16-pixel windows, layer 1 over the whole image).
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

import trellm  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from trellm.multimodal import ImageError, prepare_prompt  # noqa: E402
from trellm.sdk.testing import check_parity, torch_threads  # noqa: E402

from test_vision import batched_greedy  # noqa: E402
from test_vision_qwen import IMAGE, hf_greedy, hf_image_features, hf_inputs, hf_logits, random_image  # noqa: E402

HCX_PROMPT = [5, 6, IMAGE, 7, 8, 9]


def _hcx_hf_model(seed: int = 0):
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                logits_scaling=0.5, embedding_multiplier=2.0, residual_multiplier=0.7, attention_multiplier=0.3)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=48, window_size=16, fullatt_block_indexes=[1])
    config = transformers.HyperCLOVAXVisionV2Config(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                                    video_token_id=311)
    torch.manual_seed(seed)
    hf = transformers.HyperCLOVAXVisionV2ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms start at one: give them values
        for name, p in hf.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1, 0.3)
    return hf


@pytest.fixture(scope="module")
def hcx(tmp_path_factory):
    """(HF model, HF image processor, checkpoint dir, trellm model) of a tiny random HyperCLOVA X with images."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = _hcx_hf_model()
    path = tmp_path_factory.mktemp("hcx_vision")
    hf.save_pretrained(path)
    proc = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})
    proc.save_pretrained(path)
    with torch_threads(1):
        yield hf, proc, path, trellm.load(path, device="cpu", dtype="float32")


def test_hcx_vision_text_parity(hcx):
    report = check_parity(hcx[2])
    print(report)
    report.assert_ok()


def test_hcx_vision_image_features_logits_and_greedy(hcx):
    hf, proc, _, lm = hcx
    for img in (random_image(0), random_image(1, size=(20, 90))):
        pixels, grid = hf_inputs(proc, img)
        mm = prepare_prompt(lm, HCX_PROMPT, [img])
        ref = hf_image_features(hf, pixels, grid) * hf.config.text_config.embedding_multiplier  # HF scales after placing them
        assert mm.embeds.shape == ref.shape and (mm.embeds - ref).abs().max() < 1e-5
        mine, theirs = lm.logits([HCX_PROMPT], images=[[img]])[0], hf_logits(hf, mm.input_ids, pixels, grid)
        assert (mine - theirs).abs().max() < 1e-3 * float(theirs.max() - theirs.min())
    ref = hf_greedy(hf, mm.input_ids, pixels, grid, 32)
    assert list(lm.generate_ids(HCX_PROMPT, max_new_tokens=32, stop_token_ids=[], images=[img])) == ref


def test_hcx_vision_two_images_in_one_batch(hcx):
    hf, proc, _, lm = hcx
    images = [random_image(2), random_image(3, size=(37, 61))]
    prompts = [prepare_prompt(lm, HCX_PROMPT, [img]) for img in images]
    refs = [hf_greedy(hf, p.input_ids, *hf_inputs(proc, img), 6) for p, img in zip(prompts, images)]
    assert refs[0] != refs[1]
    assert batched_greedy(lm, prompts, 6, page_size=8) == refs


def test_hcx_vision_loads_navers_tensor_names(hcx, tmp_path):
    """NAVER's upload nests the text model (``model.language_model.model.*``, its own head) and names the projector ``mm_projector``."""
    hf, _, path, lm = hcx
    tensors = load_file(path / "model.safetensors")
    renamed = {}
    for name, t in tensors.items():
        if name.startswith("model.language_model."):
            name = "model.language_model.model." + name[len("model.language_model."):]
        renamed[name.replace("model.vision_projector.", "model.mm_projector.")] = t
    renamed["model.language_model.lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"].clone()
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["HCXVisionV2ForCausalLM"], model_type="vlm", tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("preprocessor_config.json",):
        (tmp_path / name).write_text((path / name).read_text())
    img = random_image(4)
    with torch_threads(1):
        hub = trellm.load(tmp_path, device="cpu", dtype="float32")
        assert hub.spec.name == "hyperclovax_vision"
        assert torch.equal(hub.logits([HCX_PROMPT], images=[[img]])[0], lm.logits([HCX_PROMPT], images=[[img]])[0])


# ---- Step 3.5 / 3.7 Flash ------------------------------------------------------------------------------

STEP_LAYER_TYPES = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
STEP_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                 pad_token_id=0, moe_intermediate_size=32, share_expert_dim=48, n_routed_experts=8, num_experts_per_tok=2,
                 layer_types=STEP_LAYER_TYPES, sliding_window=8, num_sliding_attention_heads=8,
                 mlp_layer_types=["dense", "sparse", "sparse", "sparse"], rope_theta=[10000.0, 500.0, 10000.0, 500.0],
                 partial_rotary_factors=[0.5, 1.0, 0.5, 1.0], swiglu_limits=[0, 0, 0.3, 0.05],
                 swiglu_limits_shared=[0.1, 0, 0.3, 0.05], moe_router_scaling_factor=2.5)


def _step_hf_model():
    """A tiny random Step 3.7 (its text model is Step 3.5's): clamps small enough to bite, norms and router bias random."""
    config = transformers.Step3p7Config(text_config=dict(STEP_TEXT), image_token_id=250,
                                        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                           image_size=28, patch_size=4))
    torch.manual_seed(0)
    hf = transformers.Step3p7ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and "norm" in name:
                p.normal_(0, 0.3)  # stored as w - 1
            elif "language_model" in name and p.dim() >= 2:
                p.normal_(0, 0.15)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    return hf


@pytest.fixture(scope="module")
def step3p7_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("step3p7")
    _step_hf_model().save_pretrained(path)
    return path


def _stepfun_config() -> dict:
    """STEP_TEXT as StepFun's Step3p5ForCausalLM config.json writes it: its own key names, per-layer lists
    padded with one MTP layer, the sliding layers' heads in ``attention_other_setting``."""
    pad = lambda values, extra: list(values) + [extra]  # noqa: E731
    return dict(
        architectures=["Step3p5ForCausalLM"], model_type="step3p5", vocab_size=256, hidden_size=64, intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_attention_groups=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_nextn_predict_layers=1, sliding_window=8,
        layer_types=pad(STEP_LAYER_TYPES, "full_attention"),
        attention_other_setting={"num_attention_heads": 8, "num_attention_groups": 2, "head_dim": 16},
        rope_theta=pad(STEP_TEXT["rope_theta"], 10000.0), partial_rotary_factors=pad(STEP_TEXT["partial_rotary_factors"], 0.5),
        moe_num_experts=8, moe_top_k=2, moe_intermediate_size=32, share_expert_dim=48, moe_router_scaling_factor=2.5,
        moe_layers_enum="1,2,3,4", swiglu_limits=pad(STEP_TEXT["swiglu_limits"], 0), norm_expert_weight=True,
        swiglu_limits_shared=pad(STEP_TEXT["swiglu_limits_shared"], 0), use_moe_router_bias=True, hidden_act="swigluoai",
    )


def test_step3p5_stepfun_config_against_transformers(step3p7_dir, tmp_path):
    """Step3p5ForCausalLM (StepFun's text checkpoint, which transformers runs only inside Step 3.7): the text
    tensors of the Step 3.7 checkpoint under StepFun's config, held against transformers running the Step 3.7 one."""
    text = {k: t for k, t in load_file(step3p7_dir / "model.safetensors").items() if k.startswith(("model.", "lm_head"))}
    save_file(text, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(_stepfun_config()))
    report = check_parity(tmp_path, reference_dir=step3p7_dir)
    print(report)
    report.assert_ok()


def test_step3p5_sliding_head_size_of_its_own_is_refused(tmp_path):
    from trellm.errors import ConfigError

    config = _stepfun_config()
    config["attention_other_setting"]["head_dim"] = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="attention_other_setting.head_dim 32 differs from head_dim 16"):
        trellm.load(tmp_path, device="cpu", dtype="float32")


def test_step3p7_text_parity(step3p7_dir):
    """Step 3.7 Flash on text prompts (the checkpoint save_pretrained writes: StepFun's tensor names, a nested text config)."""
    report = check_parity(step3p7_dir)
    print(report)
    report.assert_ok()


def test_step3p7_refuses_images_clearly(step3p7_dir):
    lm = trellm.load(step3p7_dir, device="cpu", dtype="float32")
    with pytest.raises(ImageError, match="takes no image input"):
        prepare_prompt(lm, [5, 250, 6], [random_image(0)])


# ---- DeciLM / Nemotron-Super ----------------------------------------------------------------------------------

DECI_BLOCKS = [  # every kind of block NVIDIA's published format has, and MLP widths of 256 and 512
    {"attention": {"n_heads_in_group": 1}, "ffn": {"ffn_mult": 2.0}},
    {"attention": {"no_op": True}, "ffn": {"ffn_mult": 7.0}},
    {"attention": {"n_heads_in_group": 4}, "ffn": {"replace_with_linear": True}},
    {"attention": {"replace_with_linear": True}, "ffn": {"no_op": True}},
    {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.3}},
    {"attention": {"no_op": True}, "ffn": {"no_op": True}},
]
DECI_CONFIG = dict(architectures=["DeciLMForCausalLM"], model_type="nemotron-nas", vocab_size=256, hidden_size=64,
                   num_attention_heads=4, num_hidden_layers=len(DECI_BLOCKS), max_position_embeddings=512,
                   rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
                   bos_token_id=1, eos_token_id=2, block_configs=DECI_BLOCKS)


class DeciReference:
    """DeciLM written from NVIDIA's description (not trellm's modules): per block, an optional pre-norm
    attention (GQA with ``heads / n_heads_in_group`` KV heads and NeoX RoPE, or one linear map), then an
    optional pre-norm SwiGLU MLP ``2 * ffn_mult * hidden / 3`` wide rounded up to 256 (or one linear map)."""

    def __init__(self, cfg: dict):
        self.cfg, h, self.heads = cfg, cfg["hidden_size"], cfg["num_attention_heads"]
        self.head_dim = h // self.heads
        lin = lambda i, o: torch.randn(o, i) * 0.2  # noqa: E731
        norm = lambda: 1 + 0.3 * torch.randn(h)  # noqa: E731
        self.params = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h), "model.norm.weight": norm(),
                       "lm_head.weight": lin(h, cfg["vocab_size"])}
        for i, block in enumerate(cfg["block_configs"]):
            a, f, p = block["attention"], block["ffn"], f"model.layers.{i}"
            if not a.get("no_op"):
                self.params[f"{p}.input_layernorm.weight"] = norm()
                if a.get("replace_with_linear"):
                    self.params[f"{p}.self_attn.linear_attn.weight"] = lin(h, h)
                else:
                    kv = self.heads // a["n_heads_in_group"] * self.head_dim
                    for name, i_, o in (("q", h, h), ("k", h, kv), ("v", h, kv), ("o", h, h)):
                        self.params[f"{p}.self_attn.{name}_proj.weight"] = lin(i_, o)
            if not f.get("no_op"):
                self.params[f"{p}.post_attention_layernorm.weight"] = norm()
                if f.get("replace_with_linear"):
                    self.params[f"{p}.mlp.linear_mlp.weight"] = lin(h, h)
                else:
                    width = -(-int(2 * f["ffn_mult"] * h / 3) // 256) * 256
                    for name, i_, o in (("gate", h, width), ("up", h, width), ("down", width, h)):
                        self.params[f"{p}.mlp.{name}_proj.weight"] = lin(i_, o)

    def rms(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) * self.params[name]

    def attention(self, x, p, group):
        t, d = x.shape[0], self.head_dim
        q = (x @ self.params[f"{p}.q_proj.weight"].T).view(t, -1, d).transpose(0, 1)
        k = (x @ self.params[f"{p}.k_proj.weight"].T).view(t, -1, d).transpose(0, 1)
        v = (x @ self.params[f"{p}.v_proj.weight"].T).view(t, -1, d).transpose(0, 1)
        inv = 1.0 / self.cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
        ang = torch.arange(t).float()[:, None] * inv
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        rot = lambda z: z * cos + torch.cat([-z[..., d // 2:], z[..., : d // 2]], -1) * sin  # noqa: E731
        k, v = rot(k).repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        o = torch.nn.functional.scaled_dot_product_attention(rot(q), k, v, is_causal=True)
        return o.transpose(0, 1).reshape(t, -1) @ self.params[f"{p}.o_proj.weight"].T

    def __call__(self, ids: list[int]) -> torch.Tensor:
        x = self.params["model.embed_tokens.weight"][torch.tensor(ids)]
        for i, block in enumerate(self.cfg["block_configs"]):
            a, f, p = block["attention"], block["ffn"], f"model.layers.{i}"
            if not a.get("no_op"):
                y = self.rms(x, f"{p}.input_layernorm.weight")
                x = x + (y @ self.params[f"{p}.self_attn.linear_attn.weight"].T if a.get("replace_with_linear")
                         else self.attention(y, f"{p}.self_attn", a["n_heads_in_group"]))
            if not f.get("no_op"):
                y = self.rms(x, f"{p}.post_attention_layernorm.weight")
                if f.get("replace_with_linear"):
                    x = x + y @ self.params[f"{p}.mlp.linear_mlp.weight"].T
                else:
                    g = torch.nn.functional.silu(y @ self.params[f"{p}.mlp.gate_proj.weight"].T)
                    x = x + (g * (y @ self.params[f"{p}.mlp.up_proj.weight"].T)) @ self.params[f"{p}.mlp.down_proj.weight"].T
        return self.rms(x, "model.norm.weight") @ self.params["lm_head.weight"].T


@pytest.fixture(scope="module")
def decilm(tmp_path_factory):
    """(reference, checkpoint dir, trellm model) of a tiny random DeciLM in NVIDIA's checkpoint format."""
    torch.manual_seed(0)
    ref = DeciReference(DECI_CONFIG)
    path = tmp_path_factory.mktemp("decilm")
    save_file({k: v.contiguous() for k, v in ref.params.items()}, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(DECI_CONFIG))
    with torch_threads(1):
        yield ref, path, trellm.load(path, device="cpu", dtype="float32")


def test_decilm_logits_cached_decode_and_greedy(decilm):
    from trellm.sdk.testing import trellm_cached_logits

    ref, _, lm = decilm
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (23, 9)]
    with torch.no_grad():
        refs = [ref(p) for p in prompts]
    allowed = 1e-3 * max(float(r.max() - r.min()) for r in refs)
    for r, mine, cached in zip(refs, lm.logits(prompts), trellm_cached_logits(lm, prompts)):
        assert (r - mine[: len(r)]).abs().max() < allowed and (r - cached).abs().max() < allowed
    for p in prompts:
        ids = list(p)
        with torch.no_grad():
            for _ in range(32):
                ids.append(int(ref(ids)[-1].argmax()))
        assert list(lm.generate_ids(p, max_new_tokens=32, stop_token_ids=[])) == ids[len(p):]
    kv_layers = [a is not None for a in lm.model.attention_layers()]
    assert kv_layers == [True, False, True, False, True, False]  # no-op and linear blocks hold no KV cache


@pytest.mark.parametrize("block, message", [
    ({"attention": {"n_heads_in_group": 3}, "ffn": {"ffn_mult": 1.0}}, r"block_configs\[1\].attention.n_heads_in_group = 3"),
    ({"attention": {"no_op": True}, "ffn": {}}, r"block_configs\[1\].ffn.ffn_mult is not set"),
    ({"attention": {"n_heads_in_group": 1, "num_sink_tokens": 4}, "ffn": {"no_op": True}},
     r"block_configs\[1\].attention.num_sink_tokens = 4 is not supported"),
])
def test_decilm_bad_block_configs_are_named(decilm, tmp_path, block, message):
    from trellm.errors import ConfigError

    _, path, _ = decilm
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    blocks = [DECI_BLOCKS[0], block] + DECI_BLOCKS[2:]
    (tmp_path / "config.json").write_text(json.dumps({**DECI_CONFIG, "block_configs": blocks}))
    with pytest.raises(ConfigError, match=message):
        trellm.load(tmp_path, device="cpu", dtype="float32")
