"""Step 3.5 Flash (Step3p5ForCausalLM) and Step 3.7 Flash (Step3p7ForConditionalGeneration: Step 3.5's text
model with the ``step3p7_vision`` tower): a sigmoid-routed MoE with per-layer SwiGLU clamps, and attention
whose sliding layers have their own head counts and RoPE.

- Attention: QK-norm per head, RMSNorms stored as ``w - 1`` (scaled by ``1 + w``), each output head
  scaled by ``sigmoid(g_proj(x))`` (one gate per head) before o_proj, softmax scale
  ``query_pre_attn_scalar ** -0.5``. ``sliding_attention`` layers use the window and their own query
  (and, in StepFun's configs, KV) head counts; RoPE base and rotated fraction are set per layer type.
- MLP: dense on the first layers, then experts chosen by ``sigmoid(logits) + router_bias``, weighted
  by the renormalised unbiased scores times ``moe_router_scaling_factor``, plus one shared expert.
  Where a layer's ``swiglu_limits`` (experts) or ``swiglu_limits_shared`` (shared expert and dense
  MLP) is non-zero, ``silu(gate)`` is clamped from above and ``up`` to [-limit, limit].

StepFun's config.json spells these its own way (``num_attention_groups``, ``attention_other_setting``,
per-layer ``rope_theta`` / ``partial_rotary_factors`` lists, ``moe_layers_enum``, lists padded with
the MTP layers); :func:`normalise_text_config` turns them into transformers' spelling, which configs
written by ``save_pretrained`` already use. Tensors: ``model.layers.{i}.moe.{gate_proj,up_proj,down_proj}.weight``
(experts stacked), ``moe.gate.weight``, ``moe.router_bias`` and ``share_expert.*``.

Images (Step 3.7): the tower's features of each view go through one linear map, ``vit_large_projector``, to
the text width. The processor writes each ``<im_patch>`` marker as, per local crop,
``<patch_start><im_patch>*n<patch_end>`` (a ``<patch_newline>`` after each row of crops but the last), then
``<im_start><im_patch>*m<im_end>`` for the global view; the delimiters' ids come from the tokenizer. Image rows
are ordinary causal rows with 1D positions, as in transformers.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import torch
import torch.nn.functional as F

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    CausalLM,
    ConfigError,
    DecoderConfig,
    DecoderLayer,
    Experts,
    ForwardBatch,
    GatedMLP,
    ImageError,
    Linear,
    LoadContext,
    MoE,
    Module,
    OutputGate,
    OutputGatedAttention,
    RMSNorm,
    RotaryEmbedding,
    Router,
    ScoreTopK,
    VisionInput,
    VisionLanguageConfig,
    VisionLanguageModel,
    config_int,
    config_token,
    image_digest,
    load_image_processor,
    mlp_layer_types,
    ops,
    read_keys,
    read_vision_config,
    shard_mlp,
    text_config,
    vision_tower_spec,
)


def _per_layer(values: Any, n: int, name: str) -> list | None:
    """A per-layer list cut to the ``n`` decoder layers (StepFun pads them with the MTP layers)."""
    if values is None:
        return None
    if not isinstance(values, list) or len(values) < n:
        raise ConfigError(f"config.json: {name} must list a value for each of the {n} layers, got {values!r}")
    return values[:n]


def normalise_text_config(c: dict[str, Any]) -> dict[str, Any]:
    """StepFun's text config in transformers' spelling (a config already in it comes back unchanged in meaning)."""
    c = dict(c)
    n = config_int(c, "num_hidden_layers")
    heads = config_int(c, "num_attention_heads")
    kv = config_int(c, "num_key_value_heads", default=config_int(c, "num_attention_groups", default=heads))
    other = c.pop("attention_other_setting", None) or {}
    layer_types = _per_layer(c.get("layer_types"), n, "layer_types") or ["full_attention"] * n
    c.update(num_key_value_heads=kv, layer_types=layer_types)
    if other.get("head_dim", c.get("head_dim")) != c.get("head_dim"):
        raise ConfigError(f"config.json: attention_other_setting.head_dim {other['head_dim']} differs from head_dim "
                          f"{c.get('head_dim')}; sliding layers with their own head size are not supported")
    c.setdefault("num_sliding_attention_heads", other.get("num_attention_heads", heads))
    c.setdefault("sliding_num_key_value_heads", other.get("num_attention_groups", kv))
    c.setdefault("n_routed_experts", c.get("moe_num_experts"))
    c.setdefault("num_experts_per_tok", c.get("moe_top_k"))
    if c.get("mlp_layer_types") is None:
        enum = c.get("moe_layers_enum")
        items = (enum.split(",") if isinstance(enum, str) else enum) if enum is not None else range(3, n)
        moe_layers = {int(i) for i in items if str(i).strip()}
        c["mlp_layer_types"] = ["sparse" if i in moe_layers else "dense" for i in range(n)]
    for name in ("swiglu_limits", "swiglu_limits_shared", "mlp_layer_types"):
        c[name] = _per_layer(c.get(name), n, name) or [0] * n
    params = c.get("rope_parameters")
    if not (isinstance(params, dict) and all(isinstance(params.get(t), dict) for t in set(layer_types))):
        theta = c.pop("rope_theta", 10000.0)
        theta = _per_layer(theta, n, "rope_theta") if isinstance(theta, list) else [theta] * n
        factors = _per_layer(c.pop("partial_rotary_factors", None), n, "partial_rotary_factors") or [1.0] * n
        scaling = c.pop("rope_scaling", None) or {}
        params = {}
        for t in set(layer_types):
            i = layer_types.index(t)
            params[t] = {"rope_type": "default", "rope_theta": float(theta[i]), "partial_rotary_factor": float(factors[i])}
        if scaling and "full_attention" in params:  # long-context scaling applies to the full-attention layers
            params["full_attention"].update(scaling)
        c["rope_parameters"] = params
    c["hidden_act"] = "silu"  # "swigluoai" in StepFun's configs names the clamped SwiGLU built here
    return c


def read_config(raw: dict) -> DecoderConfig:
    text = normalise_text_config(text_config(raw))
    return DecoderConfig.from_hf({**raw, "text_config": text} if "text_config" in raw else {**raw, **text})


def _limits(values: list) -> tuple[float, ...]:
    return tuple(float(v or 0.0) for v in values)


@attrs.frozen
class StepKeys:
    """Step's own keys, per layer where they vary (read from the normalised config)."""

    num_sliding_attention_heads: int = attrs.field(converter=int)
    sliding_num_key_value_heads: int = attrs.field(converter=int)
    swiglu_limits: tuple[float, ...] = attrs.field(converter=_limits)
    swiglu_limits_shared: tuple[float, ...] = attrs.field(converter=_limits)
    query_pre_attn_scalar: float | None = attrs.field(default=None, converter=attrs.converters.optional(float))
    moe_router_scaling_factor: float = attrs.field(default=1.0, converter=float)
    norm_expert_weight: bool = attrs.field(default=True, converter=bool)
    use_moe_router_bias: bool = attrs.field(default=True, converter=bool)
    moe_intermediate_size: int = attrs.field(default=0, converter=int)
    share_expert_dim: int = attrs.field(default=0, converter=int)


def clamped_silu_gate(limit: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``silu(gate)`` clamped from above at ``limit`` times ``up`` clamped to [-limit, limit]."""

    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)

    return act


class ClampedGatedMLP(GatedMLP):
    """A SwiGLU MLP whose activation is :func:`clamped_silu_gate`."""

    def __init__(self, key: str, hidden_size: int, intermediate_size: int, limit: float):
        super().__init__(key, hidden_size, intermediate_size)
        self.act = clamped_silu_gate(limit)

    def forward(self, x, batch: ForwardBatch | None = None, residual=None):
        gate, up = ops.project(x, self.gate_up.weights())
        post = ops.Residual(residual.value()) if residual is not None else None
        return ops.project(self.act(gate, up), self.down_proj.impl, post=post)

    def split_over_ranks(self, comm) -> None:
        """Tensor parallel: by intermediate columns, as any :class:`GatedMLP` (the clamp is per element)."""
        shard_mlp(self, comm)


HEAD_GATE = OutputGate("sigmoid", per_head=True)  # one gate value per head, from g_proj


def swiglu_mlp(key: str, hidden_size: int, intermediate_size: int, limit: float) -> GatedMLP:
    return ClampedGatedMLP(key, hidden_size, intermediate_size, limit) if limit > 0 else GatedMLP(key, hidden_size, intermediate_size)


def build(cfg: DecoderConfig) -> CausalLM:
    keys, mlp_kinds = read_keys(StepKeys, cfg), mlp_layer_types(cfg)
    hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
    scale = (keys.query_pre_attn_scalar or cfg.head_dim) ** -0.5
    ropes = {t: RotaryEmbedding(cfg.rope_for(t), cfg.head_dim, cfg.max_position_embeddings) for t in set(cfg.layer_types)}
    layers: list[Module] = []
    for i in range(cfg.num_hidden_layers):
        key, kind = f"model.layers.{i}", cfg.layer_type(i)
        sliding = kind == "sliding_attention"
        attn = OutputGatedAttention(
            f"{key}.self_attn", i, hidden,
            keys.num_sliding_attention_heads if sliding else cfg.num_attention_heads,
            keys.sliding_num_key_value_heads if sliding else cfg.num_key_value_heads,
            cfg.head_dim, ropes[kind], HEAD_GATE, "g_proj", qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
            qk_norm_eps=eps, qk_norm_unit_offset=True, sliding_window=cfg.layer_sliding_window(i), scale=scale,
        )
        if mlp_kinds[i] == "sparse":
            moe = cfg.require_moe()
            strategy = ScoreTopK(moe.experts_per_token, score="sigmoid", normalize=keys.norm_expert_weight,
                                 scaling=keys.moe_router_scaling_factor, norm_eps=0.0)
            limit = keys.swiglu_limits[i]
            mlp: Module = MoE(
                f"{key}.moe",
                Router(f"{key}.moe.gate", hidden, moe.num_experts, strategy,
                       correction_bias_key=f"{key}.moe.router_bias" if keys.use_moe_router_bias else None),
                Experts(f"{key}.moe", moe.num_experts, hidden, keys.moe_intermediate_size,
                        clamped_silu_gate(limit) if limit > 0 else "silu"),
                swiglu_mlp(f"{key}.share_expert", hidden, keys.share_expert_dim, keys.swiglu_limits_shared[i]),
            )
        else:
            mlp = swiglu_mlp(f"{key}.mlp", hidden, cfg.intermediate_size, keys.swiglu_limits_shared[i])
        norms = (RMSNorm(f"{key}.{n}", hidden, eps, True) for n in ("input_layernorm", "post_attention_layernorm"))
        layers.append(DecoderLayer(key, next(norms), attn, next(norms), mlp))
    return CausalLM.from_layers(cfg, layers, norm_unit_offset=True)


SPEC = ArchitectureSpec(
    name="step3p5",
    architectures=("Step3p5ForCausalLM",),
    read_config=read_config,
    build=build,
    description="StepFun Step 3.5 Flash: head-gated attention, sliding layers with their own heads and RoPE, clamped SwiGLU MoE",
)

# ---- Step 3.7 Flash: the text model with images --------------------------------------------------------------

TOWER = "step3p5_vision"  # transformers builds its Step 3.7 tower whatever model_type the hub's vision_config names
DELIMITERS = ("<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>")


@attrs.frozen
class Step3p7Config(VisionLanguageConfig):
    projector_bias: bool


def read_vl_config(raw: dict) -> Step3p7Config:
    return Step3p7Config(
        text=read_config(raw),
        vision={**read_vision_config(raw, "Step3p7ForConditionalGeneration"), "model_type": TOWER},
        image_token_id=config_token(raw, "image_token_id", default=151679),
        projector_bias=bool(raw.get("projector_bias", False)),
    )


class Step3p7Vision(Module):
    """The tower and the projector to the text width; the image processor comes from the model dir."""

    def __init__(self, cfg: Step3p7Config):
        self.key = "vision_model"
        self.tower_spec, self.vision_config = vision_tower_spec(cfg.vision, TOWER), cfg.vision
        self.tower = self.tower_spec.build(cfg.vision, "vision_model")
        self.projector = Linear("vit_large_projector", self.tower.out_features, cfg.hidden_size, bias=cfg.projector_bias)
        self.processor = None

    def load(self, ctx: LoadContext) -> None:
        self.processor = load_image_processor(ctx.store.model_dir, self.tower_spec, self.vision_config)
        super().load(ctx)

    def forward(self, views: torch.Tensor) -> torch.Tensor:
        """views [N, 3, S, S] -> [N, tokens, hidden]."""
        return self.projector(self.tower.forward(views))


@attrs.define
class CroppedInput(VisionInput):
    """``pixels``: the global view; ``crops`` [n, 3, P, P] in row-major order; ``grid``: (rows, columns) of crops."""

    crops: torch.Tensor | None = None


class Step3p7VisionLanguageModel(VisionLanguageModel):
    def __init__(self, cfg: Step3p7Config):
        super().__init__(build(cfg.text), Step3p7Vision(cfg))
        self.image_token_id = self.marker_id = cfg.image_token_id
        self.delimiters: dict[str, int] | None = None

    def use_tokenizer(self, tokenizer) -> None:
        ids = {name: tokenizer.token_to_id(name) for name in DELIMITERS}
        if missing := [name for name, i in ids.items() if i is None]:
            raise ImageError(f"the tokenizer has no {', '.join(missing)}: Step 3.7 writes them around each image")
        self.delimiters = ids

    def preprocess(self, image) -> CroppedInput:
        cut, tower = self.image_processor()(image), self.vision.tower
        rows, cols = cut.plan.grid
        tokens = rows * cols * tower.num_tokens(cut.crops.shape[-1]) + tower.num_tokens(cut.global_view.shape[-1])
        return CroppedInput(cut.global_view, tokens, image_digest(image), (rows, cols), cut.crops)

    def expansion_ids(self, item: CroppedInput) -> list[int]:
        if self.delimiters is None:
            raise ImageError(f"Step 3.7 needs the model's tokenizer to find {', '.join(DELIMITERS)}")
        d, tower, image = self.delimiters, self.vision.tower, self.image_token_id
        rows, cols = item.grid
        crop_ids = [d["<patch_start>"]] + [image] * tower.num_tokens(item.crops.shape[-1]) + [d["<patch_end>"]]
        ids: list[int] = []
        for row in range(rows):
            ids += crop_ids * cols + ([d["<patch_newline>"]] if row < rows - 1 else [])
        return ids + [d["<im_start>"]] + [image] * tower.num_tokens(item.pixels.shape[-1]) + [d["<im_end>"]]

    def expansion_text(self, item: CroppedInput, tokenizer) -> str:
        return tokenizer.decode(self.expansion_ids(item))

    def encode(self, items: Sequence[CroppedInput]) -> list[torch.Tensor]:
        """Per image, its crops' features (crop after crop) then its global view's, as the placeholders run."""
        dtype = self.language.embed.weight.dtype
        views = self.vision.forward(torch.stack([it.pixels for it in items]))
        crops = torch.cat([it.crops for it in items])
        crop_features = self.vision.forward(crops) if len(crops) else views[:0]
        per_image = crop_features.split([len(it.crops) for it in items])
        return [torch.cat([c.flatten(0, 1), v]).to(dtype) for c, v in zip(per_image, views)]


VISION_SPEC = ArchitectureSpec(
    name="step3p7",
    architectures=("Step3p7ForConditionalGeneration",),
    read_config=read_vl_config,
    build=Step3p7VisionLanguageModel,
    description="StepFun Step 3.7 Flash: the Step 3.5 text model with a 2D-RoPE tower over a global view and local crops",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
    register(VISION_SPEC)
