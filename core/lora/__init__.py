"""LoRA adapters served beside the base weights: several at once, chosen per row of a batch.

A model's adapters live in one :class:`LoraSet` (``model.lora``). Each adapter gets a slot; every
projection an adapter targets has its :class:`~trellm.modules.linear.Linear` implementation wrapped in
a :class:`LoraWeights`, which holds that projection's factors of all slots stacked (``trellm.ops.lora_add``)
and adds the update of each row's adapter to whatever the base weights compute (dense or EXL3: quantized
weights cannot be merged). The row -> slot choice comes from the batch (``ForwardBatch.lora_slots``), bound
when the forward starts, so one captured CUDA graph serves every mix of adapters.

No route may skip an adapter: a LoraWeights is a ``WrappedWeights``, so ``trellm.ops.project`` hands it the
call. It applies the pre step (the update needs the normed or gated input anyway) and projects the base
weights through ``project`` again, keeping their fused routes: a sub-layer's last projection adds its
update to the residual before the base's fused residual add (so the sums of squares the next norm reads
include it); a q/k/v or gate/up group (:class:`LoraGroup`) runs its base group in one launch, adds every
part's update in one more (``trellm.ops.lora_add_parts``), then its post step (RoPE and the KV write).

MoE experts held one module per expert (per-expert checkpoint tensors, EXL3) take adapters like any projection;
an adapter on stacked expert tensors (PEFT's ``target_parameters``) is split into each expert's factors at load.
Expert dispatch regroups rows by expert, so it tells the adapters which token each row is
(:meth:`LoraSet.regrouped`); an expert collection that carries an adapter (``experts.lora`` is set) leaves its
sync-free pair kernels, which would skip the update, for the grouped path.

Under tensor parallel every rank has its own LoraSet holding its part of each adapter: a split projection's
factors are cut as its weights were (``Linear.split``: B's rows of a column shard, A's columns of a row shard),
checked first against the whole projection's shapes. The wrapper goes where the rank's own projection is: inside
a row shard's all-reduce and the head's vocabulary gather (the collective's ``shard``), so a row shard's partial
update is summed once with its partial output. Under expert parallel a rank keeps the factors of the routed experts
it holds (``HoldsSomeExperts``); the other experts' factors are the other ranks' to check and keep.
"""
from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import Any, Sequence

import attrs
import torch

from .. import ops
from ..capabilities import HoldsSomeExperts, implements
from ..modules.linear import Linear
from ..modules.base import Module
from ..modules.moe import ExpertCollection, ExpertList, Experts
from ..ops import Residual, WrappedWeights, project, projection_input
from ..ops.projection import WeightList, group_weights
from ..weights import Aliases, canonical_name
from .peft import WEIGHTS_FILE, ExpertStackFactors, LoraError, LoraFactors, PeftAdapter, read_peft_adapter

__all__ = ["LoraError", "LoraGroup", "LoraSet", "LoraWeights", "PeftAdapter", "read_peft_adapter", "lora_set", "adapter_root"]

# modules whose weight a family reads whole at load (MLA absorbs kv_b_proj into its attention): an update
# applied in their forward would be skipped, so adapters on them are refused
_READ_WHOLE = ("kv_b_proj",)
_uids = itertools.count(1)


class LoraWeights(WrappedWeights):
    """A projection's base implementation plus the LoRA factors of every adapter slot that targets it.

    ``a`` [slots * rank, in] and ``b`` [out, slots * rank] (scale folded into b) in the model dtype; rows
    of a slot that does not target this projection are zero. ``head``: the LM head, which sees the
    logits rows of a batch rather than its token rows.
    """

    def __init__(self, base: Any, owner: "LoraSet", key: str, in_features: int, out_features: int, head: bool):
        self.base, self.owner, self.key, self.head = base, owner, key, head
        self.in_features, self.out_features = in_features, out_features
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.targeted_by: set[int] = set()  # slots whose adapter targets this projection

    @property
    def carries(self) -> bool:
        """Whether any loaded adapter targets this projection."""
        return bool(self.targeted_by)

    # ---- the update ------------------------------------------------------------------------------

    def add_update(self, y: torch.Tensor, x: torch.Tensor, in_place: bool = True) -> torch.Tensor:
        """``y`` plus each row's adapter update of ``x``: written into y (made contiguous first if need be), or
        into a new tensor with ``in_place=False`` (y is someone else's, e.g. the residual stream)."""
        if not self.carries:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        slots = self.row_slots(x2)
        if slots is None:
            return y
        if not y.is_contiguous():
            y, in_place = y.contiguous(), True
        y2 = y.view(-1, y.shape[-1])
        out = ops.lora_add(y2, x2, self.a, self.b, slots, self.owner.rank, out=None if in_place else torch.empty_like(y2))
        return y if in_place else out.view(y.shape)

    def row_slots(self, x2: torch.Tensor) -> torch.Tensor | None:
        """The adapter slot of each row of ``x2`` [rows, in] (None: the batch names no adapters)."""
        return self.owner.rows(self.head, x2.shape[0], self.key, x2.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_update(self.base.forward(x), x)

    __call__ = forward

    def project(self, x, pre=None, post=None):
        """The update joins the residual before the base's fused add (its sums of squares then include it)."""
        xin = projection_input(x, pre)
        if isinstance(post, Residual):
            return project(xin, self.base, post=Residual(self.add_update(post.h, xin, in_place=False)))
        if post is not None:
            return project.reference(xin, self, None, post)
        return self.add_update(project(xin, self.base), xin)

    def grouped(self, parts):
        return LoraGroup(parts)

    def nbytes(self) -> int:
        own = sum(t.numel() * t.element_size() for t in (self.a, self.b) if t is not None)
        return self.base.nbytes() + own

    def dense_weight(self) -> torch.Tensor:
        raise LoraError(f"{self.key}: its weight is read whole while a LoRA adapter targets it; the update would be lost")


class LoraGroup(WrappedWeights):
    """q/k/v or gate/up of one x with adapters on some parts: the base parts' own group (one launch where their
    format has one), each part's update, then the post step."""

    def __init__(self, parts):
        self.parts = list(parts)
        self.base = group_weights([p.base if isinstance(p, LoraWeights) else p for p in self.parts])
        self.in_features = self.parts[0].in_features
        self.out_features = sum(p.out_features for p in self.parts)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[override]
        """The base group, then every adapted part's update in one ``lora_add_parts`` (one launch on CUDA)."""
        ys = list(self.base.forward(x))
        adapted = [i for i, p in enumerate(self.parts) if isinstance(p, LoraWeights) and p.carries]
        if not adapted:
            return ys
        x2 = x.reshape(-1, x.shape[-1])
        lead = self.parts[adapted[0]]
        slots = lead.row_slots(x2)
        if slots is None:
            return ys
        for i in adapted:
            ys[i] = ys[i].contiguous()
        ops.lora_add_parts([ys[i].view(-1, ys[i].shape[-1]) for i in adapted], x2, [self.parts[i].a for i in adapted],
                           [self.parts[i].b for i in adapted], slots, lead.owner.rank)
        return ys

    def project(self, x, pre=None, post=None):
        ys = self.forward(projection_input(x, pre))
        return ys if post is None else post.apply(*ys)

    nbytes = WeightList.nbytes
    dense_weight = WeightList.dense_weight


class _Loaded:
    def __init__(self, name: str, adapter: PeftAdapter, slot: int):
        self.name, self.adapter, self.slot = name, adapter, slot
        self.uid = next(_uids)  # tells a reloaded adapter of the same name from the old one (prefix-cache keys)


class LoraSet:
    """The adapters loaded into one model, by name. See the module docstring. ``aliases``: the family's other
    spellings of its module names (PEFT names an adapter's modules after the transformers class, whose module tree
    may differ from the checkpoint's names)."""

    def __init__(self, model: Any, aliases: Aliases = ()):
        self.model, self.aliases = model, aliases
        self.linears: dict[str, Linear] = {}
        self.fused: dict[str, list[Linear]] = {}  # a fused checkpoint tensor's parts (Phi-3 qkv_proj)
        # expert collections by key, outermost first (an Experts over its ExpertList; a family's own collection; this
        # rank's part of experts spread over the ranks, HoldsSomeExperts)
        self.experts: dict[str, Module] = {}
        for m in model.modules():
            if isinstance(m, Linear):
                self.linears[m.key] = m
                fused_key = getattr(m, "fused_key", None)
                if fused_key is not None:
                    self.fused.setdefault(fused_key, []).append(m)
            elif isinstance(m, ExpertCollection):
                self.experts.setdefault(m.key, m)
        self.head = getattr(model, "lm_head", None)
        emb = model.embed.weight
        self.dtype, self.device = emb.dtype, emb.device
        self.loaded: dict[str, _Loaded] = {}
        self.capacity = 0  # slots every wrapped projection has room for
        self.rank = 0  # rank each slot has room for
        self.version = 0  # bumped on every load/unload: captured CUDA graphs are stale after it
        self._token_slots: torch.Tensor | None = None
        self._logits_indices: torch.Tensor | None = None
        self._logit_slots: torch.Tensor | None = None
        self._on_device: dict = {}  # (head, device) -> this batch's slots there (a layer split's other devices)
        self._regrouped: torch.Tensor | None = None  # the token of each row an expert projects (expert dispatch)

    # ---- names and slots -------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self.loaded

    def names(self) -> list[str]:
        return list(self.loaded)

    def slot(self, name: str | None) -> int:
        """The slot of adapter ``name`` (-1 for None: the base model); raises LoraError for an unknown name."""
        if name is None:
            return -1
        try:
            return self.loaded[name].slot
        except KeyError:
            raise LoraError(f"no LoRA adapter named {name!r} is loaded; loaded: {sorted(self.loaded) or 'none'}") from None

    def uid(self, name: str | None) -> int:
        """A number naming this load of ``name`` (0 for the base model)."""
        return 0 if name is None else self.loaded[name].uid

    # ---- load / unload ---------------------------------------------------------------------------

    def _in_model_names(self, adapter: PeftAdapter) -> PeftAdapter:
        """``adapter`` with its modules named as this model names them (through the family's aliases)."""
        def known(name: str) -> bool:
            return name in self.linears or name in self.fused or name in self.experts or self._other_ranks_expert(name)

        def renamed(by_module: dict[str, Any]) -> dict[str, Any]:
            return {canonical_name(module, self.aliases, known): value for module, value in by_module.items()}

        return attrs.evolve(adapter, modules=renamed(adapter.modules), base_layers=renamed(adapter.base_layers),
                            expert_stacks=renamed(adapter.expert_stacks))

    def _targets(self, adapter: PeftAdapter) -> list[tuple[Linear, LoraFactors]]:
        """(projection, its factors) for every module of ``adapter``, checked against this model (nothing
        changes yet, so a bad adapter loses nothing)."""
        named: list[tuple[str, Linear, LoraFactors]] = []  # (the adapter tensors' name, projection, factors)
        for module, f in adapter.modules.items():
            if self._other_ranks_expert(module):
                continue  # the rank holding the expert checks and keeps its factors
            if module.rsplit(".", 1)[-1] in _READ_WHOLE:
                raise LoraError(f"{adapter.path}: targets {module!r}, whose weight this model reads whole at load "
                                "(absorbed into attention); LoRA on it is not supported")
            if module in self.linears:
                self._check_loaded(adapter, module, self.linears[module])
                named.append((module, self.linears[module], f))
            elif module in self.fused:  # split B by the parts' rows (of the whole projections); A is shared
                if f.b.shape[0] != self.fused[module][0].fused_rows:
                    raise LoraError(f"{adapter.path}: tensor {module + '.lora_B.weight'!r} has shape {list(f.b.shape)}, "
                                    f"the base's {module!r} has {self.fused[module][0].fused_rows} output rows "
                                    "(an adapter for another base model?)")
                for lin in sorted(self.fused[module], key=lambda p: p.start):
                    named.append((module, lin, LoraFactors(f.a, f.b[lin.start: lin.start + whole_size(lin)[1]], f.scale)))
            else:
                raise LoraError(f"{adapter.path}: targets module {module!r}, which this model does not have "
                                f"(an adapter for another base model, or a module trellm does not adapt)")
        for module, by_name in adapter.expert_stacks.items():
            for name, stack in by_name.items():
                named += self._expert_stack_targets(adapter, module, name, stack)
        out: list[tuple[Linear, LoraFactors]] = []
        for module, lin, part in named:
            if lin.impl is None:
                raise LoraError(f"{lin.key}: the model is not loaded")
            in_features, out_features = whole_size(lin)
            want_a, want_b = (part.rank, in_features), (out_features, part.rank)
            for tname, t, want in (("lora_A", part.a, want_a), ("lora_B", part.b, want_b)):
                if tuple(t.shape) != want:
                    raise LoraError(f"{adapter.path}: tensor {module + '.' + tname + '.weight'!r} has shape "
                                    f"{list(t.shape)}, the base model's {lin.key!r} needs {list(want)} "
                                    f"(in {in_features}, out {out_features}): an adapter for another base model")
            if lin.split is not None:  # this rank's part (tensor parallel)
                part = LoraFactors(*lin.split.factors(part.a, part.b), part.scale)
            out.append((lin, part))
        for module, base_weight in adapter.base_layers.items():
            lin = self.linears.get(module)
            shape = whole_size(lin)[::-1] if lin is not None else None
            if shape is not None and tuple(base_weight.shape) != shape:
                raise LoraError(f"{adapter.path}: tensor {module + '.base_layer.weight'!r} has shape {list(base_weight.shape)}, "
                                f"the base model's {module!r} has {list(shape)}: an adapter for another base model")
        return out

    def _other_ranks_expert(self, module: str) -> bool:
        """Whether ``module`` is a projection of one routed expert (``{experts}.{e}.up_proj``) another rank holds
        (expert parallel)."""
        parts = module.rsplit(".", 2)
        owner = self.experts.get(parts[0]) if len(parts) == 3 and parts[1].isdigit() else None
        if not implements(owner, HoldsSomeExperts):
            return False
        e = int(parts[1])
        return e < owner.whole_experts and not owner.start <= e < owner.stop

    def _check_loaded(self, adapter: PeftAdapter, module: str, lin: Linear) -> None:
        """A per-expert projection of experts this model holds as stacked tensors has no weights of its own."""
        owner = self.experts.get(module.rsplit(".", 2)[0])
        if lin.impl is None and isinstance(owner, Experts) and owner.layout == "stacked":
            raise _stacked_experts_error(f"{adapter.path}: targets {module!r}, but", owner.key)

    def _expert_stack_targets(self, adapter: PeftAdapter, module: str, name: str,
                              stack: ExpertStackFactors) -> list[tuple[str, Linear, LoraFactors]]:
        """Each expert's projections and factors for PEFT's LoRA on the stacked tensor ``module.name``."""
        where = f"{adapter.path / WEIGHTS_FILE}: tensor {stack.tensor!r} ({name})"
        owner = self.experts.get(module)
        if owner is None:
            raise LoraError(f"{where} targets experts {module!r}, which this model does not have "
                            "(an adapter for another base model)")
        if implements(owner, HoldsSomeExperts):  # expert parallel: this rank's experts, numbered from ``start``
            held, first, whole = owner.per_expert, owner.start, owner.whole_experts
        else:
            experts = owner.active if isinstance(owner, Experts) else owner
            held = experts.experts if isinstance(experts, ExpertList) else None
            first, whole = 0, experts.num_experts
        if held is None:
            raise _stacked_experts_error(f"{where}:", module)
        gated = all(mlp.gate_proj is not None for mlp in held)
        if (name, gated) in (("gate_up_proj", False), ("up_proj", True)):
            have = "have no gate (down(act(up(x))))" if not gated else "are gated (a gate_up_proj stack)"
            raise LoraError(f"{where} targets experts {module!r}, whose experts {have}: an adapter for another base "
                            "model")
        if stack.experts != whole:
            raise LoraError(f"{where} has shape {list(stack.a.shape)}: factors for {stack.experts} "
                            f"experts of rank {stack.rank}, the base model's {module!r} has {whole}")
        out = []
        for e, mlp in enumerate(held, start=first):
            f = stack.expert(e)
            if name != "gate_up_proj":  # down_proj, or an ungated expert's up_proj
                out.append((f"{module}.{name}", getattr(mlp, name), f))
                continue
            rows = mlp.gate_proj.out_features
            if f.b.shape[0] != 2 * rows:
                raise LoraError(f"{adapter.path}: tensor {module + '.lora_B.weight'!r} ({name}) has {f.b.shape[0]} output "
                                f"rows, the base model's {module!r} needs {2 * rows} (gate then up): an adapter for "
                                "another base model")
            out.append((f"{module}.{name}", mlp.gate_proj, LoraFactors(f.a, f.b[:rows], f.scale)))
            out.append((f"{module}.{name}", mlp.up_proj, LoraFactors(f.a, f.b[rows:], f.scale)))
        return out

    def load(self, path: str | Path | PeftAdapter, name: str | None = None, scale: float = 1.0) -> str:
        """Load a PEFT adapter directory under ``name`` (default: the directory's name); returns the name."""
        adapter = self._in_model_names(path if isinstance(path, PeftAdapter) else read_peft_adapter(path, scale))
        name = name or adapter.path.name
        if name in self.loaded:
            raise LoraError(f"a LoRA adapter named {name!r} is already loaded; unload it first or pick another name")
        targets = self._targets(adapter)
        used = {l.slot for l in self.loaded.values()}
        slot = next(s for s in itertools.count() if s not in used)
        self._ensure_room(slot + 1, adapter.max_rank, [lin for lin, _ in targets])
        for lin, f in targets:
            w = adapted(lin)
            rows = slice(slot * self.rank, slot * self.rank + f.rank)
            w.a[rows] = f.a.to(w.a.device, self.dtype)
            w.b[:, rows] = (f.b * f.scale).to(w.b.device, self.dtype)
            w.targeted_by.add(slot)
        self.loaded[name] = _Loaded(name, adapter, slot)
        self.version += 1
        self._mark_experts()
        return name

    def unload(self, name: str) -> None:
        """Forget adapter ``name``; its slot's factors are zeroed (raises LoraError for an unknown name)."""
        slot = self.slot(name)
        rows = slice(slot * self.rank, (slot + 1) * self.rank)
        for w in self._wrapped():
            if slot in w.targeted_by:
                w.a[rows] = 0
                w.b[:, rows] = 0
                w.targeted_by.discard(slot)
        del self.loaded[name]
        self.version += 1
        self._mark_experts()

    def _mark_experts(self) -> None:
        """``experts.lora`` on every expert collection: this set where an adapter targets one of its experts (their
        dispatch then tells the adapters each row's token and skips the pair kernels), else None."""
        for owner in self.experts.values():
            experts = owner.active if isinstance(owner, Experts) else owner
            experts.lora = self if any(isinstance(p, Linear) and (w := adapted(p)) is not None and w.carries
                                       for p in experts.modules()) else None

    @contextlib.contextmanager
    def regrouped(self, tokens: torch.Tensor):
        """Within the block, a projection's rows are the batch's tokens ``tokens`` [rows] (expert dispatch's order)."""
        outer, self._regrouped = self._regrouped, tokens
        try:
            yield
        finally:
            self._regrouped = outer

    def _wrapped(self) -> list[LoraWeights]:
        return [w for w in map(adapted, self.linears.values()) if w is not None]

    def _ensure_room(self, slots: int, rank: int, linears: list[Linear]) -> None:
        """Every wrapped projection (and ``linears``, wrapped now) with room for ``slots`` slots of ``rank``."""
        new_cap, new_rank = max(self.capacity, slots), max(self.rank, rank)
        if (new_cap, new_rank) != (self.capacity, self.rank):
            for w in self._wrapped():
                w.a, w.b = self._moved(w.a, w.b, w.in_features, w.out_features, new_cap, new_rank, w.a.device)
            self.capacity, self.rank = new_cap, new_rank
        for lin in linears:
            if adapted(lin) is None:
                holder, attr = _seat(lin)
                inner = getattr(holder, attr)  # its sizes are the rank's part under tensor parallel
                w = LoraWeights(inner, self, lin.key, inner.in_features, inner.out_features, lin is self.head)
                w.a, w.b = self._moved(None, None, w.in_features, w.out_features, self.capacity, self.rank,
                                       lin.device or self.device)
                setattr(holder, attr, w)

    def _moved(self, a, b, in_features: int, out_features: int, cap: int, rank: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed factor stacks on ``device`` (the projection's) for ``cap`` slots of ``rank``, holding what
        ``a``/``b`` held slot by slot."""
        new_a = torch.zeros(cap * rank, in_features, dtype=self.dtype, device=device)
        new_b = torch.zeros(out_features, cap * rank, dtype=self.dtype, device=device)
        if a is not None:
            old_rank = a.shape[0] // max(self.capacity, 1)
            for s in range(self.capacity):
                new_a[s * rank: s * rank + old_rank] = a[s * old_rank: (s + 1) * old_rank]
                new_b[:, s * rank: s * rank + old_rank] = b[:, s * old_rank: (s + 1) * old_rank]
        return new_a, new_b

    # ---- rows of the running batch ---------------------------------------------------------------

    def bind(self, batch: Any) -> None:
        """Take the running batch's row -> slot choice (``batch.lora_slots``, None: every row on the base)."""
        self._token_slots = getattr(batch, "lora_slots", None)
        self._logits_indices = batch.logits_indices
        self._logit_slots = None
        self._on_device = {}

    def rows(self, head: bool, n: int, key: str, device: torch.device | None = None) -> torch.Tensor | None:
        """The slot of each of the ``n`` rows a projection sees (the LM head: the logits rows), on ``device`` (the
        projection's: under a layer split, copied there once per batch)."""
        slots = self._token_slots
        if slots is None:
            return None
        if self._regrouped is not None and not head:
            slots = slots[self._regrouped.to(slots.device)]
            return slots if device is None else slots.to(device)
        if head and self._logits_indices is not None:
            if self._logit_slots is None:
                self._logit_slots = slots[self._logits_indices.to(slots.device)]
            slots = self._logit_slots
        if slots.shape[0] != n:
            raise LoraError(f"{key}: projects {n} rows but the batch names adapters for {slots.shape[0]}; "
                            "this route regroups rows without telling the adapters")
        if device is not None and slots.device != device:
            moved = self._on_device.get((head, device))
            if moved is None:
                moved = self._on_device[head, device] = slots.to(device)
            slots = moved
        return slots


def _stacked_experts_error(what: str, experts_key: str) -> LoraError:
    """The refusal of an adapter on experts a checkpoint keeps as 3-D tensors (no per-expert projection to wrap)."""
    return LoraError(f"{what} this checkpoint stores {experts_key!r} as stacked 3-D tensors, which LoRA cannot adapt "
                     "yet (per-expert tensors and EXL3 experts can)")


def whole_size(lin: Linear) -> tuple[int, int]:
    """(in, out) features of the whole projection ``lin`` is (a part of, under tensor parallel)."""
    split = lin.split
    return (lin.in_features, lin.out_features) if split is None else (split.in_features, split.out_features)


def _seat(lin: Linear) -> tuple[Any, str]:
    """(object, attribute) holding the weights an adapter on ``lin`` wraps: under tensor parallel, the rank's own
    projection inside a collective that follows it (a row shard's all-reduce, the head's vocabulary gather: its
    ``shard``), so the update is part of what the collective sums or gathers, added once; else ``lin.impl``."""
    if lin.split is not None and hasattr(lin.impl, "shard"):
        return lin.impl, "shard"
    return lin, "impl"


def adapted(lin: Linear) -> LoraWeights | None:
    """The LoraWeights wrapping ``lin``'s weights, None when no adapter was ever loaded on it."""
    holder, attr = _seat(lin)
    w = getattr(holder, attr)
    return w if isinstance(w, LoraWeights) else None


def lora_set(model: Any, create: bool = True) -> LoraSet | None:
    """The :class:`LoraSet` of ``model`` (a module tree, or a multimodal model's language model), made on
    first use with ``create``."""
    target = getattr(model, "language", model)
    found = getattr(target, "lora", None)
    if found is None and create:
        found = LoraSet(target, model.aliases)
        target.lora = found
    return found


def adapter_root(uid: int) -> bytes:
    """The prefix-cache root name of pages computed with the adapter load ``uid`` (0: the base model)."""
    from ..cache.prefix import ROOT_HASH

    return ROOT_HASH if uid == 0 else ROOT_HASH + b"/lora/" + str(uid).encode()
