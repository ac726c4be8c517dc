"""EXL3 as a :class:`~trellm.quant.QuantFormat`: detect the tensors of a module, load an EXL3Linear.

A module ``key`` is EXL3 when the store holds ``{key}.trellis`` plus ``{key}.suh`` (or legacy packed
signs ``{key}.su``) plus ``{key}.svh`` (or ``{key}.sv``). K comes from the trellis shape; the codebook
from the optional 0-dim marker ``{key}.mcg`` / ``{key}.mul1`` (neither: 3INST). Stored dims are
padded to multiples of 128: inputs narrower than the padded width are zero-extended and outputs
trimmed to the module's true width.
"""
from __future__ import annotations

import warnings

import attrs
import torch

from ...errors import WeightError

from ...ops.moe import expert_inputs, exl3_experts_down, exl3_experts_gate_up
from ...ops.exl3 import CODEBOOK_MULTIPLIERS, exl3_decode_tiles, exl3_matmul, exl3_matmul_group, hadamard_128
from ...ops.projection import RowNorm, WeightList, Weights
from ...weights import WeightStore
from .quantize import QuantizedTensors, quantize_group


def _as_int32(value: int) -> int:
    return value - (1 << 32) if value >= (1 << 31) else value


MARKER_VALUES = {name: _as_int32(mult) for name, mult in CODEBOOK_MULTIPLIERS.items()}


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Legacy ``su``/``sv``: int16 [m] sign bits -> fp16 [16m] of +-1 (bit i of word j is element 16j+i; set = -1)."""
    bits = (packed.to(torch.int64).unsqueeze(-1) >> torch.arange(16, device=packed.device)) & 1
    return (1 - 2 * bits).reshape(-1).to(torch.float16)


_DECODE_BYTES = 1 << 28  # the bit unpacking's working memory per slice of :meth:`EXL3Linear.dense_weight`


def _had_rows(x: torch.Tensor) -> torch.Tensor:
    return hadamard_128(x.t().contiguous()).t()


class EXL3Linear(Weights):
    """A loaded EXL3 linear: ``forward`` runs ``trellm.ops.exl3_matmul`` on the padded tensors. The fused
    routes around it (norm in, residual add out, gated activation) are ``trellm.ops.project``'s.

    Where no kernel runs EXL3 (the CPU, whose reference decodes every weight at every call), :meth:`decode`
    keeps the dense weight beside the EXL3 tensors and ``forward`` multiplies by it; the EXL3 tensors stay
    (saving, sharding, the transformers bridge and LoRA read them).
    """

    def __init__(
        self,
        trellis: torch.Tensor,
        suh: torch.Tensor,
        svh: torch.Tensor,
        codebook: str,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
        key: str = "<exl3>",
    ):
        if trellis.dtype != torch.int16 or trellis.dim() != 3 or trellis.shape[2] % 16 or not 1 <= trellis.shape[2] // 16 <= 8:
            raise WeightError(
                f"tensor {key + '.trellis'!r}: expected int16 [in/16, out/16, 16*K] with K in 1..8, "
                f"got {trellis.dtype} {list(trellis.shape)}"
            )
        k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
        if k % 128 or n % 128:
            raise WeightError(f"tensor {key + '.trellis'!r}: padded dims {k}x{n} must be multiples of 128")
        if in_features > k or out_features > n:
            raise WeightError(
                f"tensor {key + '.trellis'!r}: holds a {k}x{n} (in x out) weight, smaller than the module's {in_features}x{out_features}"
            )
        for name, t, size in (("suh", suh, k), ("svh", svh, n)):
            if t.dtype != torch.float16 or tuple(t.shape) != (size,):
                raise WeightError(f"tensor {key + '.' + name!r}: expected float16 [{size}], got {t.dtype} {list(t.shape)}")
        if bias is not None and (bias.dim() != 1 or bias.shape[0] not in (n, out_features)):
            raise WeightError(f"tensor {key + '.bias'!r}: expected [{n}] or [{out_features}], got {list(bias.shape)}")
        if bias is not None and bias.shape[0] != n:
            bias = torch.nn.functional.pad(bias, (0, n - bias.shape[0]))
        self.trellis, self.suh, self.svh, self.codebook = trellis, suh, svh, codebook
        self.bias = bias.half() if bias is not None else None
        self.in_features, self.out_features = in_features, out_features
        self.padded_in, self.padded_out = k, n
        self.key = key
        self.decoded: torch.Tensor | None = None  # [out, in] in the model dtype, once :meth:`decode` ran
        self.decoded_bias: torch.Tensor | None = None

    def decode(self, dtype: torch.dtype) -> None:
        """Hold the dense weight (and bias) in ``dtype`` from now on and project with them: one decode instead of
        one per call, for a device with no EXL3 kernel."""
        self.decoded = self.dense_weight(dtype)
        self.decoded_bias = None if self.bias is None else self.bias[: self.out_features].to(dtype)

    @property
    def bits(self) -> int:
        return self.trellis.shape[2] // 16

    @property
    def unpadded(self) -> bool:
        """Whether the stored dims are the module's: x and y pass as they are, and each 128-column group of
        the output is the module's own."""
        return self.padded_in == self.in_features and self.padded_out == self.out_features

    def _rows_in(self, x: torch.Tensor) -> torch.Tensor:
        """x as [rows, padded_in] (zero-padded when the stored k is padded)."""
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[-1] < self.padded_in:
            x2 = torch.nn.functional.pad(x2, (0, self.padded_in - x2.shape[-1]))
        return x2

    def _rows_out(self, y: torch.Tensor, lead: torch.Size) -> torch.Tensor:
        """y [rows, padded_out] trimmed to out_features and shaped like the input's leading dims."""
        if self.out_features < self.padded_out:
            y = y[:, : self.out_features]
        return y.reshape(*lead, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decoded is not None:
            return torch.nn.functional.linear(x.to(self.decoded.dtype), self.decoded, self.decoded_bias).to(x.dtype)
        y = exl3_matmul(self._rows_in(x), self.trellis, self.suh, self.svh, self.codebook, self.bias)
        return self._rows_out(y, x.shape[:-1])

    __call__ = forward

    def groups_with(self, other: object) -> bool:
        """Whether one ``exl3_matmul_group`` can run this and ``other`` on one x (same K, codebook, k, device)."""
        return (
            isinstance(other, EXL3Linear)
            and other.codebook == self.codebook
            and other.bits == self.bits
            and other.padded_in == self.padded_in
            and other.trellis.device == self.trellis.device
            and self.decoded is None and other.decoded is None  # decoded parts are dense matmuls, one each
        )

    def grouped(self, parts: "list[Weights]") -> "EXL3Group | None":
        return EXL3Group(parts) if all(self.groups_with(p) for p in parts) else None

    def expert_set(self, experts: list, device: torch.device) -> "EXL3ExpertSet | None":
        return EXL3ExpertSet.from_experts(experts, device)

    def nbytes(self) -> int:
        ts = (self.trellis, self.suh, self.svh, self.bias)
        return sum(t.numel() * t.element_size() for t in ts if t is not None) + self.decoded_nbytes()

    def decoded_nbytes(self) -> int:
        ts = (self.decoded, self.decoded_bias)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The equivalent dense weight [out, in] (float32 math, in ``dtype``), decoded a slice of 128-wide output
        blocks at a time: unpacking the trellis takes 8 bytes per bit of every weight."""
        k, n = self.padded_in, self.padded_out
        step = max(128, (_DECODE_BYTES // (8 * k * self.bits)) // 128 * 128)
        rows = []
        for start in range(0, self.out_features, step):
            stop = min(start + step, n)
            w_hat = exl3_decode_tiles(self.trellis[:, start // 16: stop // 16], self.codebook).float()
            w = _had_rows(hadamard_128(w_hat)) * self.suh.float()[:, None] * self.svh[start:stop].float()[None, :]
            rows.append(w[: self.in_features, : self.out_features - start].t().to(dtype))
        return torch.cat(rows).contiguous() if len(rows) > 1 else rows[0].contiguous()

    @classmethod
    def random(cls, in_features: int, out_features: int, K: int = 4, codebook: str = "mcg",
               generator: torch.Generator | None = None, device: torch.device | str = "cpu", key: str = "<exl3>") -> "EXL3Linear":
        """Random trellis codes with random signs in ``suh`` and ``svh`` near 1/sqrt(in): outputs of about the
        input's scale. For tests and benchmarks of speed and routes, where the values do not matter."""
        k, n = in_features, out_features
        trellis = torch.randint(-32768, 32767, (k // 16, n // 16, 16 * K), dtype=torch.int16, generator=generator)
        suh = torch.where(torch.rand(k, generator=generator) < 0.5, -1.0, 1.0).half()
        svh = ((torch.rand(n, generator=generator) + 0.5) / k**0.5).half()
        return cls(trellis.to(device), suh.to(device), svh.to(device), codebook, k, n, key=key)

    @classmethod
    def from_quantized(cls, qt: QuantizedTensors, in_features: int, out_features: int, device=None, key: str = "<exl3>") -> "EXL3Linear":
        mv = lambda t: t.to(device) if (t is not None and device is not None) else t  # noqa: E731
        return cls(mv(qt.trellis), mv(qt.suh), mv(qt.svh), qt.codebook, in_features, out_features, mv(qt.bias), key)


class EXL3Group(WeightList):
    """EXL3 projections of one x with one K, codebook and padded input width (q/k/v, gate/up): one
    ``exl3_matmul_group`` call (one GEMV launch on CUDA)."""

    def __init__(self, parts: "list[EXL3Linear]"):
        super().__init__(parts)
        first = parts[0]
        self.codebook = first.codebook
        self.matmul_parts = [(p.trellis, p.suh, p.svh, p.bias) for p in parts]
        self.unpadded = all(p.unpadded for p in parts)  # x and every y as they are (no zero columns to add or trim)
        self.norms_input = first.padded_in == first.in_features  # x's sums of squares are the matmul input's

    def forward(self, x: torch.Tensor, row_norm: RowNorm | None = None) -> list[torch.Tensor]:  # type: ignore[override]
        """Each part applied to x (to ``row_norm.apply(x)`` with a norm, which needs ``norms_input``)."""
        first = self.parts[0]
        ys = exl3_matmul_group(first._rows_in(x), self.matmul_parts, self.codebook, row_norm)
        return [p._rows_out(y, x.shape[:-1]) for p, y in zip(self.parts, ys)]


@attrs.define(eq=False)
class EXL3ExpertSet:
    """The EXL3 gate, up and down Linears of all experts, plus device pointer tables for the pair kernels.

    ``gate_up_table`` int64 [2, E, 4] (for experts with no gate, ``gate`` empty: [1, E, 4] of the up projections) and
    ``down_table`` [1, E, 4] hold {trellis, suh, svh, bias or 0} pointers; they stay valid while the Linears hold
    their tensors (the set is rebuilt at every load).
    """

    gate: list
    up: list
    down: list
    gate_up_table: torch.Tensor
    down_table: torch.Tensor

    @staticmethod
    def _uniform(layers: list) -> bool:
        first = layers[0]
        return all(
            isinstance(l, EXL3Linear)
            and l.in_features == l.padded_in and l.out_features == l.padded_out  # no padding to undo per pair
            and l.trellis.shape == first.trellis.shape and l.codebook == first.codebook
            for l in layers
        )

    @classmethod
    def from_experts(cls, experts: list, device) -> "EXL3ExpertSet | None":
        """The set when every expert's projections are EXL3 with one shape and format per projection (gate and up
        alike), else None. Experts with no gate (down(act(up(x)))) get a set with ``gate`` empty and the up
        projections alone in ``gate_up_table`` ([1, E, 4])."""
        inputs = expert_inputs(experts)
        if inputs is None:
            return None
        up = [parts[-1] for parts in inputs]
        gate = [parts[0] for parts in inputs] if len(inputs[0]) == 2 else []
        down = [e.down_proj.impl for e in experts]
        if not all(cls._uniform(layers) for layers in (gate, up, down) if layers):
            return None
        if gate and (gate[0].trellis.shape != up[0].trellis.shape or gate[0].codebook != up[0].codebook):
            return None

        def table(*projections: list) -> torch.Tensor:
            rows = [[[l.trellis.data_ptr(), l.suh.data_ptr(), l.svh.data_ptr(), l.bias.data_ptr() if l.bias is not None else 0]
                     for l in layers] for layers in projections]
            return torch.tensor(rows, dtype=torch.int64, device=device)

        return cls(gate, up, down, table(gate, up) if gate else table(up), table(down))

    def run_pairs(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, activation: str) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]): the two sync-free pair ops (one kernel launch each on CUDA)."""
        expert_of = ids.reshape(-1)
        hidden = exl3_experts_gate_up(x, expert_of, self, ids.shape[1], activation)
        return exl3_experts_down(hidden, expert_of, self, weights)

    @staticmethod
    def dims(layers: list) -> tuple[int, int, int, str]:
        """(k, n, bits, codebook) of one projection."""
        l = layers[0]
        return l.padded_in, l.padded_out, l.bits, l.codebook


class EXL3Format:
    """QuantFormat for EXL3 trellis tensors (ExLlamaV3-compatible)."""

    name = "exl3"

    def detect(self, store: WeightStore, key: str) -> bool:
        return (
            f"{key}.trellis" in store
            and (f"{key}.suh" in store or f"{key}.su" in store)
            and (f"{key}.svh" in store or f"{key}.sv" in store)
        )

    def _codebook(self, store: WeightStore, key: str) -> str:
        present = [name for name in MARKER_VALUES if f"{key}.{name}" in store]
        if len(present) > 1:
            raise WeightError(f"{store.model_dir}: module {key!r} has both codebook markers {present}; at most one is allowed")
        if not present:
            return "3inst"
        name = present[0]
        marker = store.get(f"{key}.{name}")
        if marker.numel() != 1 or marker.dtype not in (torch.int32, torch.int64):
            raise WeightError(f"{store.model_dir}: tensor {key}.{name!r} must be a 0-dim int32 marker, got {marker.dtype} {list(marker.shape)}")
        value = int(marker.reshape(()).item()) & 0xFFFFFFFF
        if value != CODEBOOK_MULTIPLIERS[name]:
            warnings.warn(
                f"{store.model_dir}: {key}.{name} holds multiplier {value:#010x}, not the locked {CODEBOOK_MULTIPLIERS[name]:#010x}; "
                "decoding with the locked constant (a pre-lock experimental model may decode wrongly)"
            )
        return name

    def _scale(self, store: WeightStore, key: str, name: str, legacy: str, size: int) -> torch.Tensor:
        if f"{key}.{name}" in store:
            t = store.get(f"{key}.{name}")
            if t.dtype != torch.float16 or tuple(t.shape) != (size,):
                raise WeightError(f"{store.model_dir}: tensor {key + '.' + name!r} must be float16 [{size}], got {t.dtype} {list(t.shape)}")
            return t
        t = store.get(f"{key}.{legacy}")
        if t.dtype != torch.int16 or tuple(t.shape) != (size // 16,):
            raise WeightError(f"{store.model_dir}: tensor {key + '.' + legacy!r} must be int16 [{size // 16}] packed signs, got {t.dtype} {list(t.shape)}")
        return unpack_signs(t)

    def load_linear(
        self,
        store: WeightStore,
        key: str,
        in_features: int,
        out_features: int,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> EXL3Linear:
        trellis = store.get(f"{key}.trellis")
        if trellis.dtype != torch.int16 or trellis.dim() != 3:
            raise WeightError(f"{store.model_dir}: tensor {key + '.trellis'!r} must be int16 with 3 dims, got {trellis.dtype} {list(trellis.shape)}")
        k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
        suh = self._scale(store, key, "suh", "su", k)
        svh = self._scale(store, key, "svh", "sv", n)
        b = None
        if bias and f"{key}.bias" in store:
            b = store.get(f"{key}.bias").to(torch.float16)
        elif bias:
            raise WeightError(f"{store.model_dir}: tensor {key + '.bias'!r} is missing (module {key!r} has a bias)")
        mv = lambda t: t.to(device) if t is not None else None  # noqa: E731
        try:
            linear = EXL3Linear(mv(trellis), mv(suh), mv(svh), self._codebook(store, key), in_features, out_features, mv(b), key)
        except WeightError as e:
            raise WeightError(f"{store.model_dir}: {e}") from None
        if device.type == "cpu":  # no EXL3 kernel there: decode once, not at every forward
            linear.decode(dtype)
        return linear


def quantize_linear(
    weight: torch.Tensor,
    hessian: torch.Tensor | None,
    bits: int,
    codebook: str = "mul1",
    seed: int = 0,
    bias: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> QuantizedTensors:
    """Quantize one HF-orientation weight [out, in] (with the Hessian of its input) to EXL3 tensors."""
    (qt,), _ = quantize_group([weight], hessian, bits, codebook, seed, [bias], device=device)
    return qt
