"""Controllers give the documented k: fixed, the articles' window rule, the cost model."""

import numpy as np
import pytest

from selfspec.decoding import CostModelRule, FixedK, WindowRule, make_controller
from selfspec.metrics import expected_tokens

ALL = np.array([4])  # one row accepting all 4 drafts (tests 4)
NONE = np.array([0])  # one row rejecting the first draft (tests 1)


def test_fixed_k_and_make_controller():
    assert FixedK(3).next_k() == 3 and FixedK(0).next_k() == 0 and FixedK(5).k_max == 5
    assert isinstance(make_controller(2), FixedK)
    assert isinstance(make_controller("auto"), CostModelRule)
    assert isinstance(make_controller("window"), WindowRule)
    rule = WindowRule()
    assert make_controller(rule) is rule
    for bad in (-1, 2.5, "fast", True, None):
        with pytest.raises(ValueError, match="num_speculations"):
            make_controller(bad)


def test_window_rule_raises_k_while_alpha_is_above_085_up_to_8():
    rule = WindowRule()  # k = 4, window 64, > 0.85 -> +1, < 0.7 -> -1, k in [2, 8]
    ks = []
    for _ in range(6):
        rule.update(rule.next_k(), np.array([rule.next_k()]), 0.0, 0.0)  # every draft accepted: α = 1
        ks.append(rule.next_k())
    assert ks == [5, 6, 7, 8, 8, 8]


def test_window_rule_lowers_k_only_once_the_64_round_window_falls_below_07():
    rule = WindowRule(k=8)
    for _ in range(64):
        rule.update(4, ALL, 0.0, 0.0)
    ks = []
    for _ in range(50):
        rule.update(4, NONE, 0.0, 0.0)
        ks.append(rule.next_k())
    # after j bad rounds the window holds 64 − j good ones: α = 4(64 − j) / (4(64 − j) + j).
    # It drops below 0.85 at j = 27 (k holds at 8: between the thresholds) and below 0.7 at j = 41,
    # from where k falls by one per round down to k_min = 2.
    assert ks[:40] == [8] * 40
    assert ks[40:] == [7, 6, 5, 4, 3, 2, 2, 2, 2, 2]


def test_window_rule_holds_k_between_the_thresholds():
    rule = WindowRule(k=5)
    for _ in range(100):
        rule.update(5, np.array([3, 4]), 0.0, 0.0)  # accepted 7 of 4 + 5 tested: α = 0.78
    assert rule.next_k() == 5


def feed(rule, alpha, rounds, k=4, draft_time=0.2, verify_time=1.0, rows=64, seed=0):
    """Rounds whose rows accept each draft independently with probability α."""
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        trials = rng.random((rows, k)) < alpha
        accepted = np.cumprod(trials, axis=1).sum(1)
        rule.update(k, accepted, draft_time * k, verify_time)


@pytest.mark.parametrize("alpha", [0.95, 0.8, 0.6])
def test_cost_model_picks_the_k_with_the_most_tokens_per_second(alpha):
    rule = CostModelRule()
    assert rule.next_k() == 3  # nothing measured yet: the initial guess
    feed(rule, alpha, rounds=64)
    estimate = rule.window.alpha(rule.prior_alpha, rule.prior_weight)
    assert estimate == pytest.approx(alpha, abs=0.02)
    # verification measured at k = 4 only: assumed the same for every k (memory-bound)
    scores = [1.0] + [expected_tokens(k, estimate) / (0.2 * k + 1.0) for k in range(1, 9)]
    assert rule.next_k() == int(np.argmax(scores))
    assert rule.next_k() > 0


def test_cost_model_turns_speculation_off_when_it_cannot_win_and_probes_later():
    rule = CostModelRule(probe_every=16)
    feed(rule, 0.3, rounds=64, draft_time=0.5)  # α = 0.3, c = 0.5: E(1)/(1 + c) = 0.87 < 1
    assert rule.next_k() == 0
    for _ in range(15):
        rule.update(0, np.array([0]), 0.0, 1.0)  # plain rounds
        assert rule.next_k() == 0
    rule.update(0, np.array([0]), 0.0, 1.0)
    assert rule.next_k() == 1  # the 16th plain round: probe with the best k > 0


def test_cost_model_lowers_k_as_the_draft_gets_expensive():
    """Long contexts raise the draft cost c (attention over the whole cache): the chosen k falls, then 0."""
    rule = CostModelRule()
    chosen = []
    for draft_time in (0.05, 0.15, 0.3, 0.6, 0.9):
        feed(rule, 0.8, rounds=30, draft_time=draft_time)
        chosen.append(rule.next_k())
    assert chosen == sorted(chosen, reverse=True) and chosen[0] >= 5 and chosen[-1] == 0


def test_cost_model_fits_verify_time_across_k():
    rule = CostModelRule()
    rule.update(2, np.array([2]), 0.2, 1.2)
    rule.update(4, np.array([4]), 0.4, 1.4)
    assert rule.verify_time(2) == 1.2 and rule.verify_time(6) == pytest.approx(1.6)
    assert rule.verify_time(0) == pytest.approx(1.0)
