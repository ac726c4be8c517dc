"""The parity kit: hold a trellm architecture plugin against HF transformers on tiny random weights.

    from trellm.sdk.testing import make_tiny_hf_model, check_parity
    model_dir = make_tiny_hf_model("LlamaForCausalLM", tmp_path, num_key_value_heads=2)
    report = check_parity(model_dir)
    print(report)
    report.assert_ok()

Three comparisons, each against HF transformers running the same checkpoint in float32:

1. prompt logits: every position of two prompts of different lengths, run as one varlen batch
   without a cache;
2. cached decoding: the same prompts through the paged KV cache, a prefill chunk and then one
   token per step with both sequences batched together, compared with HF's logits position by
   position (this is what exercises sliding windows, NoPE layers and RoPE tables past the prompt);
3. greedy continuations: ``max_new_tokens`` tokens from HF ``generate`` and from trellm.

transformers is a test-only dependency: it is imported here lazily.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from trellm.capabilities import supports_images

TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.15,  # large enough that logits spread and argmax is meaningful
)


def make_tiny_hf_model(
    architecture: str, out_dir: str | Path, seed: int = 0, perturb_norms: bool = True, **overrides: Any
) -> Path:
    """Build a random-weight HF model of ``architecture`` with tiny dimensions and save it (fp32).

    ``overrides`` replace :data:`TINY_DEFAULTS` and set any other config key the family needs
    (``layer_types``, ``sliding_window``, softcaps ...); ``None`` is passed on as HF's "unset".
    ``perturb_norms`` adds noise to every 1-D parameter (norm weights, biases, scalars), which HF
    initialises to constants: otherwise a swapped or missing norm would go unnoticed.
    """
    import transformers

    model_cls = getattr(transformers, architecture, None)
    if model_cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no class {architecture!r}")
    values = {**TINY_DEFAULTS, **overrides}
    values.update(_token_ids_inside(model_cls.config_class(), values))
    config = model_cls.config_class(**values)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = model_cls(config).eval().float()
    if perturb_norms:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() <= 1 or (p.dim() == 2 and p.shape[0] * p.shape[1] <= 1024 and "norm" in _param_name(model, p)):
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out


def _token_ids_inside(default_config, values: dict[str, Any]) -> dict[str, Any]:
    """Families' default special-token ids may lie outside the tiny vocabulary: move them inside."""
    vocab = values["vocab_size"]
    fixed: dict[str, Any] = {}
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = values[name] if name in values else getattr(default_config, name, None)
        if isinstance(value, int) and value >= vocab:
            fixed[name] = vocab - 1
        elif isinstance(value, list) and any(v >= vocab for v in value):
            fixed[name] = [v if v < vocab else vocab - 1 for v in value]
    return fixed


def _param_name(model, param) -> str:
    for name, p in model.named_parameters():
        if p is param:
            return name
    return ""


@attrs.define
class ParityReport:
    """What :func:`check_parity` measured; ``print(report)`` gives a short table, ``assert_ok()`` the verdict."""

    max_abs_diff: float  # prompt logits, no cache
    logit_range: float  # max - min of HF's prompt logits: the tolerance is relative to it
    argmax_agree: float  # fraction of prompt positions whose argmax agrees
    greedy_hf: list[list[int]]
    greedy_trellm: list[list[int]]
    tolerance: float
    cached_max_abs_diff: float = 0.0  # logits through the paged cache, one token per step
    cached_argmax_agree: float = 1.0
    architecture: str = ""
    seconds: float = 0.0

    @property
    def cached_compared(self) -> bool:
        return not math.isnan(self.cached_max_abs_diff)

    @property
    def logits_ok(self) -> bool:
        allowed = self.tolerance * self.logit_range
        prompt_ok = self.max_abs_diff <= allowed and self.argmax_agree == 1.0
        cached_ok = not self.cached_compared or (self.cached_max_abs_diff <= allowed and self.cached_argmax_agree == 1.0)
        return prompt_ok and cached_ok

    @property
    def greedy_ok(self) -> bool:
        return self.greedy_hf == self.greedy_trellm

    @property
    def ok(self) -> bool:
        return self.logits_ok and self.greedy_ok

    def __str__(self) -> str:
        allowed = self.tolerance * self.logit_range
        verdict = lambda good: "ok" if good else "FAIL"
        greedy_same = sum(a == b for h, t in zip(self.greedy_hf, self.greedy_trellm) for a, b in zip(h, t))
        greedy_total = sum(len(h) for h in self.greedy_hf)
        rows = [
            f"parity {self.architecture or '(model)'}: {'PASS' if self.ok else 'FAIL'} ({self.seconds:.1f}s)",
            (
                f"  prompt logits   max|diff| {self.max_abs_diff:.3g} (allowed {allowed:.3g}), argmax {self.argmax_agree:.1%}"
                f"  {verdict(self.max_abs_diff <= allowed and self.argmax_agree == 1.0)}"
            ),
            (
                f"  cached decode   max|diff| {self.cached_max_abs_diff:.3g} (allowed {allowed:.3g}), argmax {self.cached_argmax_agree:.1%}"
                f"  {verdict(self.cached_max_abs_diff <= allowed and self.cached_argmax_agree == 1.0)}"
                if self.cached_compared
                else "  cached decode   not compared (the RoPE tables depend on the sequence length)"
            ),
            f"  greedy tokens   {greedy_same}/{greedy_total} identical  {verdict(self.greedy_ok)}",
        ]
        if not self.greedy_ok:
            rows += [f"    hf     {self.greedy_hf}", f"    trellm {self.greedy_trellm}"]
        return "\n".join(rows)

    def assert_ok(self) -> None:
        assert self.ok, str(self)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` torch threads (tiny models are fastest single-threaded), then restore."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF's own cached greedy decoding (what an HF user sees), exactly ``n`` tokens."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            use_cache=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def trellm_cached_logits(lm, prompts: Sequence[Sequence[int]], page_size: int = 16, prefill: int | None = None) -> list[torch.Tensor]:
    """Logits [len, vocab] of each prompt computed through the paged cache.

    All sequences share one batch per step: a prefill chunk of ``prefill`` tokens (default: half of
    the shortest prompt), then one token per sequence per step until each prompt is consumed.
    """
    from trellm.batch import ForwardBatch
    from trellm.cache import SequenceState

    prefill = prefill if prefill is not None else max(1, min(len(p) for p in prompts) // 2)
    cache = lm.new_cache(max_tokens=sum(len(p) + page_size for p in prompts), page_size=page_size)
    states = [SequenceState(cache, with_state_slot=True) for _ in prompts]
    outs: list[list[torch.Tensor]] = [[] for _ in prompts]
    try:
        while True:
            active = [i for i, p in enumerate(prompts) if states[i].length < len(p)]
            if not active:
                break
            chunks = []
            for i in active:
                n = prefill if states[i].length == 0 else 1
                chunk = list(prompts[i][states[i].length : states[i].length + n])
                states[i].reserve(states[i].length + len(chunk))
                chunks.append(chunk)
            slots = [states[i].state_slot for i in active]
            batch = ForwardBatch.with_cache(
                chunks, [states[i].length for i in active], [states[i].pages for i in active], cache, all_logits=True,
                state_slots=None if slots[0] is None else slots,
            )
            with torch.inference_mode():
                logits = lm.model.forward(batch).float().cpu()
            bounds = batch.cu_seqlens.tolist()
            for j, i in enumerate(active):
                outs[i].append(logits[bounds[j] : bounds[j + 1]])
                states[i].length += len(chunks[j])
    finally:
        for s in states:
            s.release()
    return [torch.cat(o) for o in outs]


def _rope_depends_on_length(config, longest: int) -> bool:
    """Dynamic NTK RoPE, and LongRoPE past its original length, change their tables with the longest
    sequence of each forward pass, so logits through a cache legitimately differ from whole-prompt
    logits (in HF too). The cached-logits comparison is skipped for them; greedy decoding still runs."""
    rope = getattr(config, "rope", None)
    ropes = [rope, *getattr(config, "layer_ropes", {}).values()] if rope is not None else []
    for r in ropes:
        if r.type == "dynamic":
            return True
        if r.type == "longrope" and longest > (r.original_max_position_embeddings or config.max_position_embeddings):
            return True
    return False


def load_hf_model(model_dir: Path):
    """The HF model in float32 with eager attention: AutoModelForCausalLM, or the class config.json names
    when that has no causal-LM mapping (image-text models such as Glm5NextForConditionalGeneration)."""
    import json

    import transformers

    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()
    except ValueError:
        names = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
        model_cls = getattr(transformers, names[0], None) if names else None
        if model_cls is None:
            raise
        return model_cls.from_pretrained(model_dir, **kwargs).eval()


def check_parity(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 32,
    tolerance: float = 1e-3,
    page_size: int = 16,
    seed: int = 0,
    num_threads: int | None = 1,
    reference_dir: str | Path | None = None,
) -> ParityReport:
    """Compare prompt logits, cached one-token-at-a-time logits and greedy continuations with HF.

    ``tolerance`` is relative to the range of HF's logits; argmax must agree everywhere and the
    greedy tokens must be identical. ``num_threads`` pins torch's thread count while checking
    (None leaves it alone). ``reference_dir``: the checkpoint HF runs, when transformers cannot load
    ``model_dir`` itself (the same weights under an architecture it has no class for).
    """
    with torch_threads(num_threads):
        return _check_parity(Path(model_dir), Path(reference_dir or model_dir), prompts, max_new_tokens, tolerance, page_size, seed)


def _check_parity(model_dir: Path, reference_dir: Path, prompts, max_new_tokens: int, tolerance: float, page_size: int,
                  seed: int) -> ParityReport:
    import transformers
    import trellm

    t0 = time.perf_counter()
    hf = load_hf_model(reference_dir)
    lm = trellm.load(model_dir, device="cpu", dtype=torch.float32)
    text = lm.model.language.config if supports_images(lm.model) else lm.config  # a vision model's config holds its text config
    vocab = text.vocab_size
    if prompts is None:
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (23, 9)]
    prompts = [list(p) for p in prompts]
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0].float() for p in prompts]
    got = [lm.logits([p])[0] for p in prompts]
    history_dependent = _rope_depends_on_length(text, max(len(p) for p in prompts))
    cached = None if history_dependent else trellm_cached_logits(lm, prompts, page_size)

    def compare(outputs) -> tuple[float, float]:
        diff, agree, total = 0.0, 0, 0
        for ref, out in zip(refs, outputs):
            out = out[: ref.shape[0]]
            diff = max(diff, float((ref - out).abs().max()))
            agree += int((ref.argmax(-1) == out.argmax(-1)).sum())
            total += ref.shape[0]
        return diff, agree / total

    max_diff, agree = compare(got)
    cached_diff, cached_agree = compare(cached) if cached is not None else (float("nan"), float("nan"))
    lo = min(float(r.min()) for r in refs)
    hi = max(float(r.max()) for r in refs)
    greedy_hf = [_hf_greedy(hf, p, max_new_tokens) for p in prompts]
    greedy_tr = []
    for p in prompts:
        cache = lm.new_cache(max_tokens=len(p) + max_new_tokens, page_size=page_size)
        greedy_tr.append(list(lm.generate_ids(p, max_new_tokens, stop_token_ids=[], cache=cache)))
    return ParityReport(
        max_abs_diff=max_diff,
        logit_range=hi - lo,
        argmax_agree=agree,
        greedy_hf=greedy_hf,
        greedy_trellm=greedy_tr,
        tolerance=tolerance,
        cached_max_abs_diff=cached_diff,
        cached_argmax_agree=cached_agree,
        architecture=(lm.raw_config.get("architectures") or [""])[0],
        seconds=time.perf_counter() - t0,
    )
