"""The cost model's formulas and the acceptance statistics."""

import math

import numpy as np
import pytest

from selfspec.metrics import (
    AcceptanceStats,
    acceptance_rate,
    choose_exit,
    drafts_tested,
    expected_tokens,
    optimal_num_speculations,
    predicted_speedup,
    round_counts,
    speedup_kv_reuse,
    speedup_measured_costs,
    speedup_simple,
    weight_draft_cost,
)


@pytest.mark.parametrize("k", [0, 1, 4, 8])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.99, 1.0])
def test_expected_tokens_is_the_geometric_sum(k, alpha):
    assert expected_tokens(k, alpha) == pytest.approx(sum(alpha ** i for i in range(k + 1)))


def test_expected_tokens_limits_and_validation():
    assert (expected_tokens(0, 0.7) == 1.0 and expected_tokens(5, 1.0) == 6.0
            and expected_tokens(5, 0.0) == 1.0)
    assert expected_tokens(4, 0.8) == pytest.approx(3.3616)  # the layer-skip article's example: "about 3.36"
    with pytest.raises(ValueError):
        expected_tokens(-1, 0.5)
    with pytest.raises(ValueError):
        expected_tokens(2, 1.5)


def test_the_practice_articles_table_with_c_03():
    """c = 0.3: α 0.9 -> best k 5-6, ~1.9x; α 0.8 -> k 3, ~1.55x; α 0.7 -> k 2, ~1.37x; α 0.6 -> < 1.3x."""
    k, s = optimal_num_speculations(0.9, 0.3)
    assert k in (5, 6) and s == pytest.approx(1.87, abs=0.01)
    assert optimal_num_speculations(0.8, 0.3) == (3, pytest.approx(1.554, abs=1e-3))
    assert optimal_num_speculations(0.7, 0.3) == (2, pytest.approx(1.369, abs=1e-3))
    assert optimal_num_speculations(0.6, 0.3)[1] < 1.3
    assert optimal_num_speculations(0.2, 0.5) == (0, 1.0)  # cannot win: plain decoding


def test_kv_reuse_form_and_its_relation_to_the_simple_form():
    alpha, c, k = 0.8, 0.25, 4
    assert speedup_kv_reuse(k, alpha, c) == pytest.approx((1 - alpha ** 5) / ((1 - alpha) * (1 - c + k * c)))
    assert speedup_simple(k, alpha, c) == pytest.approx(expected_tokens(k, alpha) / (c * k + 1))
    ratio = speedup_kv_reuse(k, alpha, c) / speedup_simple(k, alpha, c)
    # the reuse form is an upper bound
    assert ratio == pytest.approx((1 + k * c) / (1 - c + k * c)) and ratio > 1
    # α = 0.5 with c = 0.25: a longer draft only loses (the layer-skip article's remark)
    assert [speedup_kv_reuse(k, 0.5, 0.25) for k in (2, 4, 6)] == sorted(
        [speedup_kv_reuse(k, 0.5, 0.25) for k in (2, 4, 6)], reverse=True)


def test_measured_cost_form_reduces_to_the_simple_form():
    plain = 0.02
    assert (speedup_measured_costs(4, 0.8, 0.3 * plain, plain, plain)
            == pytest.approx(speedup_simple(4, 0.8, 0.3)))
    assert speedup_measured_costs(0, 0.8, 0.0, plain, plain) == 1.0


def test_the_break_even_acceptance_is_where_the_cost_model_meets_plain():
    from selfspec.metrics import break_even_acceptance

    alpha = break_even_acceptance({2: 10}, 0.55, 1.47)
    assert predicted_speedup({2: 10}, alpha, 0.55, 1.47) == pytest.approx(1.0, abs=1e-9)
    assert 0.5 < alpha < 1.0
    assert break_even_acceptance({2: 10}, 0.2, 1.0) < alpha  # cheaper rounds need less
    assert math.isnan(break_even_acceptance({1: 10}, 0.9, 1.2))  # 2 tokens for 2.1 plain steps: never
    assert math.isnan(break_even_acceptance({0: 10}, 0.5, 1.0))  # no drafts


def test_predicted_speedup_weights_rounds_by_k():
    assert predicted_speedup({4: 10}, 0.8, 0.2) == pytest.approx(speedup_simple(4, 0.8, 0.2))
    mixed = predicted_speedup({0: 5, 3: 5}, 0.8, 0.2)
    assert mixed == pytest.approx((5 * 1 + 5 * expected_tokens(3, 0.8)) / (5 * 1 + 5 * 1.6))


def test_acceptance_rate_counts_tested_drafts_only():
    assert drafts_tested(np.array([0, 2, 4]), 4).tolist() == [1, 3, 4]
    assert acceptance_rate([0, 2, 4], 4) == 6 / 8
    assert math.isnan(acceptance_rate([], 4)) and math.isnan(acceptance_rate([0], 0))
    # one round's counts in plain Python, as the rounds' bookkeeping takes them: the same sums
    assert round_counts(np.array([0, 2, 4]), 4) == (6, 8) == round_counts([0, 2, 4], 4)


def test_stats_estimate_alpha_and_mean_accepted_length_of_iid_acceptance():
    """Simulated rounds with independent acceptance α: α̂ → α and the mean accepted length → E(k, α)."""
    alpha, k = 0.7, 4
    rng = np.random.default_rng(0)
    stats = AcceptanceStats()
    for _ in range(200):
        stats.update(np.cumprod(rng.random((100, k)) < alpha, axis=1).sum(1), k)
    assert stats.acceptance_rate == pytest.approx(alpha, abs=0.01)
    assert stats.mean_accepted_length == pytest.approx(expected_tokens(k, alpha), abs=0.02)
    assert stats.draft_efficiency < stats.acceptance_rate  # accepted / drafted undercounts α
    assert all(p == pytest.approx(alpha, abs=0.02) for p in stats.per_position_acceptance)


def test_stats_histogram_and_positions():
    stats = AcceptanceStats()
    stats.update([0, 2, 3], 3)
    stats.update([1], 1)
    stats.update([5, 5], 0)  # plain rounds count as rounds, not as drafts
    assert stats.rounds == 3 and stats.row_rounds == 4 and stats.k_rounds == {3: 1, 1: 1, 0: 1}
    assert stats.accepted_histogram == [1, 1, 1, 1]
    assert stats.drafted == 10 and stats.accepted == 6 and stats.tested == 1 + 3 + 3 + 1
    assert stats.position_tested == [4, 2, 2] and stats.position_accepted == [3, 2, 1]
    assert stats.mean_accepted_length == 10 / 4
    assert stats.as_dict()["accepted_histogram"] == [1, 1, 1, 1]


def test_stats_equal_their_definitions_over_random_rounds():
    """Counts of random batches and k against the definitions, row by row: position i is tested where
    at least i drafts were accepted and accepted where more than i were."""
    rng = np.random.default_rng(0)
    stats = AcceptanceStats()
    tested = accepted = drafted = 0
    histogram, position_tested, position_accepted = [0] * 9, [0] * 8, [0] * 8
    for _ in range(300):
        k, rows = int(rng.integers(0, 9)), int(rng.integers(1, 6))
        counts = rng.integers(0, k + 1, size=rows)
        stats.update(counts, k)
        if k == 0:
            continue
        drafted += rows * k
        for a in counts.tolist():
            tested += min(a + 1, k)
            accepted += a
            histogram[a] += 1
            for i in range(k):
                position_tested[i] += a >= i
                position_accepted[i] += a > i
    assert (stats.tested, stats.accepted, stats.drafted) == (tested, accepted, drafted)
    assert stats.accepted_histogram == histogram and stats.position_tested == position_tested
    assert stats.position_accepted == position_accepted
    assert all(type(n) is int for n in stats.accepted_histogram + stats.position_tested)  # JSON-ready


def test_merge_pools_runs():
    a, b, both = AcceptanceStats(), AcceptanceStats(), AcceptanceStats()
    a.update([0, 2], 2)
    b.update([3, 1], 4)
    b.update([0], 0)
    both.update([0, 2], 2)
    both.update([3, 1], 4)
    both.update([0], 0)
    a.merge(b)
    assert a.as_dict() == both.as_dict()


def test_weight_draft_cost_is_the_share_of_the_weights_a_draft_step_reads():
    blocks, head = [10] * 4, 20
    assert weight_draft_cost(2, blocks, head) == (20 + 20) / 60
    assert weight_draft_cost(2, blocks, head, draft_head_params=5) == (20 + 5) / 60


def test_choose_exit_weighs_acceptance_against_draft_cost():
    # A deeper exit that accepts more but costs more: the cost model decides.
    choice = choose_exit({4: 0.6, 8: 0.9}, {4: 0.2, 8: 0.45})
    s4 = optimal_num_speculations(0.6, 0.2)[1]
    s8 = optimal_num_speculations(0.9, 0.45)[1]
    assert choice["exit_layer"] == (4 if s4 > s8 else 8)
    assert choice["predicted_speedup"] == max(s4, s8)
    assert set(choice["candidates"]) == {4, 8}
    cheap = choose_exit({4: 0.9, 8: 0.9}, {4: 0.2, 8: 0.45})
    assert cheap["exit_layer"] == 4 and cheap["num_speculations"] >= 1
    none_pays = choose_exit({4: 0.05, 8: 0.1}, {4: 0.4, 8: 0.6})
    assert none_pays == {**none_pays, "exit_layer": 8, "num_speculations": 0, "predicted_speedup": 1.0}
