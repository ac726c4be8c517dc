"""The parity kit: hold a trellm architecture plugin against HF transformers on tiny random weights.

    from trellm.sdk.testing import make_tiny_hf_model, check_parity
    model_dir = make_tiny_hf_model("LlamaForCausalLM", tmp_path, num_key_value_heads=2)
    report = check_parity(model_dir)
    report.assert_ok()

transformers is a test-only dependency: it is imported here lazily.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import attrs
import torch

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


def make_tiny_hf_model(architecture: str, out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Build a random-weight HF model of ``architecture`` with tiny dimensions and save it (fp32)."""
    import transformers

    model_cls = getattr(transformers, architecture, None)
    if model_cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no class {architecture!r}")
    values = {**TINY_DEFAULTS, **overrides}
    config = model_cls.config_class(**values)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = model_cls(config).eval().float()
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out


@attrs.define
class ParityReport:
    max_abs_diff: float
    logit_range: float
    argmax_agree: float  # fraction of positions whose argmax agrees
    greedy_hf: list[list[int]]
    greedy_trellm: list[list[int]]
    tolerance: float

    @property
    def logits_ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance * self.logit_range and self.argmax_agree == 1.0

    @property
    def greedy_ok(self) -> bool:
        return self.greedy_hf == self.greedy_trellm

    def assert_ok(self) -> None:
        assert self.logits_ok, (
            f"logits differ: max |diff| {self.max_abs_diff:.3g} vs allowed {self.tolerance * self.logit_range:.3g} "
            f"({self.tolerance:g} of range {self.logit_range:.3g}); argmax agreement {self.argmax_agree:.3f}"
        )
        assert self.greedy_ok, f"greedy tokens differ:\n  hf     {self.greedy_hf}\n  trellm {self.greedy_trellm}"


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


def check_parity(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 32,
    tolerance: float = 1e-3,
    page_size: int = 16,
    seed: int = 0,
) -> ParityReport:
    """Compare prompt logits (no cache) and greedy continuations (trellm: paged cache, one token at a time)."""
    import transformers

    import trellm

    model_dir = Path(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    lm = trellm.load(model_dir, device="cpu", dtype=torch.float32)
    vocab = lm.config.vocab_size
    if prompts is None:
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (23, 9)]
    max_diff, lo, hi, agree, total = 0.0, float("inf"), float("-inf"), 0, 0
    with torch.no_grad():
        for p in prompts:
            ref = hf(torch.tensor([p])).logits[0].float()
            got = lm.logits([p])[0]
            max_diff = max(max_diff, float((ref - got).abs().max()))
            lo, hi = min(lo, float(ref.min())), max(hi, float(ref.max()))
            agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
            total += len(p)
    greedy_hf = [_hf_greedy(hf, list(p), max_new_tokens) for p in prompts]
    greedy_tr = []
    for p in prompts:
        cache = lm.new_cache(max_tokens=len(p) + max_new_tokens, page_size=page_size)
        greedy_tr.append(list(lm.generate_ids(list(p), max_new_tokens, stop_token_ids=[], cache=cache)))
    return ParityReport(max_diff, hi - lo, agree / total, greedy_hf, greedy_tr, tolerance)
