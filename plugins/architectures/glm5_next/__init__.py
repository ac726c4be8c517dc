"""GLM 5.3-Flash (Glm5NextForConditionalGeneration): Kimi delta attention (KDA) layers mixed with NoPE latent
attention (MLA) whose keys a pooled DSA indexer picks, manifold-constrained hyper-connections around every
sub-layer, and SwiGLU MLPs with clamped inputs (dense, and DeepSeek-style grouped sigmoid MoE).

- ``layer_types``: ``linear_attention`` (:class:`~trellm.sdk.KimiDeltaAttention`, state in a recurrent slot)
  or ``indexed_attention``: :class:`~trellm.sdk.SparseLatentAttention` (GLM 5's DSA MLA) without RoPE.
- Its :class:`~trellm.sdk.SparseIndexer` scores complete pools of ``index_kpool`` tokens (keys softmax-pooled
  per channel), keeps the best ``index_topk / index_kpool`` pools a query can see whole, plus the query's
  incomplete tail pool; attention reads only those tokens. ``indexer_types`` "shared" layers reuse the
  selection of the full layer just before them. Each token's indexer key and pooling gate are cached beside
  its latent, and each complete pool's key (float32), pooled once by the step that completes the pool.
- Hyper-connections (:class:`~trellm.sdk.HyperDecoderLayer`, DeepSeek V4's mHC): the residual is ``hc_mult``
  streams; each sub-layer reads a sigmoid-weighted sum of them and writes back ``post * out + comb^T streams``
  (comb Sinkhorn-normalised); the final hidden is the streams' mean.
- Images (a ``vision_config``): the GLM 5.3 tower (``glm5_next_vision``) fills each image's run of
  ``<|image|>`` tokens (one per merged 2x2 patch block; the chat template writes ``<|begin_of_image|>`` and
  ``<|end_of_image|>`` around it). The text model is NoPE and its delta attention and indexer read no
  positions, so the image rows need no M-RoPE: positions stay plain.
"""
from __future__ import annotations

import attrs

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    ConfigError,
    DecoderConfig,
    Embedding,
    ExpertMLP,
    Experts,
    HybridHyperCausalLM,
    HyperConnection,
    HyperDecoderLayer,
    KimiDeltaAttention,
    Linear,
    Module,
    MoE,
    QwenTowerLanguageModel,
    QwenVision,
    RMSNorm,
    Router,
    ScoreTopK,
    SparseIndexer,
    SparseLatentAttention,
    VisionLanguageConfig,
    config_token,
    limited_swiglu,
    read_keys,
    read_vision_config,
)

PREFIX = "model.language_model"
# transformers 5 nests the delta attention's forget-gate projections as self_attn.forget_gate.f_a_proj / f_b_proj
# (the checkpoints say self_attn.f_a_proj): the names PEFT gives them
ALIASES = ((f"{PREFIX}.layers.*.self_attn.", (f"{PREFIX}.layers.*.self_attn.forget_gate.",)),)


def _strings(value) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


@attrs.frozen
class Glm5NextKeys:
    """The text config keys of GLM 5.3-Flash beyond the shared ones."""

    q_lora_rank: int = attrs.field(default=1536, converter=int)
    kv_lora_rank: int = attrs.field(default=512, converter=int)
    qk_nope_head_dim: int = attrs.field(default=256, converter=int)
    qk_rope_head_dim: int = attrs.field(default=0, converter=int)
    v_head_dim: int = attrs.field(default=256, converter=int)
    index_topk: int = attrs.field(default=2048, converter=int)
    index_head_dim: int = attrs.field(default=128, converter=int)
    index_n_heads: int = attrs.field(default=32, converter=int)
    index_kpool: int = attrs.field(default=16, converter=int)
    index_kpool_always_select_tail: bool = attrs.field(default=True, converter=bool)
    layer_types: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    indexer_types: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    mlp_layer_types: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    swiglu_limit: float = attrs.field(default=10.0, converter=float)
    linear_head_dim: int = attrs.field(default=128, converter=int)
    linear_num_heads: int = attrs.field(default=64, converter=int)
    linear_conv_kernel_dim: int = attrs.field(default=4, converter=int)
    linear_lower_bound: float | None = attrs.field(default=-5.0, converter=attrs.converters.optional(float))  # null: none
    hc_mult: int = attrs.field(default=4, converter=int)
    hc_eps: float = attrs.field(default=1e-6, converter=float)
    hc_sinkhorn_iters: int = attrs.field(default=20, converter=int)


def read_glm5_next_keys(cfg: DecoderConfig) -> Glm5NextKeys:
    """The keys, with HF's defaults for unset layer schedules, checked against the layer count."""
    keys = read_keys(Glm5NextKeys, cfg)
    if "linear_lower_bound" in cfg.extra:  # null means no bound (softplus decay), not the default
        keys = attrs.evolve(keys, linear_lower_bound=cfg.extra["linear_lower_bound"])
    n = cfg.num_hidden_layers
    layer_types = keys.layer_types or tuple("indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n))
    layer_types = tuple("indexed_attention" if t == "full_attention" else t for t in layer_types)
    mlp_types = keys.mlp_layer_types or ("dense",) * min(3, n) + ("sparse",) * max(n - 3, 0)
    indexer_types = keys.indexer_types or ("full",) * n
    for name, values, allowed in (("layer_types", layer_types, {"linear_attention", "indexed_attention"}),
                                  ("mlp_layer_types", mlp_types, {"dense", "sparse"}),
                                  ("indexer_types", indexer_types, {"full", "shared"})):
        if len(values) != n or set(values) - allowed:
            raise ConfigError(f"config.json: {name} must give one of {sorted(allowed)} for each of the {n} layers, "
                              f"got {list(values)}")
    if keys.qk_rope_head_dim:
        raise ConfigError(f"config.json: qk_rope_head_dim={keys.qk_rope_head_dim}; GLM 5.3-Flash attention is NoPE (0)")
    if keys.index_kpool < 1 or keys.index_topk % keys.index_kpool:
        raise ConfigError(f"config.json: index_topk ({keys.index_topk}) must be a multiple of index_kpool "
                          f"({keys.index_kpool} >= 1)")
    for i, kind in enumerate(indexer_types):
        shares = layer_types[i] == "indexed_attention" and kind == "shared"
        if shares and (i == 0 or layer_types[i - 1] != "indexed_attention" or indexer_types[i - 1] != "full"):
            raise ConfigError(f"config.json: layer {i} shares the indexer selection ('shared'), but layer {i - 1} "
                              "is not an indexed_attention layer with a full indexer")
    return attrs.evolve(keys, layer_types=layer_types, mlp_layer_types=mlp_types, indexer_types=indexer_types)


def clamped_moe(cfg: DecoderConfig, key: str, limit: float) -> MoE:
    """DeepSeek-style routing (sigmoid, correction bias, groups, scaling) over clamped-SwiGLU experts."""
    moe = cfg.require_moe()
    size, act = moe.expert_width(), limited_swiglu(limit)
    strategy = ScoreTopK(moe.experts_per_token, score="sigmoid", normalize=moe.normalize_topk is not False,
                         scaling=moe.routed_scaling, num_groups=moe.num_groups, topk_groups=moe.topk_groups)
    router = Router(f"{key}.gate", cfg.hidden_size, moe.num_experts, strategy,
                    correction_bias_key=f"{key}.gate.e_score_correction_bias", float32_logits=True)
    shared = ExpertMLP(f"{key}.shared_experts", cfg.hidden_size, size * moe.num_shared_experts, act) \
        if moe.num_shared_experts else None
    return MoE(key, router, Experts(f"{key}.experts", moe.num_experts, cfg.hidden_size, size, act), shared)


def build(cfg: DecoderConfig) -> HybridHyperCausalLM:
    keys = read_glm5_next_keys(cfg)
    eps, hidden, vocab = cfg.rms_norm_eps, cfg.hidden_size, cfg.vocab_size
    layers, source = [], None
    for i in range(cfg.num_hidden_layers):
        key = f"{PREFIX}.layers.{i}"
        hc = lambda name: HyperConnection(f"{key}.hc_{name}_", hidden, keys.hc_mult, keys.hc_sinkhorn_iters,  # noqa: E731
                                          keys.hc_eps, eps)
        if keys.layer_types[i] == "linear_attention":
            mixer = KimiDeltaAttention(f"{key}.self_attn", i, hidden, keys.linear_num_heads, keys.linear_head_dim,
                                       keys.linear_conv_kernel_dim, eps, keys.linear_lower_bound)
        elif keys.indexer_types[i] == "full":
            indexer = SparseIndexer(f"{key}.self_attn.indexer", hidden, keys.q_lora_rank, keys.index_n_heads,
                                    keys.index_head_dim, keys.index_topk, False, keys.index_kpool,
                                    keys.index_kpool_always_select_tail)
            mixer = source = SparseLatentAttention(f"{key}.self_attn", i, cfg, None, False, indexer, norm_eps=eps)
        else:  # "shared": the selection of the full layer just before
            mixer = SparseLatentAttention(f"{key}.self_attn", i, cfg, None, False, None, source, norm_eps=eps)
        if keys.mlp_layer_types[i] == "sparse":
            mlp = clamped_moe(cfg, f"{key}.mlp", keys.swiglu_limit)
        else:
            mlp = ExpertMLP(f"{key}.mlp", hidden, cfg.intermediate_size, limited_swiglu(keys.swiglu_limit))
        layers.append(HyperDecoderLayer(key, hc("attn"), RMSNorm(f"{key}.input_layernorm", hidden, eps), mixer,
                                        hc("ffn"), RMSNorm(f"{key}.post_attention_layernorm", hidden, eps), mlp))
    embed = f"{PREFIX}.embed_tokens"
    model = HybridHyperCausalLM(cfg, Embedding(embed, vocab, hidden), layers, RMSNorm(f"{PREFIX}.norm", hidden, eps),
                                Linear("lm_head", hidden, vocab, alt_key=embed if cfg.tie_word_embeddings else None),
                                keys.hc_mult)
    model.aliases = ALIASES
    return model


class Glm5NextVisionLanguageModel(QwenTowerLanguageModel):
    """The text model fed by the GLM 5.3 tower (``model.visual``) at the ``<|image|>`` placeholders."""

    def __init__(self, cfg: VisionLanguageConfig):
        super().__init__(build(cfg.text), QwenVision(cfg.vision, "model.visual"), ALIASES, cfg.image_token_id)


def read_config(raw: dict) -> VisionLanguageConfig | DecoderConfig:
    """With a ``vision_config`` the model takes images; a flat text-only config (text keys at the top) does not."""
    text = DecoderConfig.from_hf(raw)
    if "vision_config" not in raw:
        return text
    return VisionLanguageConfig(text=text, vision=read_vision_config(raw, "Glm5NextForConditionalGeneration"),
                                image_token_id=config_token(raw, "image_token_id", default=154854))


def build_model(cfg: VisionLanguageConfig | DecoderConfig) -> Module:
    return Glm5NextVisionLanguageModel(cfg) if isinstance(cfg, VisionLanguageConfig) else build(cfg)


SPEC = ArchitectureSpec(
    name="glm5_next",
    architectures=("Glm5NextForConditionalGeneration",),
    read_config=read_config,
    build=build_model,
    description="GLM 5.3-Flash: KDA linear attention + NoPE MLA with a pooled DSA indexer, hyper-connections, "
                "clamped SwiGLU MoE, the GLM 5.3 (GLM-OCR) vision tower",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
