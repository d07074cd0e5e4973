"""Tests for selfspec.training.layer_dropout: curves, sampling statistics, determinism, apply_block."""

import io
import math

import pytest
import torch

from selfspec.training.layer_dropout import (
    LayerDropout,
    apply_block,
    depth_curve,
    drop_probabilities,
    step_curve,
)

SQRT2_M1 = math.sqrt(2.0) - 1.0  # e^{ln2 / 2} - 1: the exp curves at their midpoint


# ---------------------------------------------------------------- curves


def test_depth_curve_documented_values():
    assert depth_curve("uniform", 4).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert depth_curve("linear", 5).tolist() == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    exp = depth_curve("exp", 5)
    assert exp.shape == (5,)
    assert exp[0].item() == 0.0 and exp[-1].item() == 1.0  # exact endpoints
    assert exp[2].item() == pytest.approx(SQRT2_M1, abs=1e-7)
    assert exp[1].item() == pytest.approx(2**0.25 - 1, abs=1e-7)
    assert bool((exp[1:] > exp[:-1]).all())  # rises with depth


@pytest.mark.parametrize("kind", ["uniform", "linear", "exp"])
def test_depth_curve_single_layer_is_one(kind):
    assert depth_curve(kind, 1).tolist() == [1.0]


def test_step_curve_documented_values():
    assert step_curve("constant", 0, 100) == 1.0
    assert step_curve("constant", 7, 0) == 1.0  # total_steps unused
    assert step_curve("linear", 0, 100) == 0.0
    assert step_curve("linear", 50, 100) == 0.5
    assert step_curve("linear", 100, 100) == 1.0
    assert step_curve("linear", 250, 100) == 1.0  # clamped
    assert step_curve("linear", -5, 100) == 0.0  # clamped
    assert step_curve("exp", 0, 100) == 0.0
    assert step_curve("exp", 50, 100) == pytest.approx(SQRT2_M1)
    assert step_curve("exp", 100, 100) == pytest.approx(1.0)
    assert step_curve("exp", 200, 100) == 1.0  # e^{2 ln 2} - 1 = 3, clamped


def test_drop_probabilities_product_and_protection():
    p = drop_probabilities(5, 0.2, "exp", "linear", 50, 100)
    expected = [0.5 * 0.2 * d for d in depth_curve("exp", 5).tolist()]
    assert p.tolist() == pytest.approx(expected)
    assert p[-1].item() == pytest.approx(0.1)

    protected = drop_probabilities(5, 0.2, "uniform", "constant", 0, 0, protected_layers=2)
    assert protected.tolist() == pytest.approx([0.0, 0.0, 0.2, 0.2, 0.2])


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"p_max": 1.0}, ["p_max", "1.0", "[0, 1)"]),
        ({"p_max": -0.1}, ["p_max", "-0.1", "[0, 1)"]),
        ({"depth": "cubic"}, ["depth", "'cubic'", "uniform", "linear", "exp"]),
        ({"schedule": "cosine"}, ["schedule", "'cosine'", "constant", "linear", "exp"]),
        ({"protected_layers": 5}, ["protected_layers", "5", "[0, 4]"]),
        ({"schedule": "linear", "total_steps": 0}, ["total_steps", "0"]),
    ],
)
def test_validation_errors_name_parameter_value_and_allowed(kwargs, words):
    args = {
        "num_layers": 4,
        "p_max": 0.2,
        "depth": "exp",
        "schedule": "constant",
        "step": 0,
        "total_steps": 10,
        "protected_layers": 0,
    }
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        drop_probabilities(**args)
    for word in words:
        assert word in str(err.value)
    ctor = {k: v for k, v in args.items() if k != "step"}
    with pytest.raises(ValueError):
        LayerDropout(**ctor)


# ---------------------------------------------------------------- sampling


def _within_binomial(rates: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    """Empirical rates within 4 binomial standard deviations of probs (exactly 0 where p == 0)."""
    for rate, p in zip(rates.tolist(), probs.tolist(), strict=True):
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(rate - p) <= 4 * sigma + 1e-12, (rate, p, sigma)


def test_per_sample_rates_match_probabilities():
    ld = LayerDropout(6, 0.5, depth="linear", schedule="linear", total_steps=10, per_sample=True, seed=1)
    step, n = 8, 20000
    drops = ld.sample(step, n)  # (N, B)
    assert drops.shape == (6, n) and drops.dtype == torch.bool
    _within_binomial(drops.double().mean(1), ld.probabilities(step), n)


def test_per_batch_rates_match_and_columns_equal():
    ld = LayerDropout(4, 0.6, depth="exp", per_sample=False, seed=2)
    n = 3000
    draws = torch.stack([ld.sample(0, 3) for _ in range(n)])  # (n, N, B)
    assert bool((draws == draws[:, :, :1]).all())  # one decision per block, shared by all rows
    _within_binomial(draws[:, :, 0].double().mean(0), ld.probabilities(0), n)


@pytest.mark.parametrize("per_sample", [True, False])
def test_protected_layers_never_dropped(per_sample):
    ld = LayerDropout(6, 0.9, depth="uniform", per_sample=per_sample, protected_layers=3, seed=0)
    drops = torch.cat([ld.sample(0, 64) for _ in range(50)], dim=1)  # (N, 3200)
    assert not bool(drops[:3].any())
    assert bool(drops[3:].any())


@pytest.mark.parametrize("per_sample", [True, False])
def test_same_seed_same_samples_other_seed_differs(per_sample):
    def run(seed):
        ld = LayerDropout(8, 0.5, depth="uniform", per_sample=per_sample, seed=seed)
        return torch.stack([ld.sample(t, 4) for t in range(20)])

    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))


def test_per_batch_decision_independent_of_batch_size():
    # Ranks with uneven last batches must still agree on which blocks to skip.
    a = LayerDropout(8, 0.5, depth="uniform", per_sample=False, seed=3)
    b = LayerDropout(8, 0.5, depth="uniform", per_sample=False, seed=3)
    for t, (ba, bb) in enumerate([(4, 4), (4, 1), (2, 7), (5, 5)]):
        assert torch.equal(a.sample(t, ba)[:, 0], b.sample(t, bb)[:, 0])


@pytest.mark.parametrize("per_sample", [True, False])
def test_state_dict_round_trip_reproduces_future_samples(per_sample):
    ld = LayerDropout(6, 0.5, depth="uniform", per_sample=per_sample, seed=11)
    for t in range(5):
        ld.sample(t, 4)
    buffer = io.BytesIO()
    torch.save(ld.state_dict(), buffer)  # as a checkpoint would
    future = [ld.sample(t, 4) for t in range(5, 10)]

    resumed = LayerDropout(6, 0.5, depth="uniform", per_sample=per_sample, seed=999)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))
    assert resumed.seed == 11
    for t, expected in zip(range(5, 10), future, strict=True):
        assert torch.equal(resumed.sample(t, 4), expected)



def _draws_after_synchronize(rank: int, world: int, store: str, out: str) -> None:
    """One gloo process: a rank-specific seed, `synchronize`, then 30 per-batch draws and 30 without."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        synced = LayerDropout(8, 0.5, depth="uniform", per_sample=False, seed=100 + rank)
        alone = LayerDropout(8, 0.5, depth="uniform", per_sample=False, seed=100 + rank)
        synced.synchronize()
        torch.save({"synced": torch.stack([synced.sample(t, 2 + rank)[:, 0] for t in range(30)]),
                    "alone": torch.stack([alone.sample(t, 2)[:, 0] for t in range(30)]),
                    "seed": synced.seed}, f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_rank_given_another_seed_skips_rank_0s_blocks_after_synchronize(tmp_path):
    """Two real gloo processes seeded 100 and 101 (other batch sizes too): after `synchronize` both
    skip the same blocks at every step, rank 0's; without it they would not (so the test can fail)."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "draws")
    mp.spawn(_draws_after_synchronize, args=(2, str(tmp_path / "store"), out), nprocs=2, join=True)
    zero, one = torch.load(f"{out}-0.pt"), torch.load(f"{out}-1.pt")
    assert zero["seed"] == one["seed"] == 100
    assert torch.equal(zero["synced"], one["synced"]) and torch.equal(zero["synced"], zero["alone"])
    assert not torch.equal(zero["alone"], one["alone"])


def test_synchronize_without_a_process_group_keeps_the_draws():
    ld, ref = LayerDropout(6, 0.5, seed=5), LayerDropout(6, 0.5, seed=5)
    ld.synchronize()
    assert all(torch.equal(ld.sample(t, 3), ref.sample(t, 3)) for t in range(10))

def test_eval_drops_nothing_and_does_not_advance_generator():
    ld = LayerDropout(5, 0.9, depth="uniform", seed=4)
    ref = LayerDropout(5, 0.9, depth="uniform", seed=4)
    off = ld.sample(0, 6, training=False)
    assert off.shape == (5, 6) and not bool(off.any())
    assert torch.equal(ld.sample(1, 6), ref.sample(1, 6))


def test_zero_rate_early_in_exp_schedule():
    ld = LayerDropout(4, 0.5, depth="uniform", schedule="exp", total_steps=100, seed=0)
    assert not bool(ld.sample(0, 128).any())  # S(0) = 0


# ---------------------------------------------------------------- apply_block


class _Counter:
    def __init__(self):
        self.calls = 0

    def __call__(self, h):
        self.calls += 1
        return h * 2 + 1


def test_apply_block_all_rows_dropped_skips_block():
    hidden = torch.randn(3, 4, 5)
    block = _Counter()
    out = apply_block(block, hidden, torch.ones(3, dtype=torch.bool))
    assert out is hidden and block.calls == 0


def test_apply_block_no_row_dropped_runs_block():
    hidden = torch.randn(3, 4, 5)
    block = _Counter()
    out = apply_block(block, hidden, torch.zeros(3, dtype=torch.bool))
    assert torch.equal(out, hidden * 2 + 1) and block.calls == 1


def test_apply_block_some_rows_dropped_keeps_their_input_and_gradient_path():
    hidden = torch.randn(3, 4, 5, requires_grad=True)
    drop = torch.tensor([True, False, True])
    out = apply_block(_Counter(), hidden, drop)
    assert torch.equal(out[0], hidden[0]) and torch.equal(out[2], hidden[2])
    assert torch.equal(out[1], hidden[1] * 2 + 1)
    out.sum().backward()
    assert hidden.grad[:, 0, 0].tolist() == [1.0, 2.0, 1.0]  # identity rows vs block rows


def test_apply_block_rejects_wrong_mask_shape():
    with pytest.raises(ValueError, match="drop_rows"):
        apply_block(_Counter(), torch.randn(3, 4, 5), torch.zeros(2, dtype=torch.bool))


def test_code_and_config_defaults_agree():
    import inspect

    from selfspec.config import LayerDropoutConfig

    assert inspect.signature(LayerDropout).parameters["per_sample"].default == LayerDropoutConfig().per_sample
