"""Laguna and Gemma 4 against HF transformers on tiny random weights (issue 30).

Laguna's layers here differ in query-head count and attention kind (a sliding layer with full RoPE, a full
layer rotating half of each head), its router softcaps its logits, and the correction bias is overwritten
with random values in the saved checkpoint so the biased choice is exercised.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from trellm.sdk.testing import TINY_DEFAULTS, check_parity, make_tiny_hf_model  # noqa: E402
from test_moe_families import randomize  # noqa: E402  (tests/ is on sys.path)

LAGUNA = dict(
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_attention_heads_per_layer=[4, 8, 2],
    layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=8,
    mlp_layer_types=["dense", "sparse", "sparse"], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, moe_routed_scaling_factor=2.5, moe_router_logit_softcapping=2.0,
)


@pytest.mark.parametrize("gating", ["per-head", "per-element"])
def test_laguna_parity(tmp_path, gating):
    model_dir = make_tiny_hf_model("LagunaForCausalLM", tmp_path, gating=gating, **LAGUNA)
    randomize(model_dir, "e_score_correction_bias")
    report = check_parity(model_dir)
    print(report)
    report.assert_ok()


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads_per_layer": [4, 8]}, "per-layer head counts list 2 entries for 3 layers"),
    ({"num_attention_heads_per_layer": [4, 3, 2]}, "[3] are not positive multiples of num_key_value_heads (2)"),
    ({"gating": "per-channel"}, "gating='per-channel'"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types must list 'dense' or 'sparse'"),
])
def test_laguna_config_errors_name_the_key(change, message):
    assert message in build_error({**TINY_DEFAULTS, **LAGUNA, "architectures": ["LagunaForCausalLM"], **change})


def build_error(raw: dict) -> str:
    """The ConfigError that building the model of config ``raw`` raises."""
    from trellm.registry import find_architecture
    from trellm.sdk import ConfigError

    spec = find_architecture(raw["architectures"][0])
    with pytest.raises(ConfigError) as err:
        spec.build(spec.read_config(raw))
    return str(err.value)


# ---- Gemma 4 text ----------------------------------------------------------------------------------------

GEMMA4_LAYERS = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
                     head_dim=16, global_head_dim=32)
GEMMA4 = {
    # E2B/E4B-shaped: per-layer inputs, KV-sharing layers (one of each kind) with double-wide MLPs
    "per_layer_inputs_kv_sharing": dict(GEMMA4_LAYERS, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
                                        num_kv_shared_layers=2, use_double_wide_mlp=True),
    # 26B-A4B-shaped: experts beside every dense MLP, K=V global layers with their own KV heads, a logit softcap
    "moe_k_eq_v": dict(GEMMA4_LAYERS, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24,
                       attention_k_eq_v=True, num_global_key_value_heads=1, final_logit_softcapping=30.0,
                       hidden_size_per_layer_input=0),  # per-layer inputs are the other config's: HF's default table is 1 GB
}


@pytest.mark.parametrize("name", list(GEMMA4))
def test_gemma4_text_parity(tmp_path, name):
    model_dir = make_tiny_hf_model("Gemma4ForCausalLM", tmp_path, **GEMMA4[name])
    randomize(model_dir, "layer_scalar", scale=1.0)  # a buffer, 1 in a fresh model
    report = check_parity(model_dir)
    print(report)
    report.assert_ok()


@pytest.mark.parametrize("change, message", [
    ({"num_kv_shared_layers": 4}, "num_kv_shared_layers=4 leaves no layer that makes keys and values"),
    ({"num_kv_shared_layers": 3, "layer_types": ["sliding_attention"] + ["full_attention"] * 3},
     "layer 1 (full_attention) shares keys and values, but no earlier layer of that kind makes them"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all' is an encoder"),
    ({"enable_moe_block": True}, "enable_moe_block needs num_experts"),
])
def test_gemma4_config_errors_name_the_key(change, message):
    assert message in build_error({**TINY_DEFAULTS, **GEMMA4_LAYERS, "architectures": ["Gemma4ForCausalLM"], **change})


# ---- Gemma 4 with images -----------------------------------------------------------------------------------

IMAGE, BOI, EOI = 310, 308, 309
VL_PROMPTS = ([5, 6, IMAGE, 7, 8, 9], [11, IMAGE, 12])


@pytest.fixture(scope="module", params=["causal", "bidirectional", "unified"])
def gemma4_vl(request, tmp_path_factory):
    """(HF model, HF image processor, trellm model) of a tiny random Gemma 4 with vision: per-layer inputs, a
    KV-sharing layer of each kind, 4-pixel patches pooled 2x2; "bidirectional": image rows see their whole image
    on sliding layers. "unified": Gemma 4 Unified (no tower; bidirectional image rows; no per-layer inputs), whose
    8-pixel merged patches transformers makes with torchvision (not installed): the PIL processor cutting 8-pixel
    patches makes the same ones."""
    import transformers
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    import trellm
    from trellm.sdk.testing import torch_threads

    unified = request.param == "unified"
    text = dict(TINY_DEFAULTS, **GEMMA4_LAYERS, vocab_size=320, num_kv_shared_layers=2,
                use_bidirectional_attention=None if request.param == "causal" else "vision")
    if unified:
        vision = dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=48, mm_posemb_size=64, output_proj_dims=48)
        config_cls, model_cls = transformers.Gemma4UnifiedConfig, transformers.Gemma4UnifiedForConditionalGeneration
    else:
        text.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=320)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=64, standardize=True)
        config_cls, model_cls = transformers.Gemma4Config, transformers.Gemma4ForConditionalGeneration
    config = config_cls(text_config=text, vision_config=vision, audio_config=None, image_token_id=IMAGE,
                        boi_token_id=BOI, eoi_token_id=EOI, video_token_id=311, audio_token_id=312)
    config.architectures = [model_cls.__name__]
    torch.manual_seed(0)
    hf = model_cls(config).eval()
    with torch.no_grad():  # norms start at one, layer scalars and standardisation at constants: give them values
        for name, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            if ("norm" in name or "scalar" in name or "std_" in name or "pos" in name or "_ln" in name) and p.is_floating_point():
                p.normal_(1, 0.3)
    path = tmp_path_factory.mktemp(f"gemma4_vl_{request.param}")
    hf.save_pretrained(path)
    proc = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    proc.save_pretrained(path)
    if unified:
        proc = Gemma4ImageProcessorPil(patch_size=8, pooling_kernel_size=1, max_soft_tokens=70)
    with torch_threads(1):
        yield hf, proc, trellm.load(path, device="cpu", dtype="float32")


def hf_vl_logits(hf, ids, inputs):
    x = torch.tensor([ids])
    with torch.no_grad():
        return hf(input_ids=x, pixel_values=inputs["pixel_values"], image_position_ids=inputs["image_position_ids"],
                  mm_token_type_ids=(x == IMAGE).int()).logits[0]


def test_gemma4_vl_images(gemma4_vl):
    from test_vision import batched_greedy
    from test_vision_qwen import random_image
    from trellm.multimodal import prepare_prompt
    from trellm.sdk.testing import torch_threads

    hf, proc, lm = gemma4_vl
    images = [random_image(0), random_image(1, size=(20, 90))]
    if hf.config.model_type == "gemma4_unified":  # sizes the processor keeps: no resampling to differ from torchvision's
        images = [random_image(0, size=(64, 64)), random_image(1, size=(128, 32))]
    prompts = [prepare_prompt(lm, p, [img]) for p, img in zip(VL_PROMPTS, images)]
    with torch_threads(1):
        for text, img, mm in zip(VL_PROMPTS, images, prompts):
            inputs = proc(img, return_tensors="pt")
            with torch.no_grad():
                ref = hf.model.get_image_features(inputs["pixel_values"], inputs["image_position_ids"]).pooler_output[0]
            assert mm.embeds.shape == ref.shape and (mm.embeds - ref).abs().max() < 1e-4
            want = hf_vl_logits(hf, mm.input_ids, inputs)
            got = lm.logits([text], images=[[img]])[0]
            assert (got - want).abs().max() < 1e-3 * float(want.max() - want.min())
        refs = []
        for img, mm in zip(images, prompts):
            inputs, ids = proc(img, return_tensors="pt"), list(mm.input_ids)
            for _ in range(32):
                ids.append(int(hf_vl_logits(hf, ids, inputs)[-1].argmax()))
            refs.append(ids[len(mm.input_ids):])
        assert refs[0] != refs[1]
        assert batched_greedy(lm, prompts, 32, page_size=8) == refs  # both prompts in one batch, through the paged cache


# ---- on the GPU ------------------------------------------------------------------------------------------


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("architecture, config", [
    ("LagunaForCausalLM", dict(LAGUNA, gating="per-head")),
    ("Gemma4ForCausalLM", GEMMA4["per_layer_inputs_kv_sharing"]),
    ("Gemma4ForCausalLM", GEMMA4["moe_k_eq_v"]),
])
def test_text_families_on_cuda(tmp_path, architecture, config):
    """float32 on the GPU (kernels, CUDA-graph decode) gives the CPU's logits and greedy tokens."""
    import trellm

    model_dir = make_tiny_hf_model(architecture, tmp_path, **config)
    cpu, gpu = (trellm.load(model_dir, device=d, dtype=torch.float32) for d in ("cpu", "cuda"))
    prompt = list(range(3, 40))
    assert (gpu.logits([prompt])[0].cpu() - cpu.logits([prompt])[0]).abs().max() < 1e-3
    want = list(cpu.generate_ids(prompt, 16, stop_token_ids=[]))
    assert list(gpu.generate_ids(prompt, 16, stop_token_ids=[])) == want


@pytest.mark.cuda
@cuda
def test_gemma4_vl_on_cuda(gemma4_vl):
    from test_vision import check_on_cuda
    from test_vision_qwen import random_image

    _, _, lm = gemma4_vl
    check_on_cuda(lm, VL_PROMPTS[0], [random_image(0, size=(64, 64))])
