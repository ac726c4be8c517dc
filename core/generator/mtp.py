"""Multi-token prediction (MTP) heads of Qwen3-Next / Qwen3.5 (and MiMo, see :class:`MTPLayout`) checkpoints,
run as a speculative draft.

These checkpoints carry one extra decoder layer under ``mtp.*`` that was trained to predict the token
after next. transformers ignores it; here it loads as ``model.mtp`` (an :class:`MTPHead`, present
only when the checkpoint has ``mtp.*`` tensors) and :class:`MTPProposer` runs it as the draft model.

The math (the layout vLLM's ``qwen3_next_mtp`` / ``qwen3_5_mtp`` and SGLang load), for position ``i``
of a sequence with tokens ``t`` and target hidden states ``h``::

    h_i    = the target's last hidden state at position i, AFTER its final norm (what the LM head reads)
    x_i    = fc( concat( pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i) ) )   # [emb | hid]
    y_i    = norm( layers.0(x_i) )      # one full (gated) attention decoder layer, causal over x_0..x_i,
                                        # RoPE position i, its own KV cache; MoE MLP in the MoE variant
    logits = lm_head(y_i)               # predicts t_{i+2}; embed and lm_head are the target's

Drafting ``k`` tokens after the committed ``t_0..t_{n-1}`` (the target has computed ``h_0..h_{n-2}``):
the first MTP step consumes the pairs ``(h_i, t_{i+1})`` not yet in its cache up to ``i = n - 2`` and
its last row gives draft ``d_1``; step ``j > 1`` feeds ``(y, d_{j-1})`` at the next position, ``y``
being the MTP's own previous output (post-norm, as in vLLM's MTP loop). Entries built from real
hidden states stay in the MTP cache; the draft steps' entries are dropped after each proposal.

Norms are Qwen's ``1 + w`` RMSNorms. Only ``mtp.layers.0`` is used (every released checkpoint has
``mtp_num_hidden_layers: 1``).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from functools import partial
from typing import Any

import attrs
import torch

from ..batch import ForwardBatch, StepBuffers
from ..cache import CacheFullError, KVCache, KVCacheLayer, SequenceState
from ..capabilities import mtp_head
from ..errors import TrellmError
from ..graph import DEFAULT_BATCH_SIZES, GraphRunner
from ..modules.base import LoadContext, Module
from ..modules.decoder import DecoderLayer
from ..modules.layers import GatedMLP, RMSNorm, RotaryEmbedding
from ..modules.linear import Linear
from ..ops.attention import token_sequences
from .speculative import DraftRequest

MAX_PENDING_ROWS = 1024  # target hidden states held per job before they are absorbed into the MTP cache


@attrs.frozen
class MTPLayout:
    """Where a family keeps its MTP head's tensors and how it joins its two inputs.

    Qwen3-Next / Qwen3.5 (the default): ``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` ``1 + w`` norms,
    ``fc`` over ``[embedding | hidden]``, output ``norm``. MiMo: ``token_layernorm`` / ``hidden_layernorm``
    plain norms, ``input_proj`` over ``[hidden | embedding]``, ``final_layernorm``.
    """

    embedding_norm: str = "pre_fc_norm_embedding"
    hidden_norm: str = "pre_fc_norm_hidden"
    fc: str = "fc"
    output_norm: str = "norm"
    hidden_first: bool = False
    unit_offset: bool = True


QWEN_MTP = MTPLayout()


class MTPHead(Module):
    """The MTP block: the two input norms, ``fc`` (2 * hidden -> hidden), one decoder layer and the output
    norm, named and ordered as ``layout`` says.

    Optional: :meth:`load` loads nothing when the checkpoint has no ``{key}.*`` tensors (``present`` stays
    False), so a checkpoint without them loads exactly as before.
    """

    def __init__(self, key: str, hidden_size: int, eps: float, layer: DecoderLayer, layout: MTPLayout = QWEN_MTP):
        self.key, self.hidden_size, self.hidden_first = key, hidden_size, layout.hidden_first
        norm = lambda name: RMSNorm(f"{key}.{name}", hidden_size, eps, unit_offset=layout.unit_offset)
        self.embedding_norm, self.hidden_norm = norm(layout.embedding_norm), norm(layout.hidden_norm)
        self.fc = Linear(f"{key}.{layout.fc}", 2 * hidden_size, hidden_size)
        self.layer = layer
        self.norm = norm(layout.output_norm)
        self.present = False

    def load(self, ctx: LoadContext) -> None:
        prefix = f"{self.key}."
        if not any(name.startswith(prefix) for name in ctx.store):
            return
        super().load(ctx)  # a partial set fails here, naming the missing tensor
        self.present = True

    def unload(self) -> None:
        super().unload()
        self.present = False

    def forward(self, token_embeds: torch.Tensor, target_hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """[T, hidden] embeddings of ``t_{i+1}`` and hidden states ``h_i`` (post final norm) -> ``y_i`` (post output norm)."""
        parts = [self.embedding_norm.forward(token_embeds), self.hidden_norm.forward(target_hidden)]
        both = torch.cat(parts[::-1] if self.hidden_first else parts, dim=-1)
        return self.norm.forward(self.layer.forward(self.fc(both), batch))


def build_qwen_mtp_head(cfg: Any, mlp: Module | None = None, key: str = "mtp") -> MTPHead:
    """The MTP head of a Qwen3-Next / Qwen3.5 config: its decoder layer is a gated full-attention layer
    like the model's own, with ``mlp`` (the family's MoE) or a dense SwiGLU MLP.

    The attention layer reads KV cache layer 0: the MTP keeps its own one-layer cache (see MTPProposer).
    """
    from ..modules.recurrent import GatedAttention

    eps = cfg.rms_norm_eps
    layer_key = f"{key}.layers.0"
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    attn = GatedAttention(f"{layer_key}.self_attn", 0, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                          cfg.head_dim, rope, eps, norm_unit_offset=True, bias=cfg.attention_bias)
    mlp = mlp or GatedMLP(f"{layer_key}.mlp", cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    layer = DecoderLayer(layer_key, RMSNorm(f"{layer_key}.input_layernorm", cfg.hidden_size, eps, unit_offset=True), attn,
                         RMSNorm(f"{layer_key}.post_attention_layernorm", cfg.hidden_size, eps, unit_offset=True), mlp)
    return MTPHead(key, cfg.hidden_size, eps, layer)


def mtp_head_of(model: Any) -> MTPHead | None:
    """The loaded MTP head of a LoadedModel or module tree, or None."""
    head = mtp_head(getattr(model, "model", model))  # a LoadedModel or its module tree
    return head if isinstance(head, MTPHead) and head.present else None


def mtp_cache(model: Any, cache_tokens: int, page_size: int) -> KVCache:
    """The MTP head's own one-layer paged cache, with its attention's KV heads (a tensor-parallel rank's own);
    ``made_with`` tells the other ranks how to make their part of it."""
    weight = model.embed.weight
    split = getattr(model, "layer_split", None)
    device = weight.device if split is None else split.tail.device  # the head sits with the last layer
    heads, dim, vdim = mtp_head_of(model).layer.attn.kv_shape()
    num_pages = max(1, -(-cache_tokens // page_size))
    cache = KVCache([KVCacheLayer(num_pages, page_size, heads, dim, vdim, weight.dtype, device)], page_size, device)
    cache.made_with = {"mtp": dict(cache_tokens=cache_tokens, page_size=page_size)}
    return cache


def mtp_rows(model: Any, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``model``'s MTP head: the batch's next tokens paired with ``hidden`` rows -> each sequence's last
    output row and its float32 logits (the target's embedding and LM head)."""
    dtype = model.embed.weight.dtype
    y = mtp_head_of(model).forward(model.embed.forward(batch.input_ids), hidden.to(dtype), batch)
    y_last = y[(batch.cu_seqlens[1:] - 1).long()]
    return y_last, model.lm_head.forward(y_last).float()


class MTPError(TrellmError, ValueError):
    """The model has no (loaded) MTP head."""


class _JobState:
    """One job's MTP cache: entries for absolute positions ``base .. base + seq.length - 1`` (pairs
    ``(h_i, t_{i+1})``), target hidden states waiting for their next token (``pending``, the positions
    right after), and the tokens all of it was computed from."""

    def __init__(self, cache: KVCache):
        self.seq = SequenceState(cache)
        self.base: int | None = None  # first position with an entry (later than 0 after prefix-cache reuse)
        self.pending: torch.Tensor | None = None
        self.tokens: list[int] = []

    @property
    def num_pending(self) -> int:
        return 0 if self.pending is None else self.pending.shape[0]

    @property
    def end(self) -> int:
        """The next position whose target hidden state is still missing."""
        return (self.base or 0) + self.seq.length + self.num_pending

    def reset(self, base: int | None) -> None:
        self.base, self.seq.length, self.pending = base, 0, None

    def sync(self, tokens: Sequence[int]) -> None:
        """Keep only what was computed from tokens that ``tokens`` still has (a rewind changes the tail)."""
        common = _common_prefix(self.tokens, tokens)
        self.tokens = list(tokens)
        if self.base is None:
            return
        entries = max(0, min(self.seq.length, common - 1 - self.base))  # entry i needs t_{i+1}
        if entries < self.seq.length:  # the hidden states after the cut went into dropped entries
            self.seq.length, self.pending = entries, None
        elif self.pending is not None:  # h_i needs t_0..t_i
            keep = max(0, min(self.num_pending, common - self.base - self.seq.length))
            self.pending = self.pending[:keep] if keep else None
        if self.seq.length == 0 and self.pending is None:
            self.base = None


class MTPProposer:
    """Drafts with the target's own MTP head; see the module docstring for the math.

    ``Generator(lm, proposer=MTPProposer(lm), num_draft_tokens=k)``. The generator hands it the
    target's hidden states of every verified position (:meth:`observe_hidden`); the MTP keeps its own
    small paged KV cache (``cache_tokens`` tokens, one attention layer) per job. Drafts are greedy.
    """

    def __init__(self, model: Any, num_tokens: int = 3, cache_tokens: int = 8192, page_size: int = 256,
                 cuda_graphs: bool = True):
        self.target = getattr(model, "model", model)
        head = mtp_head_of(self.target)
        if head is None:
            name = getattr(model, "model_dir", None) or type(self.target).__name__
            if mtp_head(self.target) is None:
                raise MTPError(f"{name}: this model family has no MTP head (Qwen3.5 and Qwen3.5 MoE have one)")
            raise MTPError(f"{name}: the checkpoint has no MTP weights (mtp.* tensors); MTP drafting needs a checkpoint "
                           "that ships them")
        self.head = head
        self.num_tokens = num_tokens
        self.cache = mtp_cache(self.target, cache_tokens, page_size)
        # a tensor-parallel model runs the head on every rank (its own mtp_rows); one process runs it here
        self._mtp_rows = getattr(self.target, "mtp_rows", None) or partial(mtp_rows, self.target)
        self._jobs: dict[Hashable, _JobState] = {}
        self.stats = {"mtp_forwards": 0, "mtp_tokens": 0, "graph_proposals": 0}
        capturable = getattr(self.target, "capturable", True) and getattr(self.target, "mtp_rows", None) is None
        self.graphs = ProposalGraphs(self) if cuda_graphs and capturable and self.cache.device.type == "cuda" else None

    # ---- the generator's hooks --------------------------------------------------------------------

    @torch.inference_mode()
    def observe_hidden(self, key: Hashable, start: int, hidden: torch.Tensor, tokens: Sequence[int]) -> None:
        """The target computed ``hidden`` (rows for positions ``start, start + 1, ...``, as the decoder layers
        leave them, before the final norm) from ``tokens``, the job's committed tokens now."""
        state = self._jobs.get(key)
        if state is None:
            state = self._jobs[key] = _JobState(self.cache)
        state.sync(tokens)
        if state.base is None or start > state.end:  # nothing usable before ``start`` (prefix reuse, rewind)
            state.reset(start)
        skip = state.end - start  # rows the MTP already holds (a hybrid job re-feeds accepted tokens)
        if skip >= hidden.shape[0]:
            return
        rows = self.target.norm.forward(hidden[skip:])  # the LM head's input: what the MTP was trained on
        state.pending = rows if state.pending is None else torch.cat([state.pending, rows])
        stop = len(tokens) - 2  # keep h_{n-2} pending: the first draft step starts from it
        if state.num_pending > MAX_PENDING_ROWS and stop > state.base + state.seq.length:
            try:  # a long prompt: absorb now rather than hold all its hidden states
                self._absorb([(state, stop)])
            except CacheFullError:
                state.reset(None)

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Greedy MTP drafts for every job whose last hidden state has arrived; [] for the others."""
        out: list[list[int]] = [[] for _ in requests]
        live = []  # (index in requests, state, k)
        for i, r in enumerate(requests):
            k = min(r.max_tokens, self.num_tokens)
            state = self._jobs.get(r.key)
            if k <= 0 or state is None:
                continue
            state.sync(r.tokens)
            last = len(r.tokens) - 2  # the last position whose pair (h, next token) is known
            if state.base is None or state.end <= last or state.seq.length + state.base > last:
                continue  # h_{n-2} missing, or already absorbed (no row left to draft from): skip this step
            try:
                state.seq.reserve(len(r.tokens) - state.base + k)
            except CacheFullError:
                continue
            live.append((i, state, k))
        if not live:
            return out
        drafted = self._propose_in_graph(live, requests) if self.graphs is not None else None
        if drafted is not None:
            for (i, _, _), draft in zip(live, drafted):
                out[i] = draft
            return out
        y, tokens = self._absorb([(state, len(requests[i].tokens) - 1) for i, state, _ in live])
        committed = [state.seq.length for _, state, _ in live]
        rows = list(range(len(live)))  # live jobs still drafting; y and tokens follow this order
        while True:
            for row, token in zip(rows, tokens):
                out[live[row][0]].append(token)
            keep = [j for j, row in enumerate(rows) if len(out[live[row][0]]) < live[row][2]]
            if not keep:
                break
            rows = [rows[j] for j in keep]
            y, tokens = self._run([live[row][1] for row in rows], [[out[live[row][0]][-1]] for row in rows], y[keep])
        for (_, state, _), length in zip(live, committed):
            state.seq.length = length  # drop the draft steps' entries
        return out

    def release(self, key: Hashable) -> None:
        state = self._jobs.pop(key, None)
        if state is not None:
            state.seq.release()

    def close(self) -> None:
        """Drop the proposal graphs and give their scratch page back."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None

    def _propose_in_graph(self, live: list[tuple[int, _JobState, int]], requests: Sequence[DraftRequest]) -> list[list[int]] | None:
        """The drafts of ``live`` jobs (index in ``requests``, state, k) by one replay of a :class:`ProposalGraphs`
        graph; None (nothing changed) when the proposal must run eagerly: a job with more new hidden states than
        the graph's k + 1 rows (after a prefill), positions past the MTP cache's span (its entries start late
        after a prefix reuse), no pages for k draft entries, too many jobs, capture failed."""
        graphs, k = self.graphs, max(k for _, _, k in live)
        width = k + 1
        counts = [min(state.num_pending, len(requests[i].tokens) - 1 - state.base - state.seq.length) for i, state, _ in live]
        if max(counts) > width or not graphs.fits([state.seq.pages for _, state, _ in live], width):
            return None
        # the graphs' RoPE table covers the MTP cache's span of positions; entries start at ``base`` (prefix reuse)
        if max(state.base + len(requests[i].tokens) + k for i, state, _ in live) > graphs.max_pages * graphs.page_size:
            return None
        try:  # every row runs k steps (eager proposals stop a row at its own k)
            for i, state, _ in live:
                state.seq.reserve(len(requests[i].tokens) - state.base + k)
        except CacheFullError:
            return None
        size = graphs.graph_size(len(live), width)
        if size is None:
            return None
        inputs = graphs.inputs[size, width]
        feeds, bases, last = [], [0] * size, [j * width for j in range(size)]
        for row, ((_, state, _), count) in enumerate(zip(live, counts)):
            first = state.base + state.seq.length
            feeds.append(state.tokens[first + 1: first + 1 + count])
            inputs.hidden[row * width: row * width + count].copy_(state.pending[:count])
            state.pending = state.pending[count:] if count < state.num_pending else None
            bases[row], last[row] = state.base, row * width + count - 1
        pages = [state.seq.pages for _, state, _ in live]
        graphs.stage(size, feeds, [state.seq.length for _, state, _ in live], pages, width=width)
        for state, count in zip((state for _, state, _ in live), counts):
            state.seq.length += count  # the absorbed entries are real; the chained steps' are dropped
        for j, buffers in enumerate(inputs.step_buffers, start=1):  # step j feeds draft j at the next position
            graphs.step_inputs(buffers, [state.seq.length + j - 1 for _, state, _ in live], pages, size)
        inputs.positions.copy_(torch.tensor(bases + last, dtype=torch.long))
        graph, _, tokens = graphs.graphs[size, width]
        graph.replay()
        drafted = [row[:k_job] for row, (_, _, k_job) in zip(tokens[: len(live)].tolist(), live)]
        self.stats["graph_proposals"] += 1
        self.stats["mtp_forwards"] += k
        self.stats["mtp_tokens"] += sum(counts) + sum(min(k_job, k) - 1 for _, _, k_job in live)
        return drafted

    # ---- MTP forwards -----------------------------------------------------------------------------

    def _absorb(self, work: list[tuple[_JobState, int]]) -> tuple[torch.Tensor, list[int]]:
        """Turn pending hidden states into cache entries, for each (job, ``stop``) the positions before ``stop``
        (at least one); returns each job's last output row and its greedy token."""
        feeds, hiddens, states = [], [], []
        for state, stop in work:
            first = state.base + state.seq.length
            count = min(state.num_pending, stop - first)
            state.seq.reserve(first - state.base + count)
            feeds.append(state.tokens[first + 1: first + 1 + count])
            hiddens.append(state.pending[:count])
            state.pending = state.pending[count:] if count < state.num_pending else None
            states.append(state)
        return self._run(states, feeds, torch.cat(hiddens))

    def _run(self, states: list[_JobState], feeds: list[list[int]], hidden: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """One MTP forward: ``feeds[j]`` next tokens paired with ``hidden`` rows, appended to each job's entries."""
        batch = ForwardBatch.with_cache(feeds, [s.seq.length for s in states], [s.seq.pages for s in states], self.cache)
        bases = torch.tensor([s.base for s in states], dtype=torch.long, device=batch.positions.device)
        batch.positions = batch.positions + bases[token_sequences(batch.cu_seqlens, batch.num_tokens)]  # absolute, for RoPE
        batch.max_seq_len = max(s.base + s.seq.length + len(f) for s, f in zip(states, feeds))
        y_last, logits = self._mtp_rows(batch, hidden)
        for s, f in zip(states, feeds):
            s.seq.length += len(f)
        tokens = logits.argmax(dim=-1).tolist()
        self.stats["mtp_forwards"] += 1
        self.stats["mtp_tokens"] += batch.num_tokens
        return y_last, tokens


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@attrs.define
class _ProposalInputs:
    """A proposal graph's static inputs beyond its absorb batch (see :class:`ProposalGraphs`)."""

    hidden: torch.Tensor  # [size * W, hidden]: each job's new target hidden states (after the final norm), then anything
    positions: torch.Tensor  # [2 * size] int64: each job's first MTP position, then the row of its last real pair
    step_buffers: list[StepBuffers]  # one decode batch per chained step
    steps: list[ForwardBatch]


class ProposalGraphs(GraphRunner):
    """CUDA graphs of a whole MTP proposal, one per (padded batch size, W = k + 1): the absorb forward over W rows
    per job (its new (hidden state, next token) pairs, at most W, then placeholders), the greedy token after each
    job's last real pair, then k - 1 chained one-token steps, each fed the previous step's token and output on the
    device. One replay and one read-back per proposal instead of k eager forwards read back one by one.

    The absorb batch lives in the runner's ``(size, W)`` buffers; the hidden rows, each job's first position (MTP
    entries are counted from it, RoPE wants absolute positions), its last real row and the chained steps' decode
    batches are further static inputs (:class:`_ProposalInputs`). Padding jobs and placeholders write to the
    runner's scratch page of the MTP cache; a chained step's entries past the committed ones are dropped after
    the proposal, as eager proposals drop them.
    """

    def __init__(self, proposer: MTPProposer, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES):
        self.proposer = proposer
        self.inputs: dict[tuple[int, int], _ProposalInputs] = {}
        super().__init__(proposer.target, proposer.cache, batch_sizes=batch_sizes)

    def step_inputs(self, buffers: StepBuffers, cached_lens: Sequence[int], pages: Sequence[Sequence[int]],
                    size: int) -> ForwardBatch:
        """Write one chained step's decode batch (one token per job after ``cached_lens`` entries) into ``buffers``;
        its token comes from the step before it, on the device."""
        return self._build(buffers, [[0]] * len(cached_lens), cached_lens, pages, range(len(cached_lens)), size)

    def _capture(self, size: int, width: int = 1):
        absorb = self._padding_batch(size, width)
        weight = self.proposer.target.embed.weight
        buffers = [self._new_buffers(size, 1) for _ in range(width - 2)]
        inputs = self.inputs[size, width] = _ProposalInputs(
            hidden=torch.zeros(size * width, weight.shape[1], dtype=weight.dtype, device=self.device),
            positions=torch.cat([torch.zeros(size, dtype=torch.long), torch.arange(size) * width]).to(self.device),
            step_buffers=buffers, steps=[self.step_inputs(b, [], [], size) for b in buffers])
        graph, out = self._record(lambda: self._draft(absorb, inputs, size, width))
        return graph, absorb, out

    def _draft(self, absorb: ForwardBatch, inputs: _ProposalInputs, size: int, width: int) -> torch.Tensor:
        """[size, k] greedy draft tokens (see the class docstring)."""
        target, head = self.proposer.target, self.proposer.head
        bases, last = inputs.positions[:size], inputs.positions[size:]
        batch = attrs.evolve(absorb, positions=absorb.positions + bases[:, None].expand(size, width).reshape(-1))
        y = head.forward(target.embed.forward(absorb.input_ids), inputs.hidden, batch)[last]
        token = target.lm_head.forward(y).float().argmax(dim=-1)
        tokens = [token]
        for step in inputs.steps:
            y = head.forward(target.embed.forward(token), y, attrs.evolve(step, positions=step.positions + bases))
            token = target.lm_head.forward(y).float().argmax(dim=-1)
            tokens.append(token)
        return torch.stack(tokens, dim=1)
