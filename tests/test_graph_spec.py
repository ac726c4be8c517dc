"""Speculative decoding through the GraphRunner: steps that verify drafts replay graphs of (batch size, k + 1)
tokens per row, rows with shorter drafts filled up with placeholders, and with an MTP proposer every graph
also returns the hidden states the head drafts from. Capture needs a GPU, so on CPU eager forwards stand in
for the captured graphs (``EagerGraphs``: the runner's own static buffers, padding and replay into fixed
outputs) and the tokens must equal eager drafting and plain greedy decoding."""
from __future__ import annotations

import pytest
import torch

import trellm
from trellm.batch import ForwardBatch
from trellm.generator import DraftModelProposer, DraftRequest, Generator, Job, JobFinished, NgramProposer, SamplerSettings
from trellm.generator.mtp import MTPProposer, ProposalGraphs
from trellm.sdk.testing import make_tiny_hf_model

from test_graph_hybrid import EagerGraphs, EagerRecording

VOCAB = 256  # every tiny model here (sdk.testing.TINY_DEFAULTS)
LLAMA = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024)


class Oracle:
    """Drafts the known greedy continuation, cut to a length that cycles through 1..k (rows of one step get
    different lengths, so the graph pads them) with a wrong token at the end of every third draft (partial
    acceptance); a plain n-gram lookup every fourth call (whatever it finds, often nothing)."""

    def __init__(self, continuations: list[list[int]], num_tokens: int):
        self.continuations, self.k, self.calls = continuations, num_tokens, 0
        self.ngram = NgramProposer(num_tokens=num_tokens)

    def propose(self, requests):
        self.calls += 1
        if self.calls % 4 == 0:
            return self.ngram.propose(requests)
        out = []
        for j, r in enumerate(requests):
            seq = next(s for s in self.continuations if s[: len(r.tokens)] == list(r.tokens))
            n = min(r.max_tokens, 1 + (self.calls + j) % self.k)
            draft = seq[len(r.tokens): len(r.tokens) + n]
            if draft and (self.calls + j) % 3 == 0:
                draft[-1] = (draft[-1] + 1) % VOCAB
            out.append(draft)
        return out

    def release(self, key) -> None:
        self.ngram.release(key)


class EagerProposals(EagerRecording, ProposalGraphs):
    """MTP proposal graphs with eager stand-ins for the captures (the runner's static inputs, padding, replay)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.enabled = self._scratch_page is not None


def graph_mtp(lm, k: int = 3) -> MTPProposer:
    """An MTP proposer whose proposals replay (eager stand-ins for) captured graphs."""
    proposer = MTPProposer(lm, num_tokens=k, cache_tokens=1024, page_size=16)
    proposer.graphs = EagerProposals(proposer, batch_sizes=(1, 2, 4))
    return proposer


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    loop = torch.randint(0, vocab, (6,), generator=g).tolist()
    return [loop * 6 + [1, 2], torch.randint(0, vocab, (9,), generator=g).tolist(), loop * 3]


def _run(lm, proposer=None, graphs: bool = False, sizes=(1, 2, 4), k: int = 3, sampled: bool = True):
    """Three jobs (one sampled with a seed) through a generator; with ``graphs`` its steps replay EagerGraphs (on
    a hybrid model with the state slots a CUDA generator makes: k per job for the verification's states)."""
    cache = None
    if graphs and hasattr(lm.model, "make_cache"):
        cache = lm.model.make_cache(max_tokens=1024, page_size=16, max_slots=4 * (1 + k) + 4 + 1)
    gen = Generator(lm, cache, cache_tokens=1024, page_size=16, max_batch_size=4, max_chunk_tokens=32, proposer=proposer,
                    num_draft_tokens=k)
    if graphs:
        gen.graph_runner = EagerGraphs(gen.model, gen.cache, batch_sizes=sizes, max_context=gen.cache.capacity_tokens,
                                       hidden_states=gen.hidden_sink is not None, max_width=1 + k)
    prompts = _prompts(VOCAB)
    sampler = SamplerSettings(temperature=0.8, top_k=20) if sampled else None
    jobs = [Job(prompts[0], 20, identifier=0, stop_token_ids=[]),
            Job(prompts[1], 15, identifier=1, stop_token_ids=[], sampler=sampler, seed=4),
            Job(prompts[2], 13, identifier=2, stop_token_ids=[])]
    with torch.inference_mode():
        gen.enqueue(jobs)
        done = sorted((r for r in gen.stream() if isinstance(r, JobFinished)), key=lambda r: r.identifier)
    gen.verify_pages()
    return [r.token_ids for r in done], gen, done


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.set_num_threads(1)
    return trellm.load(make_tiny_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), **LLAMA), device="cpu",
                       dtype=torch.float32, tokenizer=False)


def _verification_graphs(gen) -> list[tuple[int, int]]:
    return sorted(key for key in gen.graph_runner.graphs if key[1] > 1)


def _logits_of(out):
    return out[1] if isinstance(out, tuple) else out


def test_drafts_verified_through_graphs_dense(llama):
    """Oracle and n-gram drafts on a dense Llama: verification steps replay (batch, k + 1) graphs, short drafts
    are padded, and tokens equal eager drafting and plain decoding (a seeded sampled job included)."""
    plain, _, _ = _run(llama)
    prompts = _prompts(VOCAB)
    full = [p + t for p, t in zip(prompts, plain)]
    eager, _, _ = _run(llama, Oracle(full, 3))
    replayed, gen, done = _run(llama, Oracle(full, 3), graphs=True)
    assert replayed == eager == plain
    runner = gen.graph_runner
    assert _verification_graphs(gen) and runner.replays >= 5
    assert all(_logits_of(out).data_ptr() == runner._logits.data_ptr() for _, _, out in runner.graphs.values()), \
        "every graph writes its logits to the runner's one shared buffer"
    assert any(min(lens) < width for width, lens in runner.staged), "no step padded a short draft"
    assert any(width < 4 for width, _ in runner.staged), "every step drafted k tokens somewhere"
    accepted, proposed = sum(r.draft_accepted for r in done), sum(r.draft_proposed for r in done)
    assert 0 < accepted < proposed
    gen.graph_runner.close()
    gen.clear_prefix_cache()
    gen.verify_pages()

    ngram, gen, done = _run(llama, NgramProposer(num_tokens=4), graphs=True, k=4)
    assert ngram == plain and sum(r.draft_proposed for r in done) > 0 and _verification_graphs(gen)


def test_placeholder_tokens_borrow_the_scratch_page(llama):
    """A row whose pages end before its last placeholder token (a job near its end, next to longer drafts)
    writes that placeholder to the scratch page: the job's own pages and everyone's tokens are untouched."""
    borrowed = []

    class Watch(EagerGraphs):
        def stage(self, size, feeds, cached_lens, page_rows, *args, width: int = 1, **kwargs):
            if width > 1:
                borrowed.extend(c + width > len(p) * self.page_size for c, p in zip(cached_lens, page_rows))
            return super().stage(size, feeds, cached_lens, page_rows, *args, width=width, **kwargs)

    prompts = _prompts(VOCAB)
    # job 1 ends one token before its second page does (9 + 22 = 31): its last placeholders lie past its pages
    jobs = [Job(prompts[0], 40, identifier=0, stop_token_ids=[]), Job(prompts[1], 22, identifier=1, stop_token_ids=[])]
    plain = [list(llama.generate_ids(j.prompt_ids, j.max_new_tokens, stop_token_ids=[])) for j in jobs]
    gen = Generator(llama, cache_tokens=1024, page_size=16, max_batch_size=4, num_draft_tokens=4,
                    proposer=Oracle([j.prompt_ids + t for j, t in zip(jobs, plain)], 4))
    gen.graph_runner = Watch(gen.model, gen.cache, batch_sizes=(4,), max_context=gen.cache.capacity_tokens)
    with torch.inference_mode():
        gen.enqueue(jobs)
        done = {r.identifier: r.token_ids for r in gen.stream() if isinstance(r, JobFinished)}
    assert any(borrowed)
    assert [done[0], done[1]] == plain
    gen.verify_pages()


def test_draft_model_steps_through_graphs(llama, tmp_path):
    """A draft model's one-token draft steps replay its own decode graphs, the target verifies in its graphs: the
    tokens of plain greedy decoding, the drafts of the eager proposer."""
    plain, _, _ = _run(llama)
    draft = trellm.load(make_tiny_hf_model("LlamaForCausalLM", tmp_path, seed=1, **LLAMA), device="cpu",
                        dtype=torch.float32, tokenizer=False)
    eager_done = _run(llama, DraftModelProposer(draft, num_tokens=3, cache_tokens=1024, page_size=16))[2]
    proposer = DraftModelProposer(draft, num_tokens=3, cache_tokens=1024, page_size=16)
    proposer.graphs = EagerGraphs(draft.model, proposer.cache, batch_sizes=(1, 2, 4))
    replayed, gen, done = _run(llama, proposer, graphs=True)
    assert replayed == plain and _verification_graphs(gen)
    assert [r.draft_proposed for r in done] == [r.draft_proposed for r in eager_done]
    assert [r.draft_accepted for r in done] == [r.draft_accepted for r in eager_done]
    assert proposer.graphs.replays >= 10
    proposer.close()
    assert proposer.cache.allocator.free_pages == proposer.cache.num_pages


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    from test_new_families import _mimo_checkpoint

    _, model_dir, _ = _mimo_checkpoint(tmp_path_factory.mktemp("mimo"))
    return trellm.load(model_dir, device="cpu", dtype=torch.float32, tokenizer=False)


def test_mtp_drafts_through_graphs(mimo):
    """MiMo's MTP head drafts from the hidden states the graphs return (decode and verification graphs alike):
    the same drafts and tokens as the eager generator, and plain greedy output."""
    plain, _, _ = _run(mimo)
    eager_mtp = MTPProposer(mimo, num_tokens=3, cache_tokens=1024, page_size=16)
    eager, _, eager_done = _run(mimo, eager_mtp)
    mtp = graph_mtp(mimo)
    replayed, gen, done = _run(mimo, mtp, graphs=True)
    assert replayed == eager == plain
    assert gen.graph_runner.hidden_states and _verification_graphs(gen)
    assert [r.draft_proposed for r in done] == [r.draft_proposed for r in eager_done]
    assert [r.draft_accepted for r in done] == [r.draft_accepted for r in eager_done]
    graph_proposals = mtp.stats.pop("graph_proposals")
    assert eager_mtp.stats.pop("graph_proposals") == 0 and graph_proposals > 10
    assert mtp.stats == eager_mtp.stats  # the same MTP forwards and tokens, one replay per proposal
    assert mtp.graphs.graphs and mtp.graphs.replays == graph_proposals
    assert mtp.cache.allocator.free_pages == mtp.cache.num_pages - 1  # the graphs' scratch page
    mtp.close()
    assert mtp.cache.allocator.free_pages == mtp.cache.num_pages


def _hybrid(name: str, tmp_path):
    from test_families_next import glm5_next_checkpoint
    from test_hybrid_families import FAMILIES

    if name == "glm5_next":  # Kimi delta attention
        model_dir = glm5_next_checkpoint(tmp_path)
    else:
        arch, cfg = FAMILIES[name]
        model_dir = make_tiny_hf_model(arch, tmp_path, **cfg)
    return trellm.load(model_dir, device="cpu", dtype=torch.float32, tokenizer=False)


@pytest.mark.parametrize("name", ["qwen3_5", "glm5_next"])
def test_hybrid_drafts_verified_through_graphs(name, tmp_path):
    """Recurrent layers in a verification graph take the row's tokens one at a time and leave the state after
    each in the job's verify slots; on partial acceptance the slot after the last kept token becomes the job's
    state. Oracle drafts (kept fully, partly, not at all) give eager drafting's and plain decoding's tokens."""
    lm = _hybrid(name, tmp_path)
    plain, _, _ = _run(lm)
    full = [p + t for p, t in zip(_prompts(VOCAB), plain)]
    eager, _, _ = _run(lm, Oracle(full, 3))
    replayed, gen, done = _run(lm, Oracle(full, 3), graphs=True)
    assert replayed == eager == plain
    assert _verification_graphs(gen) and any(min(lens) < width for width, lens in gen.graph_runner.staged)
    assert 0 < sum(r.draft_accepted for r in done) < sum(r.draft_proposed for r in done)
    assert not gen.active and gen.cache.state_layers()[0].free_slots == gen.cache.state_layers()[0].max_slots - 1 - len(
        gen.cache.prefix_cache.checkpoint_of)  # only the scratch slot and prefix checkpoints are held


def test_hybrid_without_stepwise_mixers_verifies_eagerly(tmp_path):
    """NemotronH's Mamba-2 mixer has no token-by-token verification: its drafts are verified eagerly (state
    snapshot, restore and re-feed) while its plain decode steps still replay graphs."""
    lm = _hybrid("nemotron_h", tmp_path)
    plain, _, _ = _run(lm)
    full = [p + t for p, t in zip(_prompts(VOCAB), plain)]
    replayed, gen, done = _run(lm, Oracle(full, 3), graphs=True)
    assert replayed == plain and sum(r.draft_accepted for r in done) > 0
    assert not _verification_graphs(gen) and gen.graph_runner.graphs


def test_mtp_graphs_leave_positions_past_their_span_to_eager_proposals(mimo):
    """MTP entries start where a job's computation started (here position 40, as after a prefix reuse): a proposal
    whose absolute positions pass the MTP cache's span (the graphs' RoPE table) runs eagerly, with the same drafts."""
    tokens = torch.randint(0, VOCAB, (52,), generator=torch.Generator().manual_seed(8)).tolist()
    with torch.inference_mode():
        hidden = mimo.model.hidden_states(ForwardBatch.no_cache([tokens]))
    drafts = []
    for proposer in (MTPProposer(mimo, num_tokens=3, cache_tokens=48, page_size=16), graph_mtp_small(mimo)):
        proposer.observe_hidden("a", 40, hidden[40:50], tokens[:51])
        drafts.append(proposer.propose([DraftRequest("a", tokens[:51], 3)]))
        proposer.observe_hidden("a", 50, hidden[50:51], tokens[:52])  # one more token: a graph-sized absorb
        drafts.append(proposer.propose([DraftRequest("a", tokens[:52], 3)]))
    assert drafts[:2] == drafts[2:] and all(d[0] for d in drafts)
    assert proposer.stats["graph_proposals"] == 0


def graph_mtp_small(lm) -> MTPProposer:
    proposer = MTPProposer(lm, num_tokens=3, cache_tokens=48, page_size=16)  # positions 0..47 in its graphs
    proposer.graphs = EagerProposals(proposer, batch_sizes=(1,))
    return proposer


def test_hybrid_mtp_through_graphs(tmp_path):
    """Qwen3.5 (recurrent layers) with its MTP head: decode and verification graphs return the hidden states the
    head drafts from; the same tokens as the eager generator, with drafts at more steps (after a rejected draft the
    eager path re-feeds the kept token without drafting; the graph path swaps in the verify slot and drafts on)."""
    from test_mtp import FAMILIES, add_mtp_tensors

    arch, cfg = FAMILIES["qwen3_5"]
    model_dir = make_tiny_hf_model(arch, tmp_path, **cfg)
    add_mtp_tensors(model_dir)
    lm = trellm.load(model_dir, device="cpu", dtype=torch.float32, tokenizer=False)
    plain, _, _ = _run(lm)
    eager_mtp = MTPProposer(lm, num_tokens=3, cache_tokens=1024, page_size=16)
    eager, _, eager_done = _run(lm, eager_mtp)
    mtp = graph_mtp(lm)
    replayed, gen, done = _run(lm, mtp, graphs=True)
    assert replayed == eager == plain and sum(r.draft_proposed for r in done) > 0
    assert mtp.stats["graph_proposals"] > 10
    assert gen.graph_runner.hidden_states and _verification_graphs(gen)
    assert sum(r.draft_proposed for r in done) > sum(r.draft_proposed for r in eager_done)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verification_graphs_capture_on_cuda(tmp_path):
    """On a GPU the verification steps (oracle and n-gram drafts on a Llama, MTP drafts on MiMo, oracle and MTP
    drafts on Qwen3.5's recurrent layers) really are captured, none falls back, and tokens equal the eager
    generator's and plain greedy decoding."""
    import warnings

    from test_new_families import _mimo_checkpoint

    llama = trellm.load(make_tiny_hf_model("LlamaForCausalLM", tmp_path / "llama", **LLAMA), device="cuda",
                        dtype=torch.float32, tokenizer=False)
    # head_dim 64: the paged-attention kernel's smallest (the reference attention cannot be captured)
    _, mimo_dir, _ = _mimo_checkpoint(tmp_path / "mimo", **LLAMA)
    mimo = trellm.load(mimo_dir, device="cuda", dtype=torch.float32, tokenizer=False)
    prompts = _prompts(VOCAB)

    def run(lm, proposer, graphs: bool):
        gen = Generator(lm, cache_tokens=1024, page_size=16, max_batch_size=4, proposer=proposer, num_draft_tokens=3,
                        cuda_graphs=graphs)
        jobs = [Job(p, n, identifier=i, stop_token_ids=[]) for i, (p, n) in enumerate(zip(prompts, (20, 15, 13)))]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gen.enqueue(jobs)
            done = sorted((r for r in gen.stream() if isinstance(r, JobFinished)), key=lambda r: r.identifier)
        gen.verify_pages()
        if graphs:
            assert not [str(w.message) for w in caught if "trellm" in str(w.message)]
            assert _verification_graphs(gen) and not gen.graph_runner._failed
        return [r.token_ids for r in done]

    plain = run(llama, None, False)
    full = [p + t for p, t in zip(prompts, plain)]
    assert run(llama, Oracle(full, 3), True) == run(llama, Oracle(full, 3), False) == plain
    assert run(llama, NgramProposer(num_tokens=3), True) == plain
    drafter = DraftModelProposer(llama, num_tokens=3, cache_tokens=1024, page_size=16)  # drafting for itself
    assert run(llama, drafter, True) == plain and drafter.graphs.graphs and not drafter.graphs._failed
    mtp = lambda lm: MTPProposer(lm, num_tokens=3, cache_tokens=1024, page_size=16)  # noqa: E731
    assert run(mimo, mtp(mimo), True) == run(mimo, mtp(mimo), False) == run(mimo, None, False)
    # Qwen3.5: gated delta net layers verified token by token inside the graph, MTP drafts
    from test_mtp import FAMILIES, add_mtp_tensors

    arch, cfg = FAMILIES["qwen3_5"]
    qwen_dir = make_tiny_hf_model(arch, tmp_path / "qwen3_5", **{**cfg, "head_dim": 64})
    add_mtp_tensors(qwen_dir)
    qwen = trellm.load(qwen_dir, device="cuda", dtype=torch.float32, tokenizer=False)
    plain = run(qwen, None, False)
    full = [p + t for p, t in zip(prompts, plain)]
    assert run(qwen, Oracle(full, 3), True) == run(qwen, Oracle(full, 3), False) == plain
    assert run(qwen, mtp(qwen), True) == plain
