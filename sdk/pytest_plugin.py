"""pytest plugin (entry point ``pytest11``): parity-kit fixtures for architecture plugin authors.

Installed with trellm, so any project's tests can use these fixtures without imports:

    def test_my_family(assert_parity):
        assert_parity("MyForCausalLM", hidden_size=64, sliding_window=8)

or, step by step:

    def test_my_family(tiny_hf_model, trellm_parity):
        report = trellm_parity(tiny_hf_model("MyForCausalLM", hidden_size=64))
        report.assert_ok()

transformers (a test-only dependency) is imported only when a fixture is used; tests that use
the fixtures are skipped when it is missing.
"""
from __future__ import annotations

import pytest


def _require_transformers():
    return pytest.importorskip("transformers", reason="the parity kit compares against HF transformers")


@pytest.fixture
def tiny_hf_model(tmp_path_factory):
    """``tiny_hf_model(architecture, seed=0, **config_overrides) -> Path`` of a saved random-weight HF model.

    Skips the test when the installed transformers has no class ``architecture``.
    """
    transformers = _require_transformers()
    from .testing import make_tiny_hf_model

    def make(architecture: str, seed: int = 0, **overrides):
        if not hasattr(transformers, architecture):
            pytest.skip(f"transformers {transformers.__version__} has no {architecture}")
        return make_tiny_hf_model(architecture, tmp_path_factory.mktemp(architecture), seed=seed, **overrides)

    return make


@pytest.fixture
def trellm_parity():
    """``trellm_parity(model_dir, **kwargs) -> ParityReport`` (see trellm.sdk.testing.check_parity)."""
    _require_transformers()
    from .testing import check_parity

    return check_parity


@pytest.fixture
def assert_parity(tiny_hf_model, trellm_parity):
    """``assert_parity(architecture, check=None, **config_overrides) -> ParityReport``: build, compare, assert.

    ``check`` is a dict of keyword arguments for check_parity (``prompts``, ``max_new_tokens``,
    ``tolerance`` ...). The report is printed, so ``pytest -s`` shows the numbers.
    """

    def run(architecture: str, check: dict | None = None, seed: int = 0, **overrides):
        report = trellm_parity(tiny_hf_model(architecture, seed=seed, **overrides), **(check or {}))
        print(report)
        report.assert_ok()
        return report

    return run
