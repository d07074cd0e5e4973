"""Logits processing, counter-based random numbers, the race (`sample`) and the accept/reject rule."""

import numpy as np
import pytest
import torch
from helpers import P_MIN, chi_square_p
from scipy import stats
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from selfspec import sampling
from selfspec.sampling import (
    ACCEPT,
    DRAFT,
    TARGET,
    SamplingParams,
    accept_greedy,
    accept_sampled,
    greedy_tokens,
    residual_probs,
    sample,
    sure_drafts,
    uniforms,
)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0),
                                                     (0.8, 0, 0.9), (1.0, 20, 0.5)])
def test_processing_matches_hugging_face_warpers(temperature, top_k, top_p):
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    ours = SamplingParams(temperature, top_k, top_p).process(logits)
    theirs = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.allclose(ours.softmax(-1), theirs.softmax(-1), atol=1e-6)


def test_greedy_params():
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert torch.equal(SamplingParams().process(logits), logits)  # no temperature division at 0


def test_uniforms_are_uniform_deterministic_and_keyed():
    seeds = torch.arange(1000)
    positions = torch.arange(100).expand(1000, 100)
    u = uniforms(seeds, positions, DRAFT)
    assert u.dtype == torch.float64 and u.min() >= 0 and u.max() < 1
    assert torch.equal(u, uniforms(seeds, positions, DRAFT))
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > P_MIN
    for other in (uniforms(seeds + 1, positions, DRAFT), uniforms(seeds, positions + 1, DRAFT),
                  uniforms(seeds, positions, ACCEPT), uniforms(seeds, positions, TARGET)):
        assert abs(np.corrcoef(u.flatten(), other.flatten())[0, 1]) < 0.01
        assert (u != other).float().mean() > 0.999
    # large and negative seeds are fine (64-bit keys)
    big = uniforms(torch.tensor([2**40 + 7, -3]), torch.zeros(2, 1, dtype=torch.long), TARGET)
    assert big.min() >= 0 and big.max() < 1


def test_race_sampling_matches_the_distribution_and_skips_zeros():
    probs = torch.tensor([0.0, 0.1, 0.0, 0.35, 0.05, 0.5, 0.0])
    n = 50_000
    u = uniforms(torch.arange(n), torch.zeros(n, 1, dtype=torch.long), TARGET)[:, 0]
    tokens = sample(probs.expand(n, -1), u).numpy()
    assert chi_square_p(tokens, probs.numpy()) > P_MIN
    # the extreme uniforms (float64: 32 bits) still land on positive-probability tokens, unnormalised
    # rows and bf16 ones too, alike on the host and in tensor operations
    edge = torch.tensor([[0.0, 2.0, 0.0, 0.0], [0.3, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.5],
                         [0.0, 0.0, 0.0, 0.0]])
    for extreme in (0.0, 1 - 2**-32, 1.0):
        u = torch.full((4,), extreme, dtype=torch.float64)
        for rows in (edge, edge.bfloat16()):
            drawn = sample(rows, u)
            assert drawn.tolist()[:2] == [1, 0] and drawn[2] in (1, 3) and drawn[3] == 0  # none: the first
            assert torch.equal(sample(rows, u, on_host=True), drawn)


def test_distributions_raced_with_one_number_agree_about_as_often_as_they_overlap():
    """Why the race: q raced with p's own number gives p's draw with probability near Σ min(p, q)
    (an overlapped sampled round guesses the target's token so); independent draws agree far less."""
    g = torch.Generator().manual_seed(0)
    p = (torch.randn(64, 4096, generator=g) * 3).softmax(-1)  # (64, V) peaked, like a model's
    q = (p.log() + torch.randn(64, 4096, generator=g) * 0.5).softmax(-1)  # a close draft
    overlap = torch.minimum(p, q).sum(-1).mean().item()
    n = 200
    seeds = torch.arange(n).repeat_interleave(64)
    u = uniforms(seeds, torch.arange(64).repeat(n)[:, None], TARGET)[:, 0]
    same = (sample(p.repeat(n, 1), u) == sample(q.repeat(n, 1), u)).double().mean().item()
    other = uniforms(seeds, torch.arange(64).repeat(n)[:, None], DRAFT)[:, 0]
    apart = (sample(p.repeat(n, 1), u) == sample(q.repeat(n, 1), other)).double().mean().item()
    assert 0.4 < overlap < 0.95
    assert same > 0.8 * overlap  # a maximal coupling would reach the overlap itself
    assert apart < 0.8 * same


def test_residual_is_clipped_normalised_and_falls_back_to_p():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.2, 0.1])
    assert torch.allclose(residual_probs(p, q), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.equal(residual_probs(p, p), p)  # p − q sums to zero: fall back to p


def test_greedy_accept_counts_the_leading_matches():
    target = torch.tensor([[3, 1, 4, 1], [3, 1, 4, 1], [3, 1, 4, 1]])
    logits = torch.nn.functional.one_hot(target, 6).float()  # (B, k+1, V)
    drafts = torch.tensor([[3, 1, 4], [3, 2, 4], [0, 1, 4]])
    tokens, accepted = accept_greedy(drafts, logits)
    assert accepted.tolist() == [3, 1, 0]
    assert torch.equal(tokens, target)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_tokens_are_the_argmax_ties_and_nans_included(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 1000, generator=g) * 4).to(dtype)
    logits[0, 0, [7, 300, 900]] = 50.0  # a tie: the first index wins
    logits[1, 2, 400] = float("nan")  # a NaN counts as the largest, as in torch.argmax
    logits[2, 4, 10] = float("nan")
    logits[2, 4, 20] = float("nan")
    tokens = greedy_tokens(logits)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens[0, 0] == 7 and tokens[1, 2] == 400 and tokens[2, 4] == 10


def _speculative_first_tokens(n: int, k: int, p_rows, q_rows):
    """Emitted tokens of `n` independent rounds with the same p (k+1, V) and q (k, V)."""
    seeds = torch.arange(n)
    positions = torch.arange(1, k + 2).expand(n, -1)
    q = q_rows.expand(n, -1, -1)
    drafts = sample(q, uniforms(seeds, positions[:, :k], DRAFT))
    tokens, accepted = accept_sampled(drafts, q, p_rows.expand(n, -1, -1),
                                      uniforms(seeds, positions[:, :k], ACCEPT),
                                      uniforms(seeds, positions, TARGET))
    return tokens, accepted


def _distributions(k=2, vocab=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(k + 1, vocab, generator=g) * 1.5).softmax(-1)
    q = (torch.randn(k, vocab, generator=g) * 1.5).softmax(-1)  # unrelated to p: a poor draft
    return p, q


def test_accept_rule_emits_the_target_distribution():
    """The first emitted token of a round is distributed as p_0, whatever q (200,000 rounds)."""
    p, q = _distributions()
    tokens, accepted = _speculative_first_tokens(200_000, 2, p, q)
    assert 0.2 < (accepted > 0).float().mean() < 0.8  # many rejections: the residual matters
    assert chi_square_p(tokens[:, 0].numpy(), p[0].numpy()) > P_MIN
    # and the bonus token after full acceptance is drawn from p_k
    full = accepted == 2
    assert chi_square_p(tokens[full, 2].numpy(), p[2].numpy()) > P_MIN


def test_accept_rule_that_redraws_a_rejection_from_p_is_rejected(monkeypatch):
    """The test has power: a rejected draft replaced by a draw from p itself (the residual forgotten)
    over-weights the tokens q drafts often. (A residual left unclipped, p − q, races as the clipped one
    wherever it sums above 0: the race never picks a token at or below 0.)"""
    monkeypatch.setattr(sampling, "residual_probs", lambda p, q: p)
    p, q = _distributions()
    tokens, _ = _speculative_first_tokens(200_000, 2, p, q)
    assert chi_square_p(tokens[:, 0].numpy(), p[0].numpy()) < 1e-6


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat (the nucleus passes the candidates) to sharp
def test_filters_among_candidates_keep_what_a_full_sort_keeps(scale):
    """On the CPU top-k and top-p look among each row's `CANDIDATES` largest logits (no sort of the
    vocabulary); the kept tokens are those a full sort keeps, and a flat row whose nucleus passes the
    candidates falls back to the sort: the Hugging Face warpers agree either way."""
    vocab = 4 * sampling.CANDIDATES
    logits = torch.randn(6, 2, vocab, generator=torch.Generator().manual_seed(1)) * scale
    params = [SamplingParams(0.8, 0, 0.95), SamplingParams(1.0, 50, 1.0), SamplingParams(0.7, 20, 0.9),
              SamplingParams(1.0, 0, 1.0), SamplingParams(), SamplingParams(0.3, 600, 0.5)]
    rows = sampling.RowSampling.of(params, "cpu", list(range(6)))
    scaled = logits / rows.temperature[:, None, None]
    full = rows._filter(scaled, vocab)
    few = rows._filter(scaled, sampling.CANDIDATES)
    assert few is None if scale == 0.3 else torch.equal(few, full)
    processed = rows.process(logits)
    assert torch.equal(processed, full)
    for row, p in enumerate(params):
        if p.greedy:
            continue
        theirs = TemperatureLogitsWarper(p.temperature)(None, logits[row].clone())
        theirs = TopKLogitsWarper(p.top_k)(None, theirs) if p.top_k else theirs
        theirs = TopPLogitsWarper(p.top_p)(None, theirs) if p.top_p < 1 else theirs
        assert torch.equal(torch.isinf(processed[row]), torch.isinf(theirs)), p


def test_the_hosts_random_numbers_are_the_devices_bit_for_bit():
    """`RowSampling.uniforms` on the CPU hashes in numpy; a captured pass (`RowSampling.captured`) and
    any device run `uniforms`' tensor operations: the same numbers, 64-bit and negative seeds included."""
    seeds = [0, 1, -3, 2**31 - 1, 2**40 + 7, -2**63, 2**63 - 1]
    rows = sampling.RowSampling.of([SamplingParams(1.0)] * len(seeds), "cpu", seeds)
    positions = torch.randint(0, 2**40, (len(seeds), 9), generator=torch.Generator().manual_seed(0))
    for stream in (DRAFT, ACCEPT, TARGET):
        host = rows.uniforms(positions, stream)
        assert torch.equal(host, uniforms(rows.seeds, positions, stream))
        assert torch.equal(host, sampling.RowSampling.captured(rows.tensors()).uniforms(positions, stream))
    # the race alike: in numpy over the positive tokens on the host, tensor operations over all elsewhere
    u = uniforms(rows.seeds, positions, TARGET)  # (7, 9)
    logits = torch.randn(7, 9, 4096, generator=torch.Generator().manual_seed(1)) * 3
    for probs in (logits.softmax(-1), SamplingParams(0.8, 0, 0.9).probs(logits)):  # all tokens; a nucleus
        assert torch.equal(sample(probs, u, on_host=True), sample(probs, u))


def test_the_compiled_rows_sampling_is_selfspecs_rule():
    """The compiled calls' own expression of the rules (`backends/cpu_rounds/rounds.cpp`: `row_probs`,
    `uniform`): each row's processed distribution equal to `RowSampling.probs` within fp32 rounding, with
    the same support, and the random numbers bit for bit."""
    from selfspec.model import kernels

    module = kernels.extension()
    if module is None:
        pytest.skip("the CPU kernels are not built here")
    params = [SamplingParams(0.8, 0, 0.95), SamplingParams(1.0, 50, 1.0), SamplingParams(0.7, 20, 0.9),
              SamplingParams(1.0, 0, 1.0), SamplingParams(), SamplingParams(0.3, 0, 0.5)]
    rows = sampling.RowSampling.of(params, "cpu", [3, 1, 2**40 + 5, -7, 0, 9])
    for scale in (0.5, 4.0, 10.0):
        logits = torch.randn(6, 4096, generator=torch.Generator().manual_seed(2)) * scale
        ours, theirs = rows.probs(logits), module.row_probs(logits, list(rows.tensors()))
        assert torch.equal(ours > 0, theirs > 0)
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    for seed, position, stream in [(3, 10, DRAFT), (2**40 + 5, 99, ACCEPT), (-7, 2**33 + 1, TARGET)]:
        assert module.uniform(seed, position, stream) == uniforms(torch.tensor([seed]),
                                                                  torch.tensor([[position]]), stream).item()
    # the race: the same token as `sample` for every number (the skipped logarithms change nothing)
    probs = rows.probs(torch.randn(6, 4096, generator=torch.Generator().manual_seed(3)) * 4.0)
    u = uniforms(torch.arange(50), torch.zeros(50, 1, dtype=torch.long), TARGET)[:, 0]
    for row in probs:
        assert [module.draw(row, x) for x in u.tolist()] == sample(row.expand(50, -1), u).tolist()


def test_eta_keeps_the_drafts_before_the_first_step_no_row_is_sure_of():
    """η's one rule (`sure_drafts`), which the static passes, the compiled choice and the Python step
    read: a step counts while any row's top draft probability reaches η; the first that none does ends
    the round's drafts, whatever the steps after it; η = 0 keeps every draft."""
    tops = torch.tensor([[0.9, 0.2], [0.1, 0.7], [0.3, 0.1], [0.95, 0.9]])  # (k = 4, B = 2)
    assert sure_drafts(tops, 0.6) == 2  # step 3: neither row reaches 0.6
    assert sure_drafts(tops, 0.95) == 0 and sure_drafts(tops, 0.05) == 4
    assert sure_drafts(tops, 0.0) == 4 and sure_drafts(tops[:0], 0.6) == 0
