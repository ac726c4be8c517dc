"""The MoE recipes several families share: DeepSeek-style (DeepSeek-V3, GLM 4.5, dots.llm1, Solar Open ...)
and Qwen3-style (Qwen3 MoE, Qwen3-VL MoE), and the helper that turns a dense decoder into a MoE one layer by layer."""
from __future__ import annotations

from typing import Callable

from trellm.config import DecoderConfig
from trellm.errors import ConfigError
from trellm.modules.base import Module
from trellm.modules.layers import GatedMLP
from trellm.modules.moe import Experts, MoE, Router, ScoreTopK, SoftmaxTopK


def replace_mlps(model, make_mlp: Callable[[int, str], Module | None]) -> None:
    """Swap the MLP of decoder layer i for ``make_mlp(i, layer_key)`` where it returns a module.

    Lets a family start from :func:`~trellm.sdk.build_decoder` and only say which layers are MoE,
    instead of re-composing the whole decoder.
    """
    for i, layer in enumerate(model.layers):
        mlp = make_mlp(i, layer.key)
        if mlp is not None:
            layer.mlp = mlp


def mlp_layer_types(cfg: DecoderConfig) -> tuple[str, ...]:
    """Per layer, ``"dense"`` or ``"sparse"`` (MoE) as ``mlp_layer_types`` lists them (Hy3, Laguna); without the
    key, the first layer is dense and the rest sparse."""
    n = cfg.num_hidden_layers
    kinds = tuple(cfg.extra.get("mlp_layer_types") or ("dense",) + ("sparse",) * (n - 1))
    if len(kinds) != n or set(kinds) - {"dense", "sparse"}:
        raise ConfigError(f"config.json: mlp_layer_types must list 'dense' or 'sparse' for each of the {n} layers, got {list(kinds)!r}")
    return kinds


def deepseek_moe(cfg: DecoderConfig, key: str, correction_bias: bool = True, shared_name: str = "shared_experts",
                 router_name: str = "gate", correction_bias_name: str = "gate.e_score_correction_bias") -> MoE:
    """The DeepSeek-V3 style MoE block: sigmoid scores (``scoring_func``), ``e_score_correction_bias``
    steering the choice, optional expert groups, ``routed_scaling_factor``, and ``n_shared_experts``
    always-on experts fused into one MLP of ``n_shared * moe_intermediate_size``. The ``*_name`` arguments
    are the tensor names under ``key`` where a family's checkpoints differ (Hy3: ``router.gate``)."""
    moe = cfg.require_moe()
    size = moe.expert_width()
    strategy = ScoreTopK(
        moe.experts_per_token,
        score=moe.scoring_func or "sigmoid",
        normalize=True if moe.normalize_topk is None else moe.normalize_topk,
        scaling=moe.routed_scaling,
        num_groups=moe.num_groups,
        topk_groups=moe.topk_groups,
    )
    router = Router(
        f"{key}.{router_name}", cfg.hidden_size, moe.num_experts, strategy,
        correction_bias_key=f"{key}.{correction_bias_name}" if correction_bias else None, float32_logits=True,
    )
    n_shared = moe.num_shared_experts
    shared = GatedMLP(f"{key}.{shared_name}", cfg.hidden_size, size * n_shared, cfg.hidden_act) if n_shared else None
    return MoE(key, router, Experts(f"{key}.experts", moe.num_experts, cfg.hidden_size, size, cfg.hidden_act), shared)


def use_deepseek_moe_layers(model, cfg: DecoderConfig) -> None:
    """DeepSeek-V3 layout: the first ``first_k_dense_replace`` layers keep their dense MLP, every later one
    gets a :func:`deepseek_moe` block at ``{layer}.mlp``."""
    first_moe = cfg.require_moe().first_dense_layers
    replace_mlps(model, lambda i, key: deepseek_moe(cfg, f"{key}.mlp") if i >= first_moe else None)


def use_qwen3_moe_layers(model, cfg: DecoderConfig, normalize: bool | None = None) -> None:
    """Qwen3 MoE layout: softmax top-k routing and no shared experts, at ``{layer}.mlp.gate`` / ``.experts`` on
    the layers ``decoder_sparse_step`` and ``mlp_only_layers`` leave MoE. The top-k weights are renormalised
    when ``normalize`` says so (None: as ``norm_topk_prob`` says; Qwen3-VL MoE always renormalises)."""
    moe = cfg.require_moe()
    strategy = SoftmaxTopK(moe.experts_per_token, normalize=bool(moe.normalize_topk) if normalize is None else normalize)

    def make(i: int, key: str) -> MoE | None:
        if not moe.is_moe_layer(i):
            return None
        return MoE(f"{key}.mlp", Router(f"{key}.mlp.gate", cfg.hidden_size, moe.num_experts, strategy),
                   Experts(f"{key}.mlp.experts", moe.num_experts, cfg.hidden_size, moe.expert_width(), cfg.hidden_act))

    replace_mlps(model, make)
