"""SigLIP vision tower (``siglip_vision_model``): patch embedding, learned positions, pre-norm ViT.

Images are resized to one fixed size, so the tower always sees ``(image_size / patch_size) ** 2``
patches and the learned position table is used as it is (no interpolation). Attention is full
(bidirectional) within each image. The output is the post-LayerNorm hidden state of every patch;
the pooling head is not used by the language models that embed SigLIP (Gemma 3, PaliGemma).
"""
from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F

import trellm
from trellm.sdk import (
    ConfigError,
    FixedSizeProcessor,
    LayerNorm,
    Linear,
    LoadContext,
    Module,
    VisionTowerSpec,
    activation_fn,
)


@attrs.frozen
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "SiglipConfig":
        try:
            cfg = cls(
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=int(raw["num_attention_heads"]),
                image_size=int(raw["image_size"]),
                patch_size=int(raw["patch_size"]),
                num_channels=int(raw.get("num_channels", 3)),
                layer_norm_eps=float(raw.get("layer_norm_eps", 1e-6)),
                hidden_act=str(raw.get("hidden_act", "gelu_pytorch_tanh")),
            )
        except KeyError as e:
            raise ConfigError(f"config.json: vision_config is missing {e.args[0]!r}") from None
        if cfg.image_size % cfg.patch_size or cfg.hidden_size % cfg.num_attention_heads:
            raise ConfigError(f"config.json: vision_config image_size {cfg.image_size} / patch_size {cfg.patch_size} "
                              f"or hidden_size {cfg.hidden_size} / heads {cfg.num_attention_heads} do not divide")
        return cfg

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipLayer(Module):
    """x + attn(ln1(x)); x + fc2(act(fc1(ln2(x)))), all projections with bias."""

    def __init__(self, key: str, cfg: SiglipConfig):
        d, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.key, self.num_heads = key, cfg.num_attention_heads
        self.layer_norm1 = LayerNorm(f"{key}.layer_norm1", d, eps)
        self.layer_norm2 = LayerNorm(f"{key}.layer_norm2", d, eps)
        self.q_proj = Linear(f"{key}.self_attn.q_proj", d, d, True)
        self.k_proj = Linear(f"{key}.self_attn.k_proj", d, d, True)
        self.v_proj = Linear(f"{key}.self_attn.v_proj", d, d, True)
        self.out_proj = Linear(f"{key}.self_attn.out_proj", d, d, True)
        self.fc1 = Linear(f"{key}.mlp.fc1", d, cfg.intermediate_size, True)
        self.fc2 = Linear(f"{key}.mlp.fc2", cfg.intermediate_size, d, True)
        self._act = activation_fn(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N images, P patches, D]."""
        n, p, d = x.shape
        h = self.layer_norm1.forward(x)
        split = lambda t: t.view(n, p, self.num_heads, d // self.num_heads).transpose(1, 2)  # noqa: E731
        o = F.scaled_dot_product_attention(split(self.q_proj(h)), split(self.k_proj(h)), split(self.v_proj(h)))
        x = x + self.out_proj(o.transpose(1, 2).reshape(n, p, d))
        return x + self.fc2(self._act(self.fc1(self.layer_norm2.forward(x))))


class SiglipVisionTower(Module):
    """pixels [N, 3, S, S] -> patch features [N, (S / patch) ** 2, hidden]."""

    def __init__(self, key: str, cfg: SiglipConfig):
        self.key, self.cfg = key, cfg
        self.patch_weight = self.patch_bias = self.position_embedding = None
        self.layers = [SiglipLayer(f"{key}.encoder.layers.{i}", cfg) for i in range(cfg.num_hidden_layers)]
        self.post_layernorm = LayerNorm(f"{key}.post_layernorm", cfg.hidden_size, cfg.layer_norm_eps)

    def load(self, ctx: LoadContext) -> None:
        c, get = self.cfg, ctx.store.get
        emb = f"{self.key}.embeddings"
        self.patch_weight = get(f"{emb}.patch_embedding.weight", shape=(c.hidden_size, c.num_channels, c.patch_size, c.patch_size),
                                dtype=ctx.dtype, device=ctx.device)
        self.patch_bias = get(f"{emb}.patch_embedding.bias", shape=(c.hidden_size,), dtype=ctx.dtype, device=ctx.device)
        self.position_embedding = get(f"{emb}.position_embedding.weight", shape=(c.patches_per_side**2, c.hidden_size),
                                      dtype=ctx.dtype, device=ctx.device)
        super().load(ctx)

    def unload(self) -> None:
        self.patch_weight = self.patch_bias = self.position_embedding = None
        super().unload()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if pixels.shape[1:] != (c.num_channels, c.image_size, c.image_size):
            raise ValueError(f"{self.key}: pixels of shape {list(pixels.shape)}, expected [N, {c.num_channels}, {c.image_size}, {c.image_size}]")
        x = F.conv2d(pixels.to(self.patch_weight.dtype), self.patch_weight, self.patch_bias, stride=c.patch_size)
        x = x.flatten(2).transpose(1, 2) + self.position_embedding
        for layer in self.layers:
            x = layer.forward(x)
        return self.post_layernorm.forward(x)


def build(vision_config: dict[str, Any], key: str) -> SiglipVisionTower:
    return SiglipVisionTower(key, SiglipConfig.from_hf(vision_config))


def processor(preprocessor_config: dict[str, Any], vision_config: dict[str, Any]) -> FixedSizeProcessor:
    return FixedSizeProcessor.from_config(preprocessor_config, int(vision_config["image_size"]))


SPEC = VisionTowerSpec(
    name="siglip",
    model_types=("siglip_vision_model",),
    build=build,
    processor=processor,
    description="SigLIP ViT: fixed-size images, learned patch positions, full attention",
)


@trellm.hookimpl
def trellm_register_vision_towers(register):
    register(SPEC)
