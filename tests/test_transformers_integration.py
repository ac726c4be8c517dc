"""`trellm.integrations.transformers`: an EXL3 directory loads in HF transformers and runs trellm's EXL3 op."""
from __future__ import annotations

import pytest
import torch

import trellm
from trellm.convert import convert

from test_convert import FAST, make_tiny_llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def exl3_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_integration")
    src = make_tiny_llama(root / "dense")
    convert(src, root / "q4", root / "work", 4.0, **FAST)
    return src, root / "q4"


def test_exl3_dir_loads_in_transformers_and_matches_trellm(exl3_dirs):
    import trellm.integrations.transformers as integration

    _, q4 = exl3_dirs
    hf = transformers.AutoModelForCausalLM.from_pretrained(q4, dtype=torch.float32)
    swapped = [n for n, m in hf.named_modules() if isinstance(m, integration.EXL3HFLinear)]
    assert len(swapped) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    ours = trellm.load(q4, device="cpu", dtype=torch.float32, tokenizer=False).logits(ids)
    span = (ours.max() - ours.min()).item()
    assert (theirs - ours).abs().max().item() <= 1e-3 * span
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))
    out = hf.generate(ids[:1, :8], max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 14)


def test_dense_model_is_untouched(exl3_dirs):
    import trellm.integrations.transformers as integration

    dense, _ = exl3_dirs
    hf = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    assert not any(isinstance(m, integration.EXL3HFLinear) for m in hf.modules())
    assert getattr(hf, "hf_quantizer", None) is None


@pytest.mark.cuda
def test_exl3_dir_in_transformers_on_cuda_runs_the_kernels(ops, exl3_dirs):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import trellm.integrations.transformers  # noqa: F401  (a `-m cuda` run skips the tests that import it)

    _, q4 = exl3_dirs
    hf = transformers.AutoModelForCausalLM.from_pretrained(q4, dtype=torch.float16, device_map="cuda")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf(ids.cuda()).logits.float().cpu()
    ours = trellm.load(q4, device="cuda", dtype=torch.float16, tokenizer=False).logits(ids).float().cpu()
    span = (ours.max() - ours.min()).item()
    assert (theirs - ours).abs().max().item() <= 1e-2 * span
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean().item() > 0.95
