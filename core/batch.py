"""ForwardBatch: the typed record every module receives.

Tokens of all sequences are concatenated along dim 0 (the varlen layout), so prefill chunks and
decode steps of different jobs share one forward pass. With a KV cache, each sequence also carries
its page list (a row of ``block_table``) and its total context length after this step.
"""
from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np
import torch


@attrs.define
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    cu_seqlens: torch.Tensor  # [B+1] int32, start of each sequence's new tokens in the flat layout
    logits_indices: torch.Tensor | None = None  # [L] token rows to compute logits for; None = all
    cache: Any = None  # a trellm.cache.KVCache or None (attention over the chunk only)
    block_table: torch.Tensor | None = None  # [B, max_pages] int32
    context_lens: torch.Tensor | None = None  # [B] int32: cached + new tokens per sequence
    slots: torch.Tensor | None = None  # [T] int64: flat cache slot (page * page_size + offset) of each token
    input_embeds: torch.Tensor | None = None  # [T, hidden] replaces the embedding lookup (multimodal)
    embed_mask: torch.Tensor | None = None  # [T] bool: rows of input_embeds to use; None = all rows
    max_seq_len: int = 0  # longest sequence (incl. cache) in the batch: dynamic RoPE variants read it
    state_slots: torch.Tensor | None = None  # [B] int64: recurrent-state slot of each sequence (hybrid models)
    cached_lens: torch.Tensor | None = None  # [B] int32: tokens already in the cache before this step
    lora_slots: torch.Tensor | None = None  # [T] int64: LoRA adapter slot of each token (-1: the base model); None: all -1
    # A captured draft verification: every sequence feeds ``tokens_per_seq`` tokens, which recurrent mixers take one
    # at a time, copying each sequence's state after its token j into slot ``state_checkpoints[j]`` ([tokens_per_seq - 1, B])
    tokens_per_seq: int = 0
    state_checkpoints: torch.Tensor | None = None
    # [L, vocab] float32 rows the logits are written to (every captured graph of a GraphRunner shares one such
    # buffer); None: a new tensor
    logits_out: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @classmethod
    def no_cache(
        cls, sequences: Sequence[Sequence[int]], device: torch.device | str = "cpu", all_logits: bool = True
    ) -> "ForwardBatch":
        """A batch of whole sequences attending only to themselves (no KV cache)."""
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("every sequence needs at least one token")
        lens = [len(s) for s in sequences]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        pos = torch.cat([torch.arange(n, device=device) for n in lens])
        cu = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32, device=device)
        last = None if all_logits else (cu[1:] - 1).long()
        return cls(input_ids=ids, positions=pos, cu_seqlens=cu, logits_indices=last, max_seq_len=max(lens))

    @classmethod
    def with_cache(
        cls,
        new_tokens: Sequence[Sequence[int]],
        cached_lens: Sequence[int],
        page_lists: Sequence[Sequence[int]],
        cache: Any,
        all_logits: bool = False,
        state_slots: Sequence[int] | None = None,
    ) -> "ForwardBatch":
        """New tokens of each sequence appended after ``cached_lens`` tokens already in ``cache``.

        ``state_slots``: each sequence's recurrent-state slot, for models with recurrent layers.
        """
        device = cache.device
        page_size = cache.page_size
        lens = [len(s) for s in new_tokens]
        ctx = [c + n for c, n in zip(cached_lens, lens)]
        for pages, total in zip(page_lists, ctx):
            if len(pages) * page_size < total:
                raise ValueError(f"sequence needs {total} cache slots but holds only {len(pages)} pages of {page_size}")
        positions = [p for c, n in zip(cached_lens, lens) for p in range(c, c + n)]
        slots = []
        for pages, c, n in zip(page_lists, cached_lens, lens):
            slots += [pages[p // page_size] * page_size + p % page_size for p in range(c, c + n)]
        width = max(1, max(len(p) for p in page_lists))
        table = torch.zeros(len(page_lists), width, dtype=torch.int32)
        for i, pages in enumerate(page_lists):
            table[i, : len(pages)] = torch.tensor(list(pages), dtype=torch.int32)
        cu = [0] + list(_cumsum(lens))
        last = None if all_logits else torch.tensor([e - 1 for e in cu[1:]], dtype=torch.long, device=device)
        return cls(
            input_ids=torch.tensor([t for s in new_tokens for t in s], dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            logits_indices=last,
            cache=cache,
            block_table=table.to(device),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            max_seq_len=max(ctx) if ctx else 0,
            cached_lens=torch.tensor(list(cached_lens), dtype=torch.int32, device=device),
            state_slots=None if state_slots is None else torch.tensor(list(state_slots), dtype=torch.long, device=device),
        )


def _cumsum(xs: Sequence[int]):
    total = 0
    for x in xs:
        total += x
        yield total


def _up(n: int, k: int) -> int:
    """``n`` rounded up to a multiple of ``k``: every field of StepBuffers starts 16-byte aligned."""
    return -(-n // k) * k


class StepBuffers:
    """One host buffer and one device buffer that every step's index tensors live in.

    Why: a decode step of a small model runs in well under a millisecond on a GPU, while building
    each index tensor on its own (``torch.tensor(list, device=...)``: a pageable, synchronous
    host->device copy each) costs tens of microseconds apiece. Here the block table, cu_seqlens,
    context and cached lengths (int32), ids, positions, slots, logits rows and state slots (int64)
    are written into one int64 host buffer (pinned on CUDA) and sent with ONE non-blocking copy;
    the batch's tensors are views into the device buffer. On CPU the host buffer is the device
    buffer: no copy at all. Block-table rows that equal last step's are not rewritten.

    A batch from :meth:`build` is valid until the next ``build`` on the same buffers (they are
    reused). ``growable=False`` keeps the device buffer's address fixed (CUDA graphs read it).
    """

    def __init__(self, device: torch.device | str, capacity: int = 4096, growable: bool = True):
        self.device = torch.device(device)
        self.growable = growable
        self._copied: Any = None  # CUDA event after the last copy out of the host buffer, until waited for
        self._event: Any = None
        self._alloc(max(int(capacity), 16))

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.host = torch.zeros(capacity, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._np = self.host.numpy()
        self._np32 = self._np.view(np.int32)
        self.dev = self.host if self.device.type == "cpu" else torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self._dev32 = self.dev.view(torch.int32)
        self._rows: list[Any] = []  # what each block-table row of the host buffer holds (a page list copy, or None: padding)
        self._rows_key: tuple[int, int] | None = None  # (width, pad page) those rows were written with

    def build(
        self,
        new_tokens: Sequence[Sequence[int]],
        cached_lens: Sequence[int],
        page_rows: Sequence[Sequence[int]],
        cache: Any,
        logits_rows: Sequence[int] | None,
        state_slots: Sequence[int] | None = None,
        pad_to: int = 0,
        table_width: int = 0,
        pad_page: int = 0,
        max_seq_len: int | None = None,
        lora_slots: Sequence[int] | None = None,
        pad_state_slot: int = 0,
        state_checkpoints: Sequence[Sequence[int]] | None = None,
    ) -> ForwardBatch:
        """Like :meth:`ForwardBatch.with_cache`, with ``logits_rows`` (flat token rows, None = all).

        ``lora_slots``: each sequence's LoRA adapter slot (-1: none), given to every token of it; padding
        rows get -1.

        ``pad_to`` appends padding sequences up to that many (one token each at position 0, written
        to ``pad_page``, their logits rows appended): a captured decode graph's fixed batch size.
        ``table_width`` fixes the block table's width; columns past a sequence's pages hold ``pad_page``.
        Padding sequences' recurrent state lives in ``pad_state_slot`` (fresh each step: their cached length is 0).
        ``state_checkpoints``: per sequence, the slots its state is copied to after each but its last token
        (:attr:`ForwardBatch.state_checkpoints`; padding sequences' go to ``pad_state_slot``).
        """
        page_size = cache.page_size
        b_real = len(new_tokens)
        b = max(b_real, pad_to)
        n_pad = b - b_real
        decode = all(len(s) == 1 for s in new_tokens)  # one token per sequence: plain lists are quicker than numpy
        lens = None if decode else [len(s) for s in new_tokens]
        t_real = b_real if decode else sum(lens)
        t = t_real + n_pad
        width = table_width or max(1, max((len(p) for p in page_rows), default=1))
        n_logits = t if logits_rows is None else len(logits_rows) + n_pad
        # layout: int32 table, cu, ctx, cached (in int32 units) | int64 ids, positions, slots, logits rows, state slots
        o32_cu = _up(b * width, 4)
        o32_ctx = o32_cu + _up(b + 1, 4)
        o32_cached = o32_ctx + _up(b, 4)
        o_ids = (o32_cached + _up(b, 4)) // 2
        o_pos, o_slots, o_logits = o_ids + _up(t, 2), o_ids + 2 * _up(t, 2), o_ids + 3 * _up(t, 2)
        o_state = o_logits + _up(n_logits, 2)
        o_lora = o_state + _up(b if state_slots is not None else 0, 2)
        o_ckpt = o_lora + _up(t if lora_slots is not None else 0, 2)
        n_ckpt = len(state_checkpoints[0]) if state_checkpoints else 0  # checkpoints per sequence
        end = o_ckpt + n_ckpt * b
        self._ensure(end)
        h, h32 = self._np, self._np32

        if decode:
            cached = list(cached_lens)
            ctx = [c + 1 for c in cached]
            self._check_room(page_rows, ctx, page_size)
            slots = [p[c // page_size] * page_size + c % page_size for p, c in zip(page_rows, cached)]
            h32[o32_cu: o32_cu + b + 1] = range(b + 1)
            h32[o32_ctx: o32_ctx + b] = ctx + [1] * n_pad
            h32[o32_cached: o32_cached + b] = cached + [0] * n_pad
            pad = [0] * n_pad
            h[o_ids: o_ids + t] = [s[0] for s in new_tokens] + pad
            h[o_pos: o_pos + t] = cached + pad
            h[o_slots: o_slots + t] = slots + [pad_page * page_size] * n_pad
            max_ctx = max(ctx, default=0)
        else:
            lens_np = np.array(lens, dtype=np.int64)
            cached_np = np.array(cached_lens, dtype=np.int64)
            ctx_np = cached_np + lens_np
            self._check_room(page_rows, ctx_np.tolist(), page_size)
            starts = np.cumsum(lens_np) - lens_np
            cu = h32[o32_cu: o32_cu + b + 1]
            cu[0] = 0
            cu[1: b_real + 1] = starts + lens_np
            cu[b_real + 1:] = t_real + np.arange(1, n_pad + 1)
            h32[o32_ctx: o32_ctx + b_real] = ctx_np
            h32[o32_ctx + b_real: o32_ctx + b] = 1
            h32[o32_cached: o32_cached + b_real] = cached_np
            h32[o32_cached + b_real: o32_cached + b] = 0
            h[o_ids: o_ids + t_real] = [tok for s in new_tokens for tok in s]
            seq_of = np.repeat(np.arange(b_real), lens_np)
            pos = np.arange(t_real) + np.repeat(cached_np - starts, lens_np)
            h[o_pos: o_pos + t_real] = pos
            rows = np.zeros((b_real, max(1, max(len(p) for p in page_rows))), dtype=np.int64)
            for i, p in enumerate(page_rows):
                rows[i, : len(p)] = p
            h[o_slots: o_slots + t_real] = rows[seq_of, pos // page_size] * page_size + pos % page_size
            h[o_ids + t_real: o_ids + t] = 0
            h[o_pos + t_real: o_pos + t] = 0
            h[o_slots + t_real: o_slots + t] = pad_page * page_size
            max_ctx = int(ctx_np.max()) if b_real else 0
        if logits_rows is not None:
            h[o_logits: o_logits + n_logits] = [*logits_rows, *range(t_real, t)]
        if state_slots is not None:
            h[o_state: o_state + b_real] = state_slots
            h[o_state + b_real: o_state + b] = pad_state_slot
        if lora_slots is not None:
            per_token = lora_slots if decode else np.repeat(np.asarray(lora_slots, dtype=np.int64), lens_np)
            h[o_lora: o_lora + t_real] = per_token
            h[o_lora + t_real: o_lora + t] = -1
        if n_ckpt:
            grid = h[o_ckpt: o_ckpt + n_ckpt * b].reshape(n_ckpt, b)
            grid[:, :b_real] = np.asarray(state_checkpoints, dtype=np.int64).T
            grid[:, b_real:] = pad_state_slot
        self._write_table(page_rows, b, width, pad_page)
        self._send(end)

        d, d32 = self.dev, self._dev32
        return ForwardBatch(
            input_ids=d[o_ids: o_ids + t],
            positions=d[o_pos: o_pos + t],
            cu_seqlens=d32[o32_cu: o32_cu + b + 1],
            logits_indices=None if logits_rows is None else d[o_logits: o_logits + n_logits],
            cache=cache,
            block_table=d32[: b * width].view(b, width),
            context_lens=d32[o32_ctx: o32_ctx + b],
            slots=d[o_slots: o_slots + t],
            max_seq_len=max_seq_len if max_seq_len is not None else max_ctx,
            cached_lens=d32[o32_cached: o32_cached + b],
            state_slots=None if state_slots is None else d[o_state: o_state + b],
            lora_slots=None if lora_slots is None else d[o_lora: o_lora + t],
            state_checkpoints=d[o_ckpt: o_ckpt + n_ckpt * b].view(n_ckpt, b) if n_ckpt else None,
        )

    @staticmethod
    def _check_room(page_rows: Sequence[Sequence[int]], ctx: Sequence[int], page_size: int) -> None:
        for pages, total in zip(page_rows, ctx):
            if len(pages) * page_size < total:
                raise ValueError(f"sequence needs {total} cache slots but holds only {len(pages)} pages of {page_size}")

    def _write_table(self, page_rows: Sequence[Sequence[int]], b: int, width: int, pad_page: int) -> None:
        """Block-table rows at the host buffer's start; a row that already holds the same pages is kept.
        Rows past ``b`` are forgotten: the other fields of this step may lie there."""
        if self._rows_key != (width, pad_page):
            self._rows, self._rows_key = [], (width, pad_page)
        known = self._rows
        table = self._np32[: b * width].reshape(b, width)
        for i in range(b):
            row = page_rows[i] if i < len(page_rows) else None
            if i < len(known) and (known[i] is None if row is None else isinstance(row, list) and known[i] == row):
                continue
            if row is None:
                table[i].fill(pad_page)
            else:
                table[i, : len(row)] = row
                table[i, len(row):] = pad_page
            row = None if row is None else list(row)
            if i < len(known):
                known[i] = row
            else:
                known.append(row)
        del known[b:]

    def _ensure(self, size: int) -> None:
        """Room for ``size`` int64s; the host buffer is free to write (the last copy out of it is done)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if size > self.capacity:
            if not self.growable:
                raise ValueError(f"step needs {size} index slots, these fixed buffers hold {self.capacity}")
            self._alloc(max(size, 2 * self.capacity))

    def _send(self, size: int) -> None:
        if self.dev is self.host:
            return
        self.dev[:size].copy_(self.host[:size], non_blocking=True)
        if self.device.type == "cuda":
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.dev.device))  # the copy's stream, not the thread's device's
            self._copied = self._event
