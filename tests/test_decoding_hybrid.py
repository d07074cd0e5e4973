"""Copied drafts, the hybrid policy and the trimmed draft head: all lossless, all counted per source."""

import numpy as np
import pytest
import torch
from helpers import (
    FAMILIES,
    P_MIN,
    chi_square_p,
    low_alpha_model,
    ranking_counts,
    reference_greedy,
    sharp_llama,
    tiny_model,
)

from selfspec import sampling
from selfspec.decoding import SelfSpecGenerator
from selfspec.decoding.controller import FixedK
from selfspec.decoding.draft_head import DraftHead, coverage, frequent_tokens
from selfspec.decoding.ngram import NGramConfig, NGramIndex
from selfspec.decoding.policy import CopyPolicy, DraftPlan, DraftPolicy, Segment, make_policy

NEW = 24
_rng = np.random.default_rng(7)
_LINE = _rng.integers(0, 90, 9).tolist()
REPEATS = _LINE * 3 + _LINE[:4]  # copying finds long matches
RANDOM = _rng.integers(0, 90, 23).tolist()  # no 2-gram repeats: copying stays idle
EVEN_IDS = list(range(0, 96, 2))  # a trimmed draft head: half the vocabulary


# -- the n-gram index ------------------------------------------------------------------------------
def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    config = NGramConfig(max_ngram=3, min_ngram=1, max_copy=10)
    index = NGramIndex([1, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3], config)
    # the suffix (5, 2, 3) never occurred before; (2, 3) last occurred before 4
    assert index.propose(3) == ([4, 5, 2], 2)
    index.extend([4])  # suffix (2, 3, 4) occurred at 5..7, followed by 5 2 3 4: the text repeats
    assert index.propose(10) == ([5, 2, 3, 4, 5, 2, 3, 4, 5, 2], 3)  # around the period of 4
    assert NGramIndex([1, 2, 3], config).propose(4) == ([], 0)
    assert NGramIndex([7], config).propose(4) == ([], 0)
    assert NGramIndex([7, 7], config).propose(3) == ([7, 7, 7], 1)


def test_a_lookup_may_extend_the_sequence_with_drafted_tokens():
    index = NGramIndex([1, 2, 3, 4, 8, 9], NGramConfig(max_ngram=2, min_ngram=2))
    assert index.propose(3) == ([], 0)
    assert index.propose(3, extra=[1, 2]) == ([3, 4, 8], 2)  # (1, 2) drafted: it was followed by 3 4 8
    assert index.tokens == [1, 2, 3, 4, 8, 9]  # a lookup never changes the index
    assert index.propose(2, extra=[2]) == ([], 0)  # (9, 2) never occurred


class _Vocab:
    """A tokenizer's `get_vocab` and nothing else: what `TokenText` reads."""

    def __init__(self, pieces):
        self.pieces = pieces

    def get_vocab(self):
        return {piece: token for token, piece in enumerate(self.pieces)}


def test_copies_matched_on_the_text_where_the_tokens_differ():
    """`TokenText`: where no token n-gram matches, the longest end of the text (the whole last token, at
    least MIN_TEXT characters) found earlier proposes what followed it: from a token boundary the
    context's own tokens; from inside a token the rest of it (when the vocabulary has that piece) and
    then the context's tokens. A token n-gram match still comes first."""
    from selfspec.decoding.ngram import TokenText

    pieces = ["Ġ", "M", "ĠMcc", "cc", "oy", "haven", ",", "Ġ89", '"', "ĠMccoy", "Ġlives", "Mcc"]
    text = TokenText(_Vocab(pieces))
    ids = text.ids
    prompt = [ids["ĠMccoy"], ids["haven"], ids[","], ids["Ġ89"], ids["Ġlives"]]  # " Mccoyhaven, 89 lives"
    index = NGramIndex(prompt, NGramConfig(min_ngram=2), text)
    # the reply writes `"|Mcc`: its longest end found earlier, "Mcc", ends inside " Mccoy", whose rest "oy"
    # is a piece
    assert index.propose(4, [ids['"'], ids["Mcc"]]) == ([ids["oy"], ids["haven"], ids[","], ids["Ġ89"]], 0)
    assert index.propose(2, [ids['"'], ids["Mcc"], ids["oy"]]) == ([ids["haven"], ids[","]], 0)  # a boundary
    assert index.propose(3, [ids['"'], ids["M"]]) == ([], 0)  # '"M' is not in the prompt; "M" is too short
    assert NGramIndex(prompt, NGramConfig(min_ngram=2)).propose(3, [ids['"'], ids["Mcc"]]) == ([], 0)
    # a token n-gram match comes first
    assert index.propose(2, [ids["ĠMccoy"], ids["haven"]]) == ([ids[","], ids["Ġ89"]], 2)
    index.extend([ids['"'], ids["Mcc"]])  # the text follows appended tokens
    assert index.propose(1) == ([ids["oy"]], 0)
    # the clause ends at a comma before a space (`Mccoyhaven, 89`), not at one the copy ends with
    assert text.clause_end(np.array([[ids["oy"], ids["haven"], ids[","], ids["Ġ89"]]])) == 2
    assert text.clause_end(np.array([[ids["haven"], ids[","]], [ids["oy"], ids["haven"]]])) is None
    assert text.closers == [ids['"'], ids[","]]  # of '",', '"}', '"', ',', '}' the vocabulary has these


def test_min_ngram_is_the_copy_threshold():
    tokens = [1, 2, 3, 4, 3]  # only the 1-gram (3) repeats
    assert NGramIndex(tokens, NGramConfig(3, 1)).propose(2) == ([4, 3], 1)
    assert NGramIndex(tokens, NGramConfig(3, 2)).propose(5) == ([], 0)


def test_ngram_index_matches_a_rescan_on_random_sequences():
    """The incremental tables give what a full rescan for the latest longest match gives."""
    rng = np.random.default_rng(0)
    config = NGramConfig(max_ngram=4, min_ngram=1)
    for _ in range(50):
        seq = rng.integers(0, 4, int(rng.integers(2, 40))).tolist()
        index = NGramIndex(seq[:3], config)
        index.extend(seq[3:])
        expected = ([], 0)
        for n in range(min(4, len(seq) - 1), 0, -1):
            starts = [s for s in range(len(seq) - n) if seq[s:s + n] == seq[len(seq) - n:]]
            if starts:
                follow = starts[-1] + n
                expected = ([seq[follow + i % (len(seq) - follow)] for i in range(5)], n)
                break
        assert index.propose(5) == expected, seq


@pytest.mark.parametrize("fields", [{"min_ngram": 0}, {"min_ngram": 4, "max_ngram": 3}, {"max_copy": 0}])
def test_bad_ngram_settings_are_refused(fields):
    with pytest.raises(ValueError, match="min_ngram|max_copy"):
        NGramConfig.from_dict(fields)
    with pytest.raises(ValueError, match="unknown n-gram settings"):
        NGramConfig.from_dict({"max_n": 3})


# -- the policy ------------------------------------------------------------------------------------
def test_copy_policy_copies_pads_and_falls_back_to_the_early_exit():
    policy = CopyPolicy(NGramConfig(max_ngram=2, min_ngram=2, max_copy=4), FixedK(3),
                        copy_controller=FixedK(4))
    policy.start([[1, 2, 3, 1, 2], [5, 6, 7], [8, 9, 8, 9]])
    plan = policy.plan(np.array([0, 1, 2]))
    # rows 0 and 2 copy (around their period); row 1 has no match and pads with its last token
    assert plan.copied.tolist() == [[3, 1, 2, 3], [7, 7, 7, 7], [8, 9, 8, 9]] and plan.early_exit == 0
    only_idle = policy.plan(np.array([1]))
    assert only_idle.num_copied == 0 and only_idle.early_exit == 3
    # while the early exit drafts, a draft that makes the suffix match again turns into a copy
    assert policy.copy_after(np.array([1]), np.array([[4]])).shape == (1, 0)
    policy.observe(np.array([1]), np.array([[5, 6, 0]]), np.array([2]))  # row 1 is now 5 6 7 5 6
    assert policy.plan(np.array([1])).copied.tolist() == [[7, 5, 6, 7]]
    assert policy.copy_after(np.array([1]), np.array([[7, 5]])).tolist() == [[6, 7, 5, 6]]
    assert policy.copies_after_early_exit and not make_policy("ngram", 0).copies_after_early_exit


def test_segments_count_what_the_verifier_tested():
    copy, early = Segment("copy", 0, 2), Segment("early_exit", 2, 3)
    accepted = np.array([0, 2, 4, 5])
    assert [r.tolist() for r in copy.accepted(accepted)] == [[True, True, True, True], [0, 2, 2, 2]]
    assert [r.tolist() for r in early.accepted(accepted)] == [[False, True, True, True], [0, 2, 3]]


def test_plan_truncation_cuts_early_exit_drafts_after_copies():
    plan = DraftPlan(np.array([[1, 2, 3]]), early_exit=2)
    assert plan.truncate(4).k == 4 and plan.truncate(4).early_exit == 1
    assert plan.truncate(2).copied.tolist() == [[1, 2]] and plan.truncate(2).early_exit == 0
    assert plan.truncate(-1).k == 0


def test_unknown_drafter_is_refused():
    with pytest.raises(ValueError, match="drafter must be one of early_exit, ngram, hybrid"):
        make_policy("medusa", 3)
    with pytest.raises(ValueError, match="drafter"):
        SelfSpecGenerator(tiny_model("llama"), exit_layer=2, drafter="copy")


# -- the trimmed draft head ------------------------------------------------------------------------
def test_frequent_tokens_and_coverage():
    counts = np.array([5, 0, 9, 5, 1])
    assert frequent_tokens(counts, 3).tolist() == [2, 0, 3]  # ties broken by the lower id
    assert coverage(counts, [1, 3, 5]) == pytest.approx({1: 0.45, 3: 0.95, 5: 1.0})
    with pytest.raises(ValueError, match=r"draft vocabulary size must be in 1\.\.5"):
        frequent_tokens(counts, 6)


def test_trimmed_head_gives_the_full_heads_logits_on_its_subset_and_minus_inf_elsewhere():
    model = tiny_model("qwen2")
    full, trimmed = DraftHead(SelfSpecGenerator(model, exit_layer=2).view), None
    trimmed = DraftHead(full.view, EVEN_IDS)
    hidden = torch.randn(3, 32)
    with torch.no_grad():
        a, b = full.logits(hidden), trimmed.logits(hidden)
    assert trimmed.size == 48 and full.size == 96
    torch.testing.assert_close(b[:, EVEN_IDS], a[:, EVEN_IDS])
    assert torch.isneginf(b[:, 1::2]).all()
    for bad in ([], [0, 0], [96], [[1, 2]]):
        with pytest.raises(ValueError, match="draft token ids"):
            DraftHead(full.view, bad)


# -- greedy: token for token -----------------------------------------------------------------------
@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request):
    model = low_alpha_model(request.param)
    # X, the model's own greedy continuation of X, X again: copying proposes that continuation, which
    # the model tends to repeat (Mistral's 8-token window makes it repeat exactly).
    prompts = [_LINE + reference_greedy(model, _LINE, 12) + _LINE, RANDOM]
    return request.param, model, prompts, [reference_greedy(model, p, NEW) for p in prompts]


def test_hybrid_and_ngram_greedy_equal_plain_greedy(family_case, monkeypatch):
    """Every drafter × E × k × full/trimmed head, a repetitive and a random prompt (batched and alone)."""
    family, model, prompts, expected = family_case
    copied = early = 0
    switches = []  # early-exit drafts that turned into a copy within a round
    copy_after = CopyPolicy.copy_after
    monkeypatch.setattr(CopyPolicy, "copy_after",
                        lambda self, rows, drafted: (switches.append(copy_after(self, rows, drafted))
                                                     or switches[-1]))
    for exit_layer in (1, 2, 4):
        for vocab in (None, EVEN_IDS):
            generator = SelfSpecGenerator(model, exit_layer=exit_layer,
                                          token_counts=ranking_counts(EVEN_IDS, 96),
                                          draft_vocab_size=0 if vocab is None else len(vocab),
                                          ngram=NGramConfig(max_ngram=3, min_ngram=2, max_copy=6))
            for drafter in ("early_exit", "ngram", "hybrid"):
                for k in (1, 3, "auto"):
                    out = generator.generate(prompts, max_new_tokens=NEW, num_speculations=k, drafter=drafter,
                                             eos_token_id=[])
                    assert out.sequences == expected, (family, exit_layer, vocab is None, drafter, k)
                    copied += out.stats.copy.accepted
                    early += out.stats.early_exit.accepted
            for prompt, want in zip(prompts, expected):  # batch 1: copies extended by early-exit drafts
                out = generator.generate([prompt], max_new_tokens=NEW, num_speculations=2, drafter="hybrid",
                                         eos_token_id=[])
                assert out.sequences == [want], (family, exit_layer, vocab is None)
    assert copied > 0 and early > 0  # both sources really drafted and were accepted
    assert any(copy.size for copy in switches)


class _CopyThenEarlyExit(DraftPolicy):
    """Every round: copy two tokens, then 3 early-exit drafts (a plan the built-in policies do not
    make, for the engine's copy-then-draft path). The copies come from an oracle, the known greedy
    output, right in even rounds and wrong in odd ones, so both outcomes are exercised."""

    k_max = 5

    def __init__(self, expected):
        self.expected, self.rounds = expected, 0

    def start(self, prompts):
        self.done = [0] * len(prompts)

    def observe(self, rows, tokens, emit):
        for slot, row in enumerate(rows):
            self.done[row] += int(emit[slot])

    def plan(self, rows):
        self.rounds += 1
        copies = [(self.expected[row] + [0, 0])[self.done[row]:self.done[row] + 2] for row in rows]
        if self.rounds % 2:
            copies = [[(t + 1) % 90 for t in c] for c in copies]
        return DraftPlan(np.array(copies), early_exit=3)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_copy_extended_by_early_exit_drafts_is_lossless(family):
    model = low_alpha_model(family)
    prompts = [[5, 17, 33, 2, 71, 8], [40, 3, 9], RANDOM]
    expected = [reference_greedy(model, p, 14) for p in prompts]
    for exit_layer in (1, 3, 4):
        generator = SelfSpecGenerator(model, exit_layer=exit_layer, token_counts=ranking_counts(EVEN_IDS, 96),
                                      draft_vocab_size=len(EVEN_IDS))
        out = generator.generate(prompts, max_new_tokens=12, drafter=_CopyThenEarlyExit(expected),
                                 eos_token_id=[])
        assert out.sequences == [e[:12] for e in expected]
        assert 0 < out.stats.copy.accepted < out.stats.copy.tested and out.stats.early_exit.tested > 0
        sampled = generator.generate(prompts, max_new_tokens=12, drafter=_CopyThenEarlyExit(expected),
                                     temperature=1.0, seed=3, eos_token_id=[])
        assert [len(s) for s in sampled.sequences] == [12] * 3


def test_copying_stays_idle_on_a_prompt_without_repeats():
    model = tiny_model("llama", seed=1)
    generator = SelfSpecGenerator(model, exit_layer=2, ngram=NGramConfig(max_ngram=3, min_ngram=3))
    out = generator.generate([RANDOM], max_new_tokens=4, num_speculations=2, drafter="hybrid",
                             eos_token_id=[])
    assert out.stats.copy.drafted == 0 and out.stats.early_exit.drafted > 0


def test_stats_per_source_add_up():
    model = tiny_model("llama", seed=2)
    out = SelfSpecGenerator(model, exit_layer=2).generate(
        [REPEATS], max_new_tokens=40, num_speculations=2, drafter="hybrid", eos_token_id=[])
    s, copy, early = out.stats, out.stats.copy, out.stats.early_exit
    assert copy.rounds > 0 and early.rounds > 0
    assert copy.drafted + early.drafted <= s.drafted  # early-exit drafts after a rejected copy go untested
    assert copy.accepted + early.accepted == s.accepted
    assert s.draft_steps >= early.drafted  # a step serves the whole batch; untested ones were run too
    assert set(s.as_dict()["by_source"]) == {"copy", "forced", "early_exit"}


# -- sampling: in distribution ---------------------------------------------------------------------
RUNS = 20_000


@pytest.fixture(scope="module")
def sharp_model():
    return sharp_llama()


@pytest.fixture(scope="module")
def copy_prompt(sharp_model):
    """[7, 21, 40, x, 9, 7, 21, 40]: the suffix (21, 40) makes the drafter copy x, 9, 7, 21, 40; x is the
    token the model itself finds likeliest there, so that copies are accepted as well as rejected."""
    with torch.no_grad():
        candidates = torch.tensor([[7, 21, 40, x, 9, 7, 21, 40] for x in range(64)])
        probs = sharp_model(candidates).logits[:, -1].softmax(-1)  # (64 candidates, V)
    x = int(probs[torch.arange(64), torch.arange(64)].argmax())
    return [7, 21, 40, x, 9, 7, 21, 40]


def exact_distributions(model, prompt):
    """The target's exact distributions (temperature 1) of the first and second generated tokens."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        extended = torch.tensor([prompt + [x] for x in range(vocab)])
        second = (first[:, None] * model(extended).logits[:, -1].softmax(-1)).sum(0)
    return first.double().numpy(), second.double().numpy()


def sample_runs(model, prompt, draft_vocab):
    vocab = model.config.vocab_size
    generator = SelfSpecGenerator(model, exit_layer=1, token_counts=ranking_counts(draft_vocab or [0], vocab),
                                  draft_vocab_size=len(draft_vocab or []),
                                  ngram=NGramConfig(max_ngram=2, min_ngram=2, max_copy=2))
    out = generator.generate([prompt] * RUNS, max_new_tokens=3, temperature=1.0, num_speculations=2,
                             drafter="hybrid", seed=0, eos_token_id=[])
    return np.array(out.sequences), out.stats


@pytest.mark.parametrize("draft_vocab", [None, list(range(0, 64, 3))], ids=["full_head", "trimmed_head"])
def test_hybrid_sampling_matches_the_target_distribution(sharp_model, copy_prompt, draft_vocab):
    first, second = exact_distributions(sharp_model, copy_prompt)
    tokens, stats = sample_runs(sharp_model, copy_prompt, draft_vocab)
    # copies were both accepted and rejected; early-exit drafts ran too (in later rounds)
    assert 0 < stats.copy.accepted < stats.copy.tested and stats.early_exit.tested > 0
    assert chi_square_p(tokens[:, 0], first) > P_MIN
    assert chi_square_p(tokens[:, 1], second) > P_MIN


def test_the_same_test_rejects_copies_whose_rejected_token_is_not_removed(sharp_model, copy_prompt,
                                                                          monkeypatch):
    """The bug: a copied draft treated as if q were uniform, not one-hot: it is accepted almost always
    and a rejection leaves the copied token in the residual."""
    monkeypatch.setattr(sampling, "copied_probs",
                        lambda copied, vocab: torch.full((*copied.shape, vocab), 1.0 / vocab))
    first, second = exact_distributions(sharp_model, copy_prompt)
    tokens, _ = sample_runs(sharp_model, copy_prompt, None)
    assert chi_square_p(tokens[:, 0], first) < P_MIN
