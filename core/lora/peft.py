"""Reading PEFT LoRA adapters (``adapter_config.json`` + ``adapter_model.safetensors``).

Only what changes the math is checked: an option trellm does not implement (DoRA, trained biases,
modules saved whole, raw parameters other than MoE expert stacks, ...) is refused by name instead of being
silently dropped.

MoE experts come two ways: one module per expert (``...experts.3.gate_proj``, an adapter trained where the
experts were ``nn.Linear`` modules) or PEFT's ``target_parameters`` on the stacked expert tensors of
transformers 5 (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``; NemotronH's ungated ``experts.up_proj``),
read as :class:`ExpertStackFactors`.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import attrs
import torch

from ..errors import TrellmError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."

# (config key, the value that means "off", what the option does): any other value is refused
_UNSUPPORTED_OPTIONS = (
    ("use_dora", False, "DoRA (weight-decomposed LoRA)"),
    ("lora_bias", False, "a trained bias on lora_B"),
    ("bias", "none", "trained base-layer biases"),
    ("modules_to_save", None, "modules saved whole beside the adapter"),
    ("trainable_token_indices", None, "trained embedding rows"),
    ("layer_replication", None, "replicated layers"),
    ("use_qalora", False, "QALoRA"),
    ("velora_config", None, "VeLoRA"),
    ("kasa_config", None, "KaSA"),
    ("use_bdlora", None, "BD-LoRA"),
    ("alora_invocation_tokens", None, "activated LoRA (aLoRA)"),
)
# initialisations that leave the base weights changed unless the adapter was converted when saved
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# the stacked expert tensors ``target_parameters`` may name, in the order transformers defines them on the experts
# module: PEFT wraps them in that order, each wrapper around the last, so the first is the innermost
# (``experts.base_layer.lora_A``) and the last the outermost (``experts.lora_A``). Gated experts hold gate_up_proj and
# down_proj; ungated ones (NemotronH's) up_proj and down_proj
EXPERT_STACKS = ("gate_up_proj", "up_proj", "down_proj")


class LoraError(TrellmError):
    """A LoRA adapter is missing, malformed, unsupported, made for another base model, or unknown by name."""


@attrs.frozen
class LoraFactors:
    """One projection's update ``scale * b @ a``: a [rank, in], b [out, rank] (float32, on the CPU)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@attrs.frozen
class ExpertStackFactors:
    """PEFT's LoRA on one stacked expert tensor [E, out, in] (``target_parameters``): ``a`` [E * rank, in] expert-major
    and ``b`` [out, rank * E] expert-minor (PEFT's layout), so expert e's update is ``scale * b_e @ a_e`` with
    ``a_e = a.view(E, rank, in)[e]`` and ``b_e = b.view(out, rank, E)[:, :, e]``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    experts: int
    tensor: str = ""  # lora_A's name in the adapter file (errors name it)

    @property
    def rank(self) -> int:
        return self.a.shape[0] // self.experts

    def expert(self, e: int) -> LoraFactors:
        """Expert ``e``'s own factors."""
        a = self.a.view(self.experts, self.rank, -1)[e]
        b = self.b.view(self.b.shape[0], self.rank, self.experts)[:, :, e]
        return LoraFactors(a.contiguous(), b.contiguous(), self.scale)


@attrs.frozen
class PeftAdapter:
    """An adapter read from ``path``: its factors by module name as PEFT wrote it (transformers' module names, e.g.
    ``model.layers.0.self_attn.q_proj``, which a family's aliases map to its checkpoint's where they differ), the
    base-layer tensors it carries (``lm_head.base_layer.weight``) and its LoRA on stacked expert tensors by experts
    module and tensor name (``{"model.layers.0.mlp.experts": {"gate_up_proj": ...}}``)."""

    path: Path
    modules: dict[str, LoraFactors]
    base_layers: dict[str, torch.Tensor]
    base_model: str | None
    expert_stacks: dict[str, dict[str, ExpertStackFactors]] = attrs.field(factory=dict)

    @property
    def max_rank(self) -> int:
        stacks = [f.rank for by_name in self.expert_stacks.values() for f in by_name.values()]
        return max([f.rank for f in self.modules.values()] + stacks)


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key that matches the end of the name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_options(config: dict, where: Path) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoraError(f"{where}: peft_type {peft_type!r} is not supported; trellm loads LoRA adapters (peft_type 'LORA')")
    for key, off, what in _UNSUPPORTED_OPTIONS:
        value = config.get(key, off)
        if value not in (off, None, False, [], {}, "none"):
            raise LoraError(f"{where}: {key}={value!r} ({what}) is not supported by trellm's LoRA; "
                            "save the adapter without it or merge it into the base model")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise LoraError(f"{where}: init_lora_weights={init!r} changes the base weights; convert the adapter to plain LoRA "
                        "when saving it (PEFT: path_initial_model_for_weight_conversion)")
    r = config.get("r")
    if not isinstance(r, int) or r <= 0:
        raise LoraError(f"{where}: 'r' must be a positive integer, got {r!r}")


def read_peft_adapter(path: str | Path, scale: float = 1.0) -> PeftAdapter:
    """Read and check the PEFT adapter in directory ``path``; ``scale`` multiplies every update (on top of
    the adapter's own alpha / r, or alpha / sqrt(r) with rsLoRA)."""
    from safetensors import safe_open

    root = Path(path)
    if not root.is_dir():
        raise LoraError(f"{root}: no such adapter directory")
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not config_path.is_file():
        raise LoraError(f"{root}: {CONFIG_FILE} is missing (not a PEFT adapter directory)")
    if not weights_path.is_file():
        bins = " (adapter_model.bin is there: convert it to safetensors, trellm reads no pickles)" if (root / "adapter_model.bin").is_file() else ""
        raise LoraError(f"{root}: {WEIGHTS_FILE} is missing{bins}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"{config_path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{config_path}: expected a JSON object")
    _check_options(config, config_path)
    stack_targets = _expert_stack_parameters(config, config_path)
    r, alpha = config["r"], config.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))

    try:
        with safe_open(str(weights_path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise LoraError(f"{weights_path}: not a readable safetensors file ({exc})") from None

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    lora_a_names: dict[str, str] = {}  # module -> its lora_A tensor's name in the file
    base_layers: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        short = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", short)
        if m:
            pairs.setdefault(m.group(1), {})[m.group(2)] = t
            if m.group(2) == "lora_A":
                lora_a_names[m.group(1)] = name
        elif short.endswith(".base_layer.weight"):
            base_layers[short[: -len(".base_layer.weight")]] = t
        elif ".lora_embedding_" in short:
            raise LoraError(f"{weights_path}: tensor {name!r}: LoRA on an embedding table is not supported")
        elif "lora_magnitude_vector" in short:
            raise LoraError(f"{weights_path}: tensor {name!r}: DoRA magnitudes are not supported")
        else:
            raise LoraError(f"{weights_path}: tensor {name!r} is not a LoRA factor trellm knows (lora_A / lora_B)")
    if not pairs:
        raise LoraError(f"{weights_path}: holds no lora_A / lora_B tensors")
    stacks = _split_expert_stacks(pairs, stack_targets, weights_path) if stack_targets else {}

    def scaling(module: str, rank: int) -> float:
        alpha_m = _pattern_value(alpha_pattern, module, alpha)
        return float(alpha_m / math.sqrt(rank) if rslora else alpha_m / rank) * float(scale)

    expert_stacks: dict[str, dict[str, ExpertStackFactors]] = {}
    for (module, name), (wrapper, ab) in sorted(stacks.items()):
        a, b = ab["lora_A"], ab["lora_B"]
        tensor = f"{module}.{name}"  # the name PEFT looks patterns up under
        rank = _pattern_value(rank_pattern, tensor, r)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] % rank or a.shape[0] == 0 or b.shape[1] != a.shape[0]:
            raise LoraError(f"{weights_path}: {module} ({name}): lora_A {list(a.shape)} and lora_B {list(b.shape)} do not "
                            f"form rank-{rank} factors of stacked experts ([experts * {rank}, in] and [out, {rank} * experts])")
        expert_stacks.setdefault(module, {})[name] = ExpertStackFactors(a.float(), b.float(), scaling(tensor, rank),
                                                                         a.shape[0] // rank, lora_a_names.get(wrapper, ""))

    modules: dict[str, LoraFactors] = {}
    for module, ab in sorted(pairs.items()):
        for part in ("lora_A", "lora_B"):
            if part not in ab:
                raise LoraError(f"{weights_path}: {module}.{part}.weight is missing (the module has only the other factor)")
        a, b = ab["lora_A"], ab["lora_B"]
        rank = _pattern_value(rank_pattern, module, r)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraError(f"{weights_path}: {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not form a "
                            f"rank-{rank} pair ([{rank}, in] and [out, {rank}])")
        modules[module] = LoraFactors(a.float(), b.float(), scaling(module, rank))
    return PeftAdapter(root, modules, base_layers, config.get("base_model_name_or_path"), expert_stacks)


def _expert_stack_parameters(config: dict, where: Path) -> list[str]:
    """``target_parameters`` (each an expert stack, :data:`EXPERT_STACKS`: bare, or of named experts modules); any
    other parameter is refused by name."""
    targets = config.get("target_parameters") or []
    if isinstance(targets, str) or not isinstance(targets, list):
        raise LoraError(f"{where}: target_parameters must be a list of parameter names, got {targets!r}")
    for t in targets:
        owner, _, name = str(t).rpartition(".")  # a bare name (no owner) targets every module's parameter of that name
        if name not in EXPERT_STACKS or not (owner == "" or owner.endswith("experts")):
            raise LoraError(f"{where}: target_parameters names {t!r}; trellm adapts only the MoE expert stacks "
                            f"(experts.{' / experts.'.join(EXPERT_STACKS)}) among raw parameters")
    return [str(t) for t in targets]


def _split_expert_stacks(pairs: dict[str, dict[str, torch.Tensor]], targets: list[str],
                         where: Path) -> dict[tuple[str, str], tuple[str, dict[str, torch.Tensor]]]:
    """Take the expert-stack factors out of ``pairs`` (module -> its lora_A / lora_B): PEFT nests one wrapper per
    tensor of a module that ``targets`` names (as PEFT matches them: the whole name, or its tail after a dot), the
    first of :data:`EXPERT_STACKS` innermost, so ``M.base_layer.lora_A`` is ``gate_up_proj``'s and ``M.lora_A``
    ``down_proj``'s when both are targeted. Returns (experts module, tensor name) -> (its wrapper module, its factors)."""
    out: dict[tuple[str, str], tuple[str, dict[str, torch.Tensor]]] = {}
    for module in [m for m in pairs if m.rsplit(".", 1)[-1] == "experts" or m.endswith("experts.base_layer")]:
        depth, root = 0, module
        while root.endswith(".base_layer"):
            root, depth = root[: -len(".base_layer")], depth + 1
        names = [n for n in EXPERT_STACKS if any(f"{root}.{n}" == t or f"{root}.{n}".endswith(f".{t}") for t in targets)]
        if depth >= len(names):
            raise LoraError(f"{where}: {module}.lora_A.weight: more LoRA wrappers on {root!r} than the "
                            f"{len(names)} expert tensors target_parameters names ({', '.join(names)})")
        out[root, names[len(names) - 1 - depth]] = module, pairs.pop(module)
    return out
