"""EXL3 inside HF transformers: ``import trellm.integrations.transformers`` registers ``quant_method: exl3``.

Afterwards ``AutoModelForCausalLM.from_pretrained(EXL3_DIR)`` builds the transformers model and replaces
each ``nn.Linear`` whose weights the checkpoint holds in EXL3 form with :class:`EXL3HFLinear`, which runs
trellm's EXL3 op (its CUDA kernels on CUDA tensors, the torch reference elsewhere). This is how
transformers' own quantization backends plug in (a ``QuantizationConfigMixin`` and an ``HfQuantizer``
registered by method name). Dense checkpoints are untouched: the quantizer runs only for ``exl3`` configs.

The EXL3 tensors are read by trellm's own store after transformers has loaded everything else, so
transformers never casts them (its loader would turn the fp16 sign/scale vectors into the model dtype).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..errors import WeightError
from ..modules.base import LoadContext
from ..model import note_decoded
from ..modules.linear import Linear
from ..weights import WeightStore

QUANT_METHOD = "exl3"
# The tensors an EXL3 module stores besides ``.bias`` (see exl3_format.md).
_EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")


class EXL3HFLinear(torch.nn.Module):
    """An ``nn.Linear`` stand-in whose projection is trellm's EXL3 :class:`~trellm.modules.linear.Linear`.

    It has no parameters of its own (transformers leaves it alone while loading); :func:`load_exl3_linears`
    fills it after the rest of the model is loaded.
    """

    def __init__(self, key: str, in_features: int, out_features: int):
        super().__init__()
        self.key, self.in_features, self.out_features = key, in_features, out_features
        self.linear = Linear(key, in_features, out_features, bias=None)
        self._loaded = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._loaded:
            raise RuntimeError(f"{self.key}: EXL3 weights not loaded (load the model with from_pretrained)")
        # trellm's projections take [rows, in] (its CUDA kernels read x as one row-major matrix).
        y = self.linear.forward(x.reshape(-1, self.in_features).contiguous())
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, exl3"


@register_quantization_config(QUANT_METHOD)
class EXL3Config(QuantizationConfigMixin):
    """``quantization_config`` of an EXL3 checkpoint (what ``trellm convert`` and ExLlamaV3 write).

    Only ``quant_method`` matters for loading (bits and codebook are read from each tensor); the other
    fields are kept so that ``to_dict`` writes them back unchanged.
    """

    def __init__(self, quant_method: str = QUANT_METHOD, modules_to_not_convert: list[str] | None = None, **fields: Any):
        self.quant_method = quant_method
        self.modules_to_not_convert = modules_to_not_convert
        self.fields = fields
        for name, value in fields.items():
            setattr(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, **self.fields}


def _exl3_keys(checkpoint_files: list[str]) -> set[str]:
    """Module names that the checkpoint holds in EXL3 form (those with a ``.trellis`` tensor)."""
    from safetensors import safe_open

    keys = set()
    for path in checkpoint_files:
        with safe_open(path, framework="pt") as f:
            keys.update(name[: -len(".trellis")] for name in f.keys() if name.endswith(".trellis"))
    return keys


def replace_exl3_linears(model: torch.nn.Module, exl3_keys: set[str]) -> list[str]:
    """Swap every ``nn.Linear`` named in ``exl3_keys`` for an :class:`EXL3HFLinear`; the names swapped."""
    swapped = []
    for name, module in list(model.named_modules()):
        if name in exl3_keys and isinstance(module, torch.nn.Linear):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, EXL3HFLinear(name, module.in_features, module.out_features))
            swapped.append(name)
    return swapped


def load_exl3_linears(model: torch.nn.Module, model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> int:
    """Load every :class:`EXL3HFLinear` of ``model`` from ``model_dir`` with trellm's loader; how many."""
    from .. import registry

    store = WeightStore(model_dir)
    ctx = LoadContext(store=store, device=device, dtype=dtype, quant_formats=registry.quant_formats())
    count = 0
    for module in model.modules():
        if isinstance(module, EXL3HFLinear):
            module.linear.load(ctx)
            module._loaded = True
            count += 1
    note_decoded(ctx, QUANT_METHOD.upper(), stacklevel=3)
    return count


def _untie_swapped(model: torch.nn.Module, swapped: set[str]) -> None:
    """An EXL3 head is stored on its own (``lm_head.*``) even where the dense model tied it to the
    embedding: drop the tie so that transformers does not look for the swapped layer's ``weight``."""
    if "lm_head" in swapped or any(n.endswith(".lm_head") for n in swapped):
        for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            config.tie_word_embeddings = False
    for module_name, module in model.named_modules():
        tied = getattr(module, "all_tied_weights_keys", None)
        if tied:
            prefix = f"{module_name}." if module_name else ""
            for target in list(tied):
                if (prefix + target).rpartition(".")[0] in swapped:
                    del tied[target]


@register_quantizer(QUANT_METHOD)
class EXL3HFQuantizer(HfQuantizer):
    """Loads pre-quantized EXL3 checkpoints into transformers models (no quantization on the fly)."""

    requires_calibration = True

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        if not self.pre_quantized:
            raise ValueError("trellm's EXL3 backend loads EXL3 checkpoints; convert a model with `trellm convert` first")

    def _process_model_before_weight_loading(self, model: torch.nn.Module, checkpoint_files: list[str] | None = None, **kwargs: Any) -> None:
        if not checkpoint_files:
            raise WeightError("EXL3 in transformers: no safetensors checkpoint files to read")
        self._model_dir = Path(checkpoint_files[0]).parent
        swapped = replace_exl3_linears(model, _exl3_keys(checkpoint_files))
        if not swapped:
            raise WeightError(f"{self._model_dir}: quant_method is exl3, but no linear layer of the model has EXL3 tensors")
        # The EXL3 tensors (and the biases of swapped layers) are read by trellm after loading: tell
        # transformers they are expected to be left over.
        names = "|".join(re.escape(n) for n in swapped)
        pattern = rf"^({names})\.({'|'.join(_EXL3_SUFFIXES)}|bias)$"
        model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | {pattern}
        _untie_swapped(model, set(swapped))

    def _process_model_after_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        reference = next((p for p in model.parameters()), None)
        device = reference.device if reference is not None else torch.device("cpu")
        dtype = reference.dtype if reference is not None and reference.is_floating_point() else torch.float16
        load_exl3_linears(model, self._model_dir, device, dtype)
        return model

    @property
    def is_trainable(self) -> bool:
        return False

    def is_serializable(self, safe_serialization: Any = None) -> bool:
        return False
