"""pytest plugin (entry point ``pytest11``): parity-kit fixtures for architecture plugin authors.

    def test_my_family(tiny_hf_model, trellm_parity):
        trellm_parity(tiny_hf_model("MyForCausalLM", hidden_size=64)).assert_ok()
"""
from __future__ import annotations

import pytest


@pytest.fixture
def tiny_hf_model(tmp_path_factory):
    """``tiny_hf_model(architecture, **config_overrides) -> Path`` of a saved random-weight HF model."""
    from .testing import make_tiny_hf_model

    def make(architecture: str, seed: int = 0, **overrides):
        return make_tiny_hf_model(architecture, tmp_path_factory.mktemp(architecture), seed=seed, **overrides)

    return make


@pytest.fixture
def trellm_parity():
    """``trellm_parity(model_dir, **kwargs) -> ParityReport`` (see trellm.sdk.testing.check_parity)."""
    from .testing import check_parity

    return check_parity
