"""GLM 5 (GlmMoeDsaForCausalLM): DeepSeek V3's MLA and grouped experts, with DeepSeek Sparse Attention.

Each layer attends only to the ``index_topk`` tokens a lightning indexer picks per query
(:class:`trellm.sdk.SparseLatentAttention`; the indexer's RoPE is interleaved, as the MLA's). A layer
whose ``indexer_types`` entry is ``"shared"`` has no indexer and reuses the selection of the last
``"full"`` layer before it. ``mlp_layer_types`` says which layers are MoE.
"""
from __future__ import annotations

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    ConfigError,
    DecoderConfig,
    RotaryEmbedding,
    SparseIndexer,
    SparseLatentAttention,
    build_decoder,
    config_int,
    deepseek_moe,
    replace_mlps,
)


def indexer_types(x: dict, layers: int) -> list[str]:
    """Per layer "full" (runs its indexer) or "shared": the config's list, else its ``index_topk_pattern``
    ("FSS..."), else every ``index_topk_freq``-th layer from ``index_skip_topk_offset`` on (transformers' rule)."""
    types = x.get("indexer_types")
    if types is None and x.get("index_topk_pattern") is not None:
        pattern = x["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if types is None:
        freq, offset = max(int(x.get("index_topk_freq", 1)), 1), int(x.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    types = list(types)
    if len(types) < layers or any(t not in ("full", "shared") for t in types[:layers]) or types[0] != "full":
        raise ConfigError(f"indexer_types {types!r}: want 'full' or 'shared' for each of {layers} layers, the first 'full'")
    return types[:layers]


def build(cfg: DecoderConfig):
    model = build_decoder(cfg)
    x = cfg.extra
    rope = RotaryEmbedding(cfg.rope, config_int(x, "qk_rope_head_dim"), cfg.max_position_embeddings)
    source = None
    for i, (layer, kind) in enumerate(zip(model.layers, indexer_types(x, cfg.num_hidden_layers))):
        key = f"{layer.key}.self_attn"
        indexer = None
        if kind == "full":
            indexer = SparseIndexer(f"{key}.indexer", cfg.hidden_size, config_int(x, "q_lora_rank"), config_int(x, "index_n_heads"),
                                    config_int(x, "index_head_dim"), config_int(x, "index_topk"), interleaved=True)
        layer.attn = SparseLatentAttention(key, i, cfg, rope, True, indexer, None if indexer else source)
        if indexer:
            source = layer.attn
    kinds = x.get("mlp_layer_types")
    first_dense = cfg.require_moe().first_dense_layers
    sparse = [kinds[i] == "sparse" if kinds else i >= first_dense for i in range(cfg.num_hidden_layers)]
    replace_mlps(model, lambda i, key: deepseek_moe(cfg, f"{key}.mlp") if sparse[i] else None)
    return model


SPEC = ArchitectureSpec(
    name="glm_moe_dsa",
    architectures=("GlmMoeDsaForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="GLM 5: MLA with DeepSeek Sparse Attention (a lightning indexer picks each query's top-k tokens), grouped sigmoid-routed experts",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
