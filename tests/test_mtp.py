"""Qwen3.5 multi-token-prediction heads (``mtp.*``) loaded and run as a speculative draft.

transformers ignores ``mtp.*``, so there is no HF model to compare with; the tests check by construction.
Tiny random Qwen3.5 (dense) and Qwen3.5 MoE checkpoints get random ``mtp.*`` tensors written into their
safetensors file. The reference MTP is written out here in torch (input norms, concat [embedding |
hidden], fc, output norm, LM head) around HF's own decoder layer class loaded with the ``mtp.layers.0``
weights (the MTP layer is a full-attention layer of the model's kind). Checked: loading with and without
``mtp.*``; the head against the reference; the proposer's chained drafts (paged MTP cache, chunked
hidden states, draft-entry rollback) against the reference chain; greedy generator output identical
with and without the MTP draft, batched, with prefix reuse, and with drafts the target accepts.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import trellm
from safetensors.torch import load_file, save_file
from trellm.batch import ForwardBatch
from trellm.cache.recurrent import state_layers
from trellm.generator import DraftRequest, Generator, Job, JobFinished
from trellm.generator.mtp import MTPError, MTPProposer, mtp_head_of
from trellm.sdk.testing import make_tiny_hf_model

LINEAR = {
    "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
}
EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
FAMILIES = {"qwen3_5": ("Qwen3_5ForCausalLM", LINEAR), "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", {**LINEAR, **EXPERTS})}


def attention_layer(tensors: dict[str, torch.Tensor]) -> int:
    """The first full-attention layer of a checkpoint (the MTP layer has its tensor names and shapes)."""
    return min(int(name.split(".")[2]) for name in tensors if name.endswith("self_attn.q_proj.weight"))


def add_mtp_tensors(model_dir, seed: int = 0, layer: str = "mtp.layers.0.", fc: str = "mtp.fc.weight",
                    norms: tuple[str, ...] = ("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm"),
                    norm_center: float = 0.0) -> dict[str, torch.Tensor]:
    """Write random MTP tensors into the checkpoint: a copy of the shapes of the model's own attention layer
    under ``layer``, the [hidden, 2 hidden] ``fc`` and the ``norms``, in Qwen3.5's names by default.
    ``norm_center``: what norm weights scatter around (0 for the 1 + w norms of Qwen3.5, 1 for plain ones)."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    hidden = tensors["model.norm.weight"].shape[0]
    mtp = {}
    prefix = f"model.layers.{attention_layer(tensors)}."
    for name, t in tensors.items():
        if name.startswith(prefix):
            scale = 0.1 if t.dim() == 1 else float(t.std())  # 1-D: norm weights and biases
            center = norm_center if name.endswith("norm.weight") else 0.0
            mtp[layer + name[len(prefix):]] = center + torch.randn(t.shape, generator=g) * scale
    mtp[fc] = torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5
    for norm in norms:
        mtp[f"{norm}.weight"] = norm_center + torch.randn(hidden, generator=g) * 0.1
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})
    return mtp


class Reference:
    """The MTP math by hand around HF's decoder layer (loaded from a copy of the checkpoint whose attention
    layer holds the mtp.layers.0 weights, so HF's own loader converts them)."""

    def __init__(self, plain_dir, mtp: dict[str, torch.Tensor], tmp):
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(plain_dir, dtype=torch.float32).eval()
        ref_dir = tmp / "hf_mtp_layer"
        shutil.copytree(plain_dir, ref_dir)
        tensors = load_file(ref_dir / "model.safetensors")
        index = attention_layer(tensors)
        for name, t in mtp.items():
            if name.startswith("mtp.layers.0."):
                tensors[f"model.layers.{index}." + name[len("mtp.layers.0."):]] = t
        save_file(tensors, ref_dir / "model.safetensors", metadata={"format": "pt"})
        holder = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
        self.layer, self.rotary = holder.model.layers[index], holder.model.rotary_emb
        self.w, self.eps = mtp, self.hf.config.rms_norm_eps

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.w[f"mtp.{name}.weight"])

    @torch.no_grad()
    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        """HF's last hidden state (after the final norm: what the LM head reads) at every position."""
        return self.hf.model(torch.tensor([tokens])).last_hidden_state[0]

    @torch.no_grad()
    def mtp(self, hidden: torch.Tensor, next_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (h_i, t_{i+1}) at positions 0..T-1 -> (y [T, hidden] after mtp.norm, logits [T, vocab])."""
        e = self.hf.model.embed_tokens(torch.tensor(next_tokens))
        x = torch.cat([self.norm(e, "pre_fc_norm_embedding"), self.norm(hidden, "pre_fc_norm_hidden")], -1) @ self.w["mtp.fc.weight"].T
        n = x.shape[0]
        positions = torch.arange(n)[None]
        cos_sin = self.rotary(x[None], positions[None].expand(3, 1, n))
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = self.norm(self.layer(x[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)[0], "norm")
        return y, self.hf.lm_head(y)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """The greedy chain after ``tokens``: the target's h_0..h_{n-2} with t_1..t_{n-1}, then the MTP's own y."""
        hidden, nexts = list(self.target_hidden(tokens)[:-1]), list(tokens[1:])
        out = []
        for _ in range(k):
            y, logits = self.mtp(torch.stack(hidden), nexts)
            out.append(int(logits[-1].argmax()))
            hidden.append(y[-1])
            nexts.append(out[-1])
        return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    arch, cfg = FAMILIES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    plain = make_tiny_hf_model(arch, tmp / "plain", **cfg)
    with_mtp = tmp / "with_mtp"
    shutil.copytree(plain, with_mtp)
    mtp = add_mtp_tensors(with_mtp)
    return {
        "plain": trellm.load(plain, device="cpu", dtype=torch.float32, tokenizer=False),
        "lm": trellm.load(with_mtp, device="cpu", dtype=torch.float32, tokenizer=False),
        "ref": Reference(plain, mtp, tmp),
        "mtp": mtp,
    }


def random_tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_loading_with_and_without_mtp(family):
    plain, lm = family["plain"], family["lm"]
    assert mtp_head_of(plain) is None
    with pytest.raises(MTPError, match="no MTP weights"):
        MTPProposer(plain)
    head = mtp_head_of(lm)
    assert head is not None
    assert torch.equal(head.fc.impl.weight, family["mtp"]["mtp.fc.weight"])
    assert torch.equal(head.norm.weight, family["mtp"]["mtp.norm.weight"])
    assert lm.model.nbytes() > plain.model.nbytes()
    tokens = random_tokens(lm.config.vocab_size, 12, 0)
    assert torch.equal(lm.logits([tokens]), plain.logits([tokens]))  # the main model is untouched


def test_family_without_mtp_head(tmp_path):
    llama = trellm.load(make_tiny_hf_model("LlamaForCausalLM", tmp_path), device="cpu", dtype=torch.float32, tokenizer=False)
    with pytest.raises(MTPError, match="no MTP head"):
        MTPProposer(llama)


def test_mtp_head_matches_reference(family):
    lm, ref = family["lm"], family["ref"]
    tokens = random_tokens(lm.config.vocab_size, 30, 1)
    hidden = ref.target_hidden(tokens)
    ours_hidden = lm.model.norm.forward(lm.model.hidden_states(ForwardBatch.no_cache([tokens])))
    torch.testing.assert_close(ours_hidden, hidden, atol=1e-4, rtol=1e-4)
    want_y, want_logits = ref.mtp(hidden[:-1], tokens[1:])
    batch = ForwardBatch.no_cache([tokens[1:]])
    head = mtp_head_of(lm)
    with torch.inference_mode():
        y = head.forward(lm.model.embed.forward(batch.input_ids), hidden[:-1], batch)
        logits = lm.model.lm_head.forward(y)
    torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pending_limit,graphs", [(1024, False), (5, False), (1024, True)])
def test_proposer_drafts_match_reference_chain(family, pending_limit, graphs, monkeypatch):
    """Hidden states arrive in chunks (a prefill split in two, then decode rows); two jobs draft in one
    batch; the second proposal reuses the cache entries of the first and drops its draft entries.
    ``pending_limit`` 5: hidden states are absorbed into the MTP cache as they arrive (long prompts).
    ``graphs``: proposals with few new hidden states replay a proposal graph (an eager stand-in on CPU)."""
    monkeypatch.setattr("trellm.generator.mtp.MAX_PENDING_ROWS", pending_limit)
    lm, ref = family["lm"], family["ref"]
    proposer = MTPProposer(lm, num_tokens=3, cache_tokens=256, page_size=16)
    if graphs:
        from test_graph_spec import EagerProposals

        proposer.graphs = EagerProposals(proposer, batch_sizes=(1, 2))
    vocab = lm.config.vocab_size
    seqs = {"a": random_tokens(vocab, 40, 2), "b": random_tokens(vocab, 9, 3)}

    def observe(key, start, stop):
        tokens = seqs[key]
        with torch.inference_mode():
            pre_norm = lm.model.hidden_states(ForwardBatch.no_cache([tokens]))
        proposer.observe_hidden(key, start, pre_norm[start:stop], tokens)

    observe("a", 0, 17)
    observe("a", 17, 39)  # h_0..h_38: the target has computed all but the last token
    observe("b", 0, 8)
    drafts = proposer.propose([DraftRequest("a", seqs["a"], 3), DraftRequest("b", seqs["b"], 2)])
    assert drafts == [ref.draft(seqs["a"], 3), ref.draft(seqs["b"], 2)]
    seqs["a"] = seqs["a"] + random_tokens(vocab, 2, 4)  # two more tokens committed
    observe("a", 39, 41)
    assert proposer.propose([DraftRequest("a", seqs["a"], 3)]) == [ref.draft(seqs["a"], 3)]
    assert proposer.stats["graph_proposals"] == (1 if graphs else 0)  # the first proposal absorbs a whole prompt
    proposer.release("a")
    proposer.release("b")
    proposer.close()
    assert proposer.cache.allocator.free_pages == proposer.cache.num_pages


class OracleMix:
    """Wraps the MTP proposer: records every MTP draft, but every other call drafts the known greedy
    continuation instead (last token wrong every fourth call), so the target accepts drafts fully and
    partially and the MTP must follow the accepted tokens' hidden states."""

    def __init__(self, mtp: MTPProposer, full_sequences: list[list[int]]):
        self.mtp, self.full_sequences, self.calls, self.records = mtp, full_sequences, 0, []

    def observe_hidden(self, *args) -> None:
        self.mtp.observe_hidden(*args)

    def propose(self, requests):
        drafts = self.mtp.propose(requests)
        self.records += [(list(r.tokens), d) for r, d in zip(requests, drafts) if d]
        self.calls += 1
        if self.calls % 2:
            return drafts
        out = []
        for r in requests:
            seq = next(s for s in self.full_sequences if s[: len(r.tokens)] == list(r.tokens))
            draft = seq[len(r.tokens): len(r.tokens) + r.max_tokens]
            if draft and self.calls % 4 == 0:
                draft[-1] = (draft[-1] + 1) % 256
            out.append(draft)
        return out

    def release(self, key) -> None:
        self.mtp.release(key)


def run(gen: Generator, prompts: list[list[int]], new_tokens: int, one_at_a_time: bool = False) -> list[JobFinished]:
    done = []
    with torch.inference_mode():
        for group in ([[p] for p in prompts] if one_at_a_time else [prompts]):
            gen.enqueue([Job(list(p), new_tokens, stop_token_ids=[], identifier=len(done) + i) for i, p in enumerate(group)])
            while gen.has_work():
                done += [r for r in gen.iterate() if isinstance(r, JobFinished)]
    return sorted(done, key=lambda r: r.identifier)


def acceptance(done: list[JobFinished]) -> str:
    proposed, accepted = sum(r.draft_proposed for r in done), sum(r.draft_accepted for r in done)
    return f"{accepted}/{proposed} draft tokens accepted ({accepted / max(proposed, 1):.0%})"


def test_generator_greedy_output_identical_with_mtp_draft(family, capsys):
    """Three jobs, two at a time (chunked prefill next to drafted decode), with and without the MTP draft."""
    lm = family["lm"]
    vocab = lm.config.vocab_size
    prompts = [random_tokens(vocab, n, 10 + n) for n in (40, 9, 23)]
    make = lambda proposer: Generator(lm, max_batch_size=2, max_chunk_tokens=16, cache_tokens=512, page_size=16,
                                      proposer=proposer, num_draft_tokens=3)
    want = run(make(None), prompts, 20)
    proposer = MTPProposer(lm, num_tokens=3, cache_tokens=512, page_size=16)
    gen = make(proposer)
    done = run(gen, prompts, 20)
    assert [r.token_ids for r in done] == [r.token_ids for r in want]
    assert sum(r.draft_proposed for r in done) > 0 and proposer.stats["mtp_forwards"] > 0
    gen.verify_pages()
    gen.clear_prefix_cache()
    assert all(layer.free_slots == layer.max_slots for layer in state_layers(gen.cache))
    assert proposer.cache.allocator.free_pages == proposer.cache.num_pages  # every job's MTP pages released
    with capsys.disabled():
        print(f"\n[{lm.spec.name}] MTP draft on random weights: {acceptance(done)}")


def test_generator_mtp_drafts_follow_accepted_tokens(family, capsys):
    """With drafts the target accepts (oracle drafts mixed in) and with prefix reuse, output stays plain
    greedy, and every MTP draft equals the reference chain over the job's committed tokens."""
    lm, ref = family["lm"], family["ref"]
    vocab = lm.config.vocab_size
    prompts = [random_tokens(vocab, 37, 20), random_tokens(vocab, 14, 21)]
    make = lambda proposer, prefix=False: Generator(lm, max_batch_size=2, max_chunk_tokens=16, cache_tokens=512,
                                                    page_size=16, proposer=proposer, num_draft_tokens=3, prefix_caching=prefix)
    want = run(make(None), prompts, 16)
    mix = OracleMix(MTPProposer(lm, num_tokens=3, cache_tokens=512, page_size=16), [p + r.token_ids for p, r in zip(prompts, want)])
    done = run(make(mix), prompts, 16)
    assert [r.token_ids for r in done] == [r.token_ids for r in want]
    assert 0 < sum(r.draft_accepted for r in done) < sum(r.draft_proposed for r in done)
    assert len(mix.records) >= 6
    for tokens, draft in mix.records[::2]:
        assert draft == ref.draft(tokens, len(draft)), len(tokens)

    # prefix reuse: the second job starts after 32 cached tokens, so its MTP cache starts there too
    shared = prompts[0][:34]
    reuse_prompts = [shared + random_tokens(vocab, 5, 22), shared + random_tokens(vocab, 3, 23)]
    want = run(make(None), reuse_prompts, 12, one_at_a_time=True)
    gen = make(MTPProposer(lm, num_tokens=3, cache_tokens=512, page_size=16), prefix=True)
    done = run(gen, reuse_prompts, 12, one_at_a_time=True)
    assert [r.token_ids for r in done] == [r.token_ids for r in want]
    assert gen.stats["reused_tokens"] == 32 and done[1].draft_proposed > 0
    gen.verify_pages()
    with capsys.disabled():
        print(f"\n[{lm.spec.name}] MTP drafts with prefix reuse: {acceptance(done)}")


def test_server_draft_model_mtp(family):
    """``trellm serve --draft-model mtp``: the server's generator drafts with the model's MTP head."""
    engine = pytest.importorskip("trellm.server.engine")
    lm = family["lm"]
    settings = engine.LoadSettings(model_dir=Path(lm.model_dir), model_name="tiny", cache_size=512, page_size=16,
                                   cache_bits=None, draft_model=Path("mtp"), num_draft_tokens=2, max_batch_size=2,
                                   max_chunk_tokens=64, device="cpu", dtype="float32")
    _, gen = engine._build(settings)
    assert isinstance(gen.proposer, MTPProposer) and gen.proposer.num_tokens == 2 and gen.hidden_sink is not None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_mtp_draft_on_cuda(name, tmp_path):
    """On the GPU (head_dim 64: the paged-attention kernel runs): the MTP head matches the CPU one, and greedy
    output is identical with and without the MTP draft, jobs batched."""
    arch, cfg = FAMILIES[name]
    model_dir = make_tiny_hf_model(arch, tmp_path / "m", **{**cfg, "head_dim": 64})
    add_mtp_tensors(model_dir)
    cpu_lm = trellm.load(model_dir, device="cpu", dtype=torch.float32, tokenizer=False)
    lm = trellm.load(model_dir, device="cuda", dtype=torch.float32, tokenizer=False)
    vocab = lm.config.vocab_size
    tokens = random_tokens(vocab, 30, 1)
    with torch.inference_mode():
        outs = []
        for model in (cpu_lm, lm):
            batch = ForwardBatch.no_cache([tokens[1:]], device=model.device)
            hidden = model.model.norm.forward(model.model.hidden_states(ForwardBatch.no_cache([tokens], device=model.device)))
            outs.append(mtp_head_of(model).forward(model.model.embed.forward(batch.input_ids), hidden[:-1], batch).cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-3, rtol=1e-3)
    prompts = [random_tokens(vocab, n, 30 + n) for n in (70, 9, 23, 40)]
    make = lambda proposer: Generator(lm, max_batch_size=3, max_chunk_tokens=32, cache_tokens=1024, page_size=16,
                                      proposer=proposer, num_draft_tokens=3)
    want = run(make(None), prompts, 24)
    proposer = MTPProposer(lm, num_tokens=3, cache_tokens=1024, page_size=16)
    gen = make(proposer)
    done = run(gen, prompts, 24)
    assert [r.token_ids for r in done] == [r.token_ids for r in want]
    assert sum(r.draft_proposed for r in done) > 0
    gen.verify_pages()
    # the dense head's proposals replay graphs; an MoE head's only where its experts have the sync-free pair path
    assert proposer.graphs is not None and (proposer.stats["graph_proposals"] > 0 or name != "qwen3_5")
    print(f"[{name}] proposals replayed from graphs: {proposer.stats['graph_proposals']}")
    proposer.close()  # the proposal graphs' scratch page back
    assert proposer.cache.allocator.free_pages == proposer.cache.num_pages
    print(f"[{name}] cuda MTP draft on random weights: {acceptance(done)}")


def test_generator_sampling_and_banned_strings_with_mtp_draft(family):
    """Seeded sampling (one draw per committed token) and banned-string rewinds (the MTP drops what the
    rewound tokens fed it) give the same tokens with and without the MTP draft."""
    from test_generator import byte_tokenizer  # tests/ is on sys.path
    from trellm.generator import SamplerSettings

    lm = family["lm"]
    tok = byte_tokenizer()
    prompt = torch.randint(33, 120, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    settings = SamplerSettings(temperature=0.8, top_k=20)

    def generate(proposer, **kw):
        gen = Generator(lm, tokenizer=tok, cache_tokens=512, page_size=8, max_chunk_tokens=24, proposer=proposer, num_draft_tokens=3)
        with torch.inference_mode():
            out = gen.generate(prompt, 24, stop_token_ids=[], return_results=True, **kw)
        gen.verify_pages()
        return out

    mtp = lambda: MTPProposer(lm, num_tokens=3, cache_tokens=512, page_size=8)
    sampled = generate(None, sampler=settings, seed=7)
    assert generate(mtp(), sampler=settings, seed=7).token_ids == sampled.token_ids
    plain = generate(None)
    banned = plain.text[10:13]
    want = generate(None, banned_strings=[banned])
    got = generate(mtp(), banned_strings=[banned])
    assert banned not in got.text and got.token_ids == want.token_ids and got.draft_proposed > 0
