"""Seed-OSS (SeedOssForCausalLM): Llama whose o_proj bias has its own flag (``attention_out_bias``)."""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import decoder_family

SPEC = decoder_family(
    "seed_oss",
    ("SeedOssForCausalLM",),
    configure=lambda cfg, opts: attrs.evolve(opts, o_bias=bool(cfg.extra.get("attention_out_bias", False))),
    description="ByteDance Seed-OSS: q/k/v bias, separate o_proj bias flag",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
