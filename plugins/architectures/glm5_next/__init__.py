"""GLM 5.3-Flash (Glm5NextForConditionalGeneration): Kimi delta attention (KDA) layers mixed with NoPE latent
attention (MLA) whose keys a pooled DSA indexer picks, manifold-constrained hyper-connections around every
sub-layer, and SwiGLU MLPs with clamped inputs (dense, and DeepSeek-style grouped sigmoid MoE).

- ``layer_types``: ``linear_attention`` (:class:`~trellm.sdk.KimiDeltaAttention`, state in a recurrent slot)
  or ``indexed_attention`` (MLA without RoPE, absorbed form, the cache holding the latent per token).
- The indexer scores complete pools of ``index_kpool`` tokens (keys softmax-pooled per channel), keeps the
  best ``index_topk / index_kpool`` pools a query can see whole, plus the query's incomplete tail pool;
  attention reads only those tokens. ``indexer_types`` "shared" layers reuse the selection of the full
  layer just before them. Indexer keys live in the same cache row as the latent ([c | k | gate]).
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
import torch
import torch.nn.functional as F

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    Attention,
    ConfigError,
    DecoderConfig,
    Embedding,
    ExpertMLP,
    Experts,
    ForwardBatch,
    HybridHyperCausalLM,
    HyperConnection,
    HyperDecoderLayer,
    KimiDeltaAttention,
    LayerNorm,
    Linear,
    LoadContext,
    Module,
    MoE,
    QwenTowerLanguageModel,
    QwenVision,
    RMSNorm,
    Router,
    ScoreTopK,
    VisionLanguageConfig,
    config_token,
    gather_pages,
    has_dense_pages,
    limited_swiglu,
    read_keys,
    read_vision_config,
)

PREFIX = "model.language_model"


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


@attrs.define
class SharedSelection:
    """The keys a full-indexer layer picked in this forward pass, one [new tokens, context] bool mask per
    sequence, for the "shared" layer after it."""

    masks: list = attrs.field(factory=list)


class PooledIndexer(Module):
    """The DSA indexer over pools of ``kpool`` tokens: ``wq_b`` (from the query latent) and ``weights_proj``
    per query, ``wk`` + LayerNorm ``k_norm`` and the pooling gate (``index_kpool_compress_gate``, plus the
    in-pool position bias ``index_kpool_compress_ape``) per key token."""

    def __init__(self, key: str, hidden_size: int, q_lora_rank: int, keys: Glm5NextKeys):
        self.key, self.hidden_size = key, hidden_size
        self.heads, self.head_dim, self.kpool = keys.index_n_heads, keys.index_head_dim, keys.index_kpool
        self.pools_kept, self.tail = keys.index_topk // keys.index_kpool, keys.index_kpool_always_select_tail
        self.wq_b = Linear(f"{key}.wq_b", q_lora_rank, self.heads * self.head_dim)
        self.wk = Linear(f"{key}.wk", hidden_size, self.head_dim)
        self.k_norm = LayerNorm(f"{key}.k_norm", self.head_dim, 1e-6)
        self.weights_proj = Linear(f"{key}.weights_proj", hidden_size, self.heads)
        self.pool_bias = self.pool_gate = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        get = lambda name, shape: ctx.store.get(f"{self.key}.{name}", shape=shape, dtype=ctx.dtype, device=ctx.device)
        self.pool_bias = get("index_kpool_compress_ape", (self.kpool, self.head_dim))
        self.pool_gate = get("index_kpool_compress_gate", (self.head_dim, self.hidden_size))

    def unload(self) -> None:
        super().unload()
        self.pool_bias = self.pool_gate = None

    @property
    def state_width(self) -> int:
        """Values cached per token: its key and its pooling gate."""
        return 2 * self.head_dim

    def token_states(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2 * head_dim]: each token's indexer key and pooling-gate logits."""
        return torch.cat([self.k_norm.forward(self.wk(x)), x @ self.pool_gate.t()], dim=-1)

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [T, heads, head_dim], head weights [T, heads]) in float32."""
        q = self.wq_b(q_latent).view(x.shape[0], self.heads, self.head_dim).float()
        return q, self.weights_proj(x).float() * self.heads**-0.5

    def select(self, q: torch.Tensor, weights: torch.Tensor, states: torch.Tensor, first: int) -> torch.Tensor:
        """[n, L] bool: the context tokens (``states`` [L, 2 * head_dim]) that the n queries at positions
        first, first + 1, ... attend to."""
        n, length, kp = q.shape[0], states.shape[0], self.kpool
        positions = torch.arange(first, first + n, device=q.device)
        tokens = torch.arange(length, device=q.device)
        mask = torch.zeros(n, length, dtype=torch.bool, device=q.device)
        pools = length // kp  # complete pools only
        if pools:
            keys, gates = states[: pools * kp].float().view(pools, kp, 2, self.head_dim).unbind(2)
            pooled = ((gates + self.pool_bias.float()).softmax(dim=1) * keys).sum(1)  # [P, head_dim]
            scores = F.relu(torch.einsum("nhd,pd->nhp", q, pooled) * self.head_dim**-0.5)
            index = torch.einsum("nh,nhp->np", weights, scores)
            whole = (torch.arange(pools, device=q.device) * kp + kp - 1)[None] <= positions[:, None]  # seen whole
            index = index.masked_fill(~whole, torch.finfo(index.dtype).min)
            best = index.topk(min(self.pools_kept, pools), dim=-1).indices
            chosen = torch.zeros(n, pools, dtype=torch.bool, device=q.device).scatter_(1, best, whole.gather(1, best))
            mask[:, : pools * kp] = chosen.repeat_interleave(kp, dim=1)
        if self.tail:  # the query's own incomplete pool
            tail_start = (positions + 1) - (positions + 1) % kp
            mask |= (tokens[None] >= tail_start[:, None]) & (tokens[None] <= positions[:, None])
        return mask


class SparseLatentAttention(Attention):
    """NoPE multi-head latent attention over the tokens the indexer picks (absorbed form: every head attends
    to the normalised latent c). The cache row of a token is [c | indexer key | pooling gate] (just c on a
    "shared" layer); the value is c."""

    def __init__(self, key: str, layer_idx: int, cfg: DecoderConfig, keys: Glm5NextKeys, selection: SharedSelection,
                 full_indexer: bool):
        self.key, self.layer_idx, self.selection = key, layer_idx, selection
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads, self.sliding_window, self.softcap = 1, 0, 0.0
        self.rank, self.nope_dim, self.v_dim = keys.kv_lora_rank, keys.qk_nope_head_dim, keys.v_head_dim
        self.head_dim = self.nope_dim
        h, hidden, bias, eps = self.num_heads, cfg.hidden_size, cfg.attention_bias, cfg.rms_norm_eps
        self.q_a_proj = Linear(f"{key}.q_a_proj", hidden, keys.q_lora_rank, bias)
        self.q_a_layernorm = RMSNorm(f"{key}.q_a_layernorm", keys.q_lora_rank, eps)
        self.q_b_proj = Linear(f"{key}.q_b_proj", keys.q_lora_rank, h * self.nope_dim)
        self.kv_a_proj_with_mqa = Linear(f"{key}.kv_a_proj_with_mqa", hidden, self.rank, bias)
        self.kv_a_layernorm = RMSNorm(f"{key}.kv_a_layernorm", self.rank, eps)
        self.kv_b_proj = Linear(f"{key}.kv_b_proj", self.rank, h * (self.nope_dim + self.v_dim))
        self.o_proj = Linear(f"{key}.o_proj", h * self.v_dim, hidden, bias)
        self.indexer = PooledIndexer(f"{key}.indexer", hidden, keys.q_lora_rank, keys) if full_indexer else None
        self.scale = self.nope_dim**-0.5
        self.w_uk = self.w_uv = None

    def kv_shape(self) -> tuple[int, int, int]:
        return 1, self.rank + (self.indexer.state_width if self.indexer else 0), self.rank

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        w = self.kv_b_proj.impl.dense_weight().to(ctx.dtype).view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        self.w_uk = w[:, : self.nope_dim].contiguous()  # [H, nope, r]
        self.w_uv = w[:, self.nope_dim :].contiguous()  # [H, v, r]

    def unload(self) -> None:
        super().unload()
        self.w_uk = self.w_uv = None

    def _contexts(self, rows: torch.Tensor, latent: torch.Tensor, batch: ForwardBatch) -> list[tuple[torch.Tensor, int]]:
        """Per sequence: (its cache rows [L, width], position of its first new token)."""
        bounds = batch.cu_seqlens.tolist()
        if batch.cache is None:
            return [(rows[s0:s1], 0) for s0, s1 in zip(bounds[:-1], bounds[1:])]
        layer = batch.cache.layers[self.layer_idx]
        if not has_dense_pages(layer):
            raise ValueError(f"{self.key}: sparse latent attention reads its cache rows directly; "
                             f"a {type(layer).__name__} cache layer does not offer them")
        layer.store(rows[:, None], latent[:, None], batch.slots)
        lengths = batch.context_lens.tolist()
        return [(gather_pages(layer.k_pages, batch.block_table[b], lengths[b])[:, 0], lengths[b] - (s1 - s0))
                for b, (s0, s1) in enumerate(zip(bounds[:-1], bounds[1:]))]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        q_latent = self.q_a_layernorm.forward(self.q_a_proj(x))
        q = torch.einsum("thn,hnr->thr", self.q_b_proj(q_latent).view(t, h, self.nope_dim), self.w_uk)
        c = self.kv_a_layernorm.forward(self.kv_a_proj_with_mqa(x))
        rows = torch.cat([c, self.indexer.token_states(x)], dim=-1) if self.indexer else c
        contexts = self._contexts(rows, c, batch)
        if self.indexer:
            index_q, index_w = self.indexer.queries(x, q_latent)
        out = torch.empty(t, h, self.rank, dtype=x.dtype, device=x.device)
        masks = []
        bounds = batch.cu_seqlens.tolist()
        for b, ((ctx_rows, first), s0, s1) in enumerate(zip(contexts, bounds[:-1], bounds[1:])):
            if self.indexer:
                mask = self.indexer.select(index_q[s0:s1], index_w[s0:s1], ctx_rows[:, self.rank:], first)
            else:
                mask = self.selection.masks[b]
            masks.append(mask)
            latent = ctx_rows[:, : self.rank]
            scores = torch.einsum("nhr,lr->nhl", q[s0:s1].float(), latent.float()) * self.scale
            # a query that sees no whole pool and keeps no tail (index_kpool_always_select_tail false) reads
            # nothing: zeros (transformers' mask then spreads it over every key, later ones included)
            probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1).nan_to_num(0.0)
            out[s0:s1] = (probs @ latent.float()).to(x.dtype)
        if self.indexer:
            self.selection.masks = masks
        o = torch.einsum("thr,hvr->thv", out, self.w_uv)
        return self.o_proj(o.reshape(t, h * self.v_dim))


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
    selection = SharedSelection()
    layers = []
    for i in range(cfg.num_hidden_layers):
        key = f"{PREFIX}.layers.{i}"
        hc = lambda name: HyperConnection(f"{key}.hc_{name}_", hidden, keys.hc_mult, keys.hc_sinkhorn_iters,  # noqa: E731
                                          keys.hc_eps, eps)
        if keys.layer_types[i] == "linear_attention":
            mixer = KimiDeltaAttention(f"{key}.self_attn", i, hidden, keys.linear_num_heads, keys.linear_head_dim,
                                       keys.linear_conv_kernel_dim, eps, keys.linear_lower_bound)
        else:
            mixer = SparseLatentAttention(f"{key}.self_attn", i, cfg, keys, selection, keys.indexer_types[i] == "full")
        if keys.mlp_layer_types[i] == "sparse":
            mlp = clamped_moe(cfg, f"{key}.mlp", keys.swiglu_limit)
        else:
            mlp = ExpertMLP(f"{key}.mlp", hidden, cfg.intermediate_size, limited_swiglu(keys.swiglu_limit))
        layers.append(HyperDecoderLayer(key, hc("attn"), RMSNorm(f"{key}.input_layernorm", hidden, eps), mixer,
                                        hc("ffn"), RMSNorm(f"{key}.post_attention_layernorm", hidden, eps), mlp))
    embed = f"{PREFIX}.embed_tokens"
    return HybridHyperCausalLM(cfg, Embedding(embed, vocab, hidden), layers, RMSNorm(f"{PREFIX}.norm", hidden, eps),
                               Linear("lm_head", hidden, vocab, alt_key=embed if cfg.tie_word_embeddings else None),
                               keys.hc_mult)


class Glm5NextVisionLanguageModel(QwenTowerLanguageModel):
    """The text model fed by the GLM 5.3 tower (``model.visual``) at the ``<|image|>`` placeholders."""

    def __init__(self, cfg: VisionLanguageConfig):
        super().__init__(build(cfg.text), QwenVision(cfg.vision, "model.visual"), (), cfg.image_token_id)


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
