"""Lazy, validated safetensors reading.

Every header is parsed and checked (length, JSON, dtype, shape vs byte range, ranges inside the
file, no overlaps) before any tensor is touched, so a corrupt file fails with its name and the
offending tensor rather than a segfault or garbage. Data is memory-mapped and read on demand.
"""
from __future__ import annotations

import json
import mmap
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from .errors import WeightError

if TYPE_CHECKING:
    from .quant.source import VirtualTensor

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
MAX_HEADER = 100 * 1024 * 1024
# Other spellings of a model's tensor names, declared by its family: (canonical prefix, alternative prefixes). The
# canonical spelling is the model's module keys; the alternatives are those of other uploads or transformers versions,
# and transformers' own module names where its classes nest modules differently from the checkpoint (NemotronH's
# ``model.layers`` for ``backbone.layers``), which PEFT adapters are named after. A ``*`` stands for one name
# component, the same in both spellings (``model.layers.*.block_sparse_moe.`` / ``model.layers.*.mlp.``).
Aliases = Sequence[tuple[str, Sequence[str]]]


class TensorInfo:
    __slots__ = ("name", "file", "dtype", "shape", "start", "end")

    def __init__(self, name: str, file: "SafetensorsFile", dtype: torch.dtype, shape: tuple[int, ...], start: int, end: int):
        self.name, self.file, self.dtype, self.shape, self.start, self.end = name, file, dtype, shape, start, end

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class SafetensorsFile:
    """One .safetensors file: header parsed and validated at open, data mmapped lazily."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._mm: mmap.mmap | None = None
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self._parse()

    def _fail(self, msg: str) -> WeightError:
        return WeightError(f"{self.path}: {msg}")

    def _parse(self) -> None:
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self._fail(f"truncated safetensors file ({size} bytes; the 8-byte header length is missing)")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER or 8 + n > size:
                    raise self._fail(f"corrupt safetensors header: header length {n} does not fit in a file of {size} bytes")
                raw = f.read(n)
        except OSError as e:
            raise WeightError(f"{self.path}: cannot read ({e.strerror})") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._fail(f"corrupt safetensors header: not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._fail("corrupt safetensors header: not a JSON object")
        data_size = size - 8 - n
        self.data_offset = 8 + n
        self.metadata = header.pop("__metadata__", None) or {}
        spans = []
        for name, info in header.items():
            try:
                dtype_s, shape, (a, b) = info["dtype"], info["shape"], info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self._fail(f"tensor {name!r}: malformed header entry {info!r}") from None
            if dtype_s not in DTYPES:
                raise self._fail(f"tensor {name!r}: unsupported dtype {dtype_s!r}")
            if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
                raise self._fail(f"tensor {name!r}: bad shape {shape!r}")
            dtype = DTYPES[dtype_s]
            numel = 1
            for d in shape:
                numel *= d
            expect = numel * dtype.itemsize
            if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b):
                raise self._fail(f"tensor {name!r}: bad data_offsets {[a, b]!r}")
            if b - a != expect:
                raise self._fail(f"tensor {name!r}: {dtype_s}{shape} needs {expect} bytes but data_offsets span {b - a}")
            if b > data_size:
                raise self._fail(
                    f"tensor {name!r}: data ends at byte {b} but the file holds only {data_size} data bytes (truncated file?)"
                )
            spans.append((a, b, name))
            self.tensors[name] = TensorInfo(name, self, dtype, tuple(shape), a, b)
        spans.sort()
        for (a0, b0, n0), (a1, b1, n1) in zip(spans, spans[1:]):
            if a1 < b0 and b1 > a1:
                raise self._fail(f"tensors {n0!r} and {n1!r} overlap in the data section")

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """The tensor, or only ``rows`` (a step-1 slice of its first dimension: one expert of a stack)."""
        t = self.tensors[name]
        shape, start, end = t.shape, t.start, t.end
        if rows is not None:
            first, stop, step = rows.indices(shape[0])
            if step != 1:
                raise ValueError(f"{self.path}: tensor {name!r}: row slices must have step 1")
            row_bytes = t.nbytes // max(shape[0], 1)
            shape = (max(stop - first, 0), *shape[1:])
            start, end = t.start + first * row_bytes, t.start + first * row_bytes + shape[0] * row_bytes
        if end == start:
            return torch.empty(shape, dtype=t.dtype)
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._mm)[self.data_offset + start : self.data_offset + end]
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: we clone before handing it out
            return torch.frombuffer(buf, dtype=t.dtype).reshape(shape).clone()

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None


class WeightStore:
    """All tensors of a model directory by name, across shards; the index file is optional."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        files = sorted(self.model_dir.glob("*.safetensors"))
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise WeightError(f"{index}: malformed index ({e})") from None
            listed = sorted({self.model_dir / f for f in weight_map.values()})
            missing = [str(p) for p in listed if not p.is_file()]
            if missing:
                raise WeightError(f"{index}: lists shard files that do not exist: {', '.join(missing)}")
            files = sorted(set(files) | set(listed))
        if not files:
            raise WeightError(f"{self.model_dir}: no *.safetensors files found")
        self.files = [SafetensorsFile(p) for p in files]
        self._index: dict[str, TensorInfo] = {}
        for f in self.files:
            for name, info in f.tensors.items():
                if name in self._index:
                    raise WeightError(f"tensor {name!r} appears in both {self._index[name].file.path.name} and {f.path.name}")
                self._index[name] = info
        # Quantized sources (FP8, MXFP4): their weights appear as dense virtual tensors (quant/source.py).
        from .quant.source import source_views

        stored = dict(self._index)
        views, hidden = source_views(self.model_dir, stored, lambda name, rows: stored[name].file.read(name, rows))
        for name in hidden:
            del self._index[name]
        self._index.update(views)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def keys(self) -> list[str]:
        return list(self._index)

    def info(self, name: str) -> "TensorInfo | VirtualTensor":
        try:
            return self._index[name]
        except KeyError:
            raise WeightError(f"{self.model_dir}: tensor {name!r} is missing") from None

    def get(
        self,
        name: str,
        shape: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Read one tensor, checking its shape when given, converting dtype/device when given."""
        info = self.info(name)
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise WeightError(
                f"{info.file.path.name}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}"
            )
        t = info.file.read(name) if isinstance(info, TensorInfo) else info.read().to(dtype or info.dtype)
        if dtype is not None or device is not None:
            t = t.to(device=device, dtype=dtype)
        return t

    def num_elements(self) -> int:
        """Stored elements over all tensors (parameters, for a dense checkpoint)."""
        return sum(i.numel for i in self._index.values())

    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self._index.values())

    def close(self) -> None:
        for f in self.files:
            f.close()


class CheckpointNames:
    """A store whose tensors are looked up under a family's :data:`Aliases`: a name missing under its canonical
    prefix is looked up under each alternative in turn."""

    def __init__(self, store, aliases: Aliases):
        self.store, self.aliases = store, aliases
        self.model_dir = store.model_dir

    def resolve(self, name: str) -> str:
        return _known_spelling(name, self.aliases, self.store.__contains__, to_canonical=False)

    def __contains__(self, name: str) -> bool:
        return self.resolve(name) in self.store

    def __iter__(self) -> Iterator[str]:
        return iter(self.store)

    def keys(self) -> list[str]:
        return self.store.keys()

    def info(self, name: str):
        return self.store.info(self.resolve(name))

    def get(self, name: str, *args, **kwargs) -> torch.Tensor:
        return self.store.get(self.resolve(name), *args, **kwargs)


def canonical_name(name: str, aliases: Aliases, known: Callable[[str], bool]) -> str:
    """``name`` (a module or tensor name in any spelling :data:`Aliases` allow) as the model spells it: itself when
    ``known``, else the first canonical rewrite of an alternative prefix it starts with that is known; a name nothing
    fits comes back unchanged (the caller names it in its error). :class:`CheckpointNames` resolves the other way."""
    return _known_spelling(name, aliases, known, to_canonical=True)


def _known_spelling(name: str, aliases: Aliases, known: Callable[[str], bool], to_canonical: bool) -> str:
    """``name`` when ``known``, else its first known respelling (an alternative prefix as the canonical one when
    ``to_canonical``, the canonical prefix as each alternative otherwise), else ``name``."""
    if known(name):
        return name
    for canon, alts in aliases:
        for alt in alts:
            other = respelled(name, alt, canon) if to_canonical else respelled(name, canon, alt)
            if other is not None and known(other):
                return other
    return name


def respelled(name: str, prefix: str, to: str) -> str | None:
    """``name`` with its prefix ``prefix`` spelled ``to`` (each ``*`` of ``to`` the component the same ``*`` of
    ``prefix`` matched); None when ``name`` does not start with ``prefix``."""
    if "*" not in prefix:
        return to + name[len(prefix):] if name.startswith(prefix) else None
    m = re.match(re.escape(prefix).replace(r"\*", r"([^.]+)"), name)
    if m is None:
        return None
    pieces = to.split("*")
    return pieces[0] + "".join(c + p for c, p in zip(m.groups(), pieces[1:])) + name[m.end():]
