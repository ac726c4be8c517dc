"""DeepSeek V4 (DeepseekV4ForCausalLM): compressed attention, hyper-connections, hash-routed experts.

- Attention (:class:`trellm.sdk.CompressedAttention`): one shared K = V head over a sliding window, plus
  per ``layer_types`` entry compressed entries of ``compress_rates`` tokens each, all of them (HCA) or an
  indexer's top ``index_topk`` (CSA); learned sinks, a grouped low-rank output projection. Sliding layers
  use the ``main`` RoPE, the others the ``compress`` one.
- The residual is ``hc_mult`` streams mixed around every block (:class:`trellm.sdk.HyperDecoderLayer`),
  collapsed by a learned head (``model.hc_head``) before the final norm.
- MoE on every layer, scores ``sqrt(softplus(logits))``, SwiGLU clamped at ``swiglu_limit``; the
  ``hash_moe`` layers pick experts by token id (``gate.tid2eid``) instead of by score.

Tensor names are the hub's (``attn``, ``ffn``, ``w1``/``w2``/``w3``, ``hc_attn_fn`` ...), which
transformers' ``save_pretrained`` writes. The MTP layers of the release checkpoints are not loaded.
"""
from __future__ import annotations

import torch
import trellm
from trellm.sdk import (
    ArchitectureSpec,
    CompressedAttention,
    CompressedIndexer,
    ConfigError,
    DecoderConfig,
    Embedding,
    ExpertMLP,
    Experts,
    ForwardBatch,
    HyperCausalLM,
    HyperConnection,
    HyperDecoderLayer,
    HyperHead,
    Linear,
    LoadContext,
    MoE,
    RMSNorm,
    Router,
    RotaryEmbedding,
    ScoreTopK,
    config_int,
)

EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


def clamped_silu(limit: float):
    """silu(gate clamped from above) * up clamped to [-limit, limit]."""
    return lambda gate, up: torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class HashRoutedMoE(MoE):
    """Experts chosen by token id (``{key}.gate.tid2eid`` [vocab, k]), weighted by their normalised router scores."""

    def __init__(self, key: str, router: Router, experts, shared, vocab_size: int, top_k: int, scaling: float):
        super().__init__(key, router, experts, shared)
        self.vocab_size, self.top_k, self.scaling = vocab_size, top_k, scaling
        self.tid2eid = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        self.tid2eid = ctx.store.get(f"{self.key}.gate.tid2eid", shape=(self.vocab_size, self.top_k), device=ctx.device).long()

    def unload(self) -> None:
        super().unload()
        self.tid2eid = None

    def route(self, x: torch.Tensor, batch: ForwardBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.nn.functional.softplus(self.router.logits(x).float()).sqrt()
        ids = self.tid2eid[batch.input_ids]
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, ids


def read_config(raw: dict) -> DecoderConfig:
    cfg = DecoderConfig.from_hf(raw)
    if cfg.extra.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ConfigError(f"config.json: scoring_func {cfg.extra['scoring_func']!r} is not supported; DeepSeek V4 uses 'sqrtsoftplus'")
    return cfg


def build(cfg: DecoderConfig) -> HyperCausalLM:
    x, hidden, eps = cfg.extra, cfg.hidden_size, cfg.rms_norm_eps
    moe = cfg.require_moe()
    streams, iters, hc_eps = config_int(x, "hc_mult"), config_int(x, "hc_sinkhorn_iters"), float(x.get("hc_eps", 1e-6))
    ropes = {kind: RotaryEmbedding(cfg.rope_for(kind), cfg.head_dim, cfg.max_position_embeddings) for kind in ("main", "compress")}
    rates = x.get("compress_rates") or {}
    kinds = list(cfg.layer_types)
    mlp_kinds = x.get("mlp_layer_types") or ["moe"] * cfg.num_hidden_layers
    act = clamped_silu(float(x.get("swiglu_limit", 10.0)))
    layers = []
    for i in range(cfg.num_hidden_layers):
        key, kind = f"model.layers.{i}", kinds[i]
        rope = ropes["main" if kind == "sliding_attention" else "compress"]
        rate = int(rates.get(kind, 1))
        indexer = None
        if kind == "compressed_sparse_attention":
            indexer = CompressedIndexer(f"{key}.attn.indexer", hidden, config_int(x, "q_lora_rank"), config_int(x, "index_n_heads"),
                                        config_int(x, "index_head_dim"), config_int(x, "index_topk"), rate, eps, rope)
        attn = CompressedAttention(f"{key}.attn", i, kind, hidden, cfg.num_attention_heads, cfg.head_dim, config_int(x, "q_lora_rank"),
                                   config_int(x, "o_groups"), config_int(x, "o_lora_rank"), cfg.sliding_window, rate, eps, rope, indexer)
        ffn = f"{key}.ffn"
        experts = Experts(f"{ffn}.experts", moe.num_experts, hidden, moe.expert_width(), act, names=EXPERT_NAMES)
        shared = ExpertMLP(f"{ffn}.shared_experts", hidden, moe.expert_width() * moe.num_shared_experts, act, names=EXPERT_NAMES)
        if mlp_kinds[i] == "hash_moe":
            router = Router(f"{ffn}.gate", hidden, moe.num_experts, ScoreTopK(moe.experts_per_token))
            mlp = HashRoutedMoE(ffn, router, experts, shared, cfg.vocab_size, moe.experts_per_token, moe.routed_scaling)
        else:
            strategy = ScoreTopK(moe.experts_per_token, score="sqrtsoftplus", scaling=moe.routed_scaling)
            router = Router(f"{ffn}.gate", hidden, moe.num_experts, strategy, correction_bias_key=f"{ffn}.gate.bias")
            mlp = MoE(ffn, router, experts, shared)
        hc = lambda part: HyperConnection(f"{key}.hc_{part}_", hidden, streams, iters, hc_eps, eps)
        layers.append(HyperDecoderLayer(key, hc("attn"), RMSNorm(f"{key}.attn_norm", hidden, eps), attn,
                                        hc("ffn"), RMSNorm(f"{key}.ffn_norm", hidden, eps), mlp))
    return HyperCausalLM(cfg, Embedding("model.embed_tokens", cfg.vocab_size, hidden), layers, RMSNorm("model.norm", hidden, eps),
                         Linear("head", hidden, cfg.vocab_size), streams, HyperHead("model.hc_head.hc_", hidden, streams, hc_eps, eps))


SPEC = ArchitectureSpec(
    name="deepseek_v4",
    architectures=("DeepseekV4ForCausalLM",),
    read_config=read_config,
    build=build,
    description="DeepSeek V4: sliding + compressed (CSA with an indexer, HCA) attention, hyper-connections, hash-routed experts",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
