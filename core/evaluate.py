"""``trellm eval``: perplexity of a (quantized) model and KL(reference || model) on a fixed text.

The text (a built-in held-out passage, or a user file) is tokenized with the model's tokenizer and
cut into windows of ``seq_len`` tokens; each window is scored with whole-sequence logits. With a
reference (the dense model), both models see the same windows and the per-token KL divergence of
the quantized distribution from the dense one is averaged, the usual quantization-quality measure.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from .errors import TrellmError, UsageError


def eval_text() -> str:
    """Built-in evaluation text: held out from the calibration mix (different passages)."""
    return (Path(__file__).parent / "data" / "eval.txt").read_text(encoding="utf-8")


def token_windows(tokenizer, text: str, seq_len: int, max_windows: int) -> list[list[int]]:
    if seq_len < 2 or max_windows < 1:
        raise UsageError(f"seq_len must be 2 or more and max_windows 1 or more, got {seq_len} and {max_windows}")
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise TrellmError("evaluation text is too short (fewer than 2 tokens)")
    windows = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    windows = [w for w in windows if len(w) >= 2]
    return windows[:max_windows]


@torch.inference_mode()
def score(model_dir: str | Path, windows: list[list[int]], reference_dir: str | Path | None = None,
          device: str | None = None, dtype: str | None = None, tensor_parallel: int = 1, gpu_split=None) -> dict:
    """Perplexity of ``model_dir`` (and of ``reference_dir``) and mean KL(reference || model) per token."""
    import trellm

    quant = trellm.load(model_dir, device=device, dtype=dtype, tokenizer=False, tensor_parallel=tensor_parallel,
                        gpu_split=gpu_split)
    ref = trellm.load(reference_dir, device=device, dtype=dtype, tokenizer=False) if reference_dir else None
    nll_q = nll_r = kl = 0.0
    agree = tokens = 0
    for w in windows:
        ids = torch.tensor([w])
        target = ids[0, 1:].to(quant.device)
        lq = quant.logits(ids)[0, :-1].float().log_softmax(-1)
        nll_q += -lq.gather(1, target[:, None]).sum().item()
        if ref is not None:
            lr = ref.logits(ids)[0, :-1].float().log_softmax(-1).to(lq.device)
            nll_r += -lr.gather(1, target[:, None]).sum().item()
            kl += (lr.exp() * (lr - lq)).sum().item()
            agree += (lr.argmax(-1) == lq.argmax(-1)).sum().item()
        tokens += target.numel()
    quant.close()
    out = {"tokens": tokens, "ppl": math.exp(nll_q / tokens)}
    if ref is not None:
        out.update(ref_ppl=math.exp(nll_r / tokens), kl=kl / tokens, top1_agreement=agree / tokens)
    return out


def evaluate(model_dir: str | Path, reference_dir: str | Path | None = None, text_file: str | Path | None = None,
             device: str | None = None, dtype: str | None = None, seq_len: int = 512, max_windows: int = 16,
             tensor_parallel: int = 1, gpu_split=None) -> dict:
    """Load the tokenizer of ``model_dir``, cut the text into windows, and :func:`score`."""
    from .tokenizer import Tokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise TrellmError(f"{model_dir}: tokenizer.json is missing; evaluation needs the model's tokenizer")
    tok = Tokenizer.from_dir(model_dir)
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TrellmError(f"evaluation text {text_file}: cannot read as UTF-8 ({e})") from None
    else:
        text = eval_text()
    return score(model_dir, token_windows(tok, text, seq_len, max_windows), reference_dir, device, dtype, tensor_parallel,
                 gpu_split)


def plot_sweep(rows: list[dict], path: str | Path, title: str = "EXL3 quality vs bitrate") -> bool:
    """KL and perplexity against bits per weight (PNG); False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    bits = [r["bits"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.semilogy(bits, [max(r["kl"], 1e-6) for r in rows], "o-")
    a.set_xlabel("bits per weight")
    a.set_ylabel("KL(dense || quant) per token")
    a.grid(True, which="both", alpha=0.3)
    b.plot(bits, [r["ppl"] for r in rows], "o-", label="EXL3")
    if rows and "ref_ppl" in rows[0]:
        b.axhline(rows[0]["ref_ppl"], color="gray", linestyle="--", label="dense")
    b.set_xlabel("bits per weight")
    b.set_ylabel("perplexity")
    b.legend()
    b.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def add_cli(subparsers) -> None:
    from .cli import add_device_args, positive_int

    p = subparsers.add_parser("eval", help="perplexity and KL(dense || quantized) on a fixed text")
    p.add_argument("-m", "--model", required=True, help="model directory to evaluate (e.g. an EXL3 conversion)")
    p.add_argument("--reference", default=None, help="dense reference model directory (adds KL and its perplexity)")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: built-in held-out text)")
    add_device_args(p)
    p.add_argument("--seq-len", type=positive_int, default=512, help="tokens per window, 2 or more (default 512)")
    p.add_argument("--max-windows", type=positive_int, default=16, help="most windows to score (default 16)")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        r = evaluate(args.model, args.reference, args.text, args.device, args.dtype, args.seq_len, args.max_windows, args.tp,
                     args.gpu_split)
    except TrellmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    line = f"{args.model}: perplexity {r['ppl']:.4f} over {r['tokens']} tokens"
    if "kl" in r:
        line += f"; reference perplexity {r['ref_ppl']:.4f}; KL(ref || model) {r['kl']:.5f}; top-1 agreement {r['top1_agreement']:.4f}"
    print(line)
    return 0
