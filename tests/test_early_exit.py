"""Tests for selfspec.training.early_exit (weights, curricula, the chunked loss against a naive reference),
config.parse_layers and agreement.agreement_metrics."""

import math
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F

from selfspec.agreement import agreement_metrics, low_precision_to_float
from selfspec.config import parse_layers
from selfspec.training.early_exit import (
    ExitCurriculum,
    TrimmedVocab,
    _as_exit_list,
    _validate_loss_args,
    _zero_loss,
    early_exit_loss,
    early_exit_losses,
    layer_weights,
)


def early_exit_loss_naive(
    exit_hidden: Sequence[torch.Tensor] | torch.Tensor,
    head_fn: Callable[[torch.Tensor], torch.Tensor],
    weights: torch.Tensor | Sequence[float],
    *,
    kind: str,
    teacher_logits: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Reference for :func:`early_exit_loss`: one full (B, T, V) logits tensor per exit, plain torch losses.

    Same arguments and result; memory grows with B*T*V. The tests' reference implementation.
    """
    hiddens = _as_exit_list(exit_hidden)
    weights_t = torch.as_tensor(weights, dtype=torch.float32)
    _validate_loss_args(hiddens, weights_t, kind, teacher_logits, labels, temperature)
    total = _zero_loss(teacher_logits, labels)
    for weight, hidden in zip(weights_t.tolist(), hiddens, strict=True):
        logits = low_precision_to_float(head_fn(hidden))  # (B, T, V)
        vocab = logits.shape[-1]
        mask = torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device)  # (B, T)
        if labels is not None:
            mask = labels != ignore_index
        n_valid = max(int(mask.sum()), 1)
        loss = logits.new_zeros(())
        if kind in ("kl", "both"):
            log_q = F.log_softmax(logits / temperature, dim=-1)
            log_p = F.log_softmax(low_precision_to_float(teacher_logits.detach()) / temperature, dim=-1)
            kl = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)  # (B, T)
            loss = loss + (kl * mask).sum() / n_valid * temperature**2
        if kind in ("ce", "both"):
            ce = F.cross_entropy(
                logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
            )
            loss = loss + ce / n_valid
        total = total + weight * loss
    return total


# ---------------------------------------------------------------- parse_layers


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("all", [1, 2, 3, 4, 5, 6, 7]),
        (":", [1, 2, 3, 4, 5, 6, 7]),
        ("::2", [1, 3, 5, 7]),
        ("4:", [4, 5, 6, 7]),
        (":3", [1, 2]),
        ("2:7:2", [2, 4, 6]),
        ("7:0:-3", [1, 4, 7]),
        ("6,2,4,2", [2, 4, 6]),
        (" 3 ", [3]),
        ([5, 1, 3, 5], [1, 3, 5]),
    ],
)
def test_parse_layers(spec, expected):
    assert parse_layers(spec, 8) == expected


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("0,2", ["0", "[1, 7]"]),
        ("8", ["8", "[1, 7]"]),
        ([2, 9], ["9", "[1, 7]"]),
        ([True], ["True", "[1, 7]"]),
        ("2,x", ["'x'", "[1, 7]"]),
        ("1:8:0", ["step", "'1:8:0'"]),
        ("1:2:3:4", ["'1:2:3:4'"]),
        ("a:b", ["'a:b'"]),
        ("5:3", ["'5:3'", "no layer"]),
    ],
)
def test_parse_layers_errors(spec, words):
    with pytest.raises(ValueError) as err:
        parse_layers(spec, 8)
    for word in words:
        assert word in str(err.value)


def test_parse_layers_needs_two_layers():
    with pytest.raises(ValueError, match="num_layers"):
        parse_layers("all", 1)


# ---------------------------------------------------------------- layer_weights


def test_layer_weights_documented_values():
    assert layer_weights("uniform", [1, 2, 4], 8).tolist() == pytest.approx([1 / 3] * 3)
    assert layer_weights("linear", [1, 2, 4], 8).tolist() == pytest.approx([1 / 7, 2 / 7, 4 / 7])
    assert layer_weights("sqrt", [1, 4], 8).tolist() == pytest.approx([1 / 3, 2 / 3])
    assert layer_weights("sum_l", [1, 2, 3], 8).tolist() == pytest.approx([0.1, 0.3, 0.6])  # 1, 3, 6
    assert layer_weights("sum_l", [2, 7], 8).tolist() == pytest.approx([3 / 31, 28 / 31])
    assert layer_weights("linear", [], 8).numel() == 0


def test_sum_l_matches_torchtune_on_contiguous_layers():
    layers = list(range(1, 8))
    block_ids = torch.tensor(layers, dtype=torch.float64) - 1  # torchtune's 0-based layer_ids
    torchtune = torch.cumsum(block_ids + 1, dim=0)
    assert layer_weights("sum_l", layers, 8).tolist() == pytest.approx((torchtune / torchtune.sum()).tolist())


@pytest.mark.parametrize("kind", ["uniform", "linear", "sqrt", "sum_l"])
def test_layer_weights_sum_to_one_and_allow_final_layer(kind):
    w = layer_weights(kind, [1, 3, 8], 8)
    assert w.dtype == torch.float32 and w.sum().item() == pytest.approx(1.0)


def test_layer_weights_errors():
    with pytest.raises(ValueError, match=r"uniform.*'cubic'"):
        layer_weights("cubic", [1], 8)
    with pytest.raises(ValueError, match=r"\[1, 8\].*got 0"):
        layer_weights("linear", [0, 2], 8)


# ---------------------------------------------------------------- curricula


def test_curriculum_none_is_all():
    cur = ExitCurriculum("none", [6, 2, 4], total_steps=10)
    assert cur.active(0) == cur.active(9) == [2, 4, 6]


def test_rotational_documented_steps():
    cur = ExitCurriculum("rotational", [1, 2, 3, 4, 5], total_steps=100, rotation_period=2)
    assert cur.active(0) == [1, 3, 5]
    assert cur.active(1) == [2, 4]
    assert cur.active(2) == [1, 3, 5]


@pytest.mark.parametrize("period", [1, 3, 7])
def test_rotational_covers_each_candidate_once_per_period(period):
    layers = [1, 2, 3, 5, 8, 9, 10]
    cur = ExitCurriculum("rotational", layers, total_steps=100, rotation_period=period)
    for start in (0, 4, 11):
        seen = [layer for t in range(start, start + period) for layer in cur.active(t)]
        assert sorted(seen) == layers  # each exactly once


def test_rotational_period_longer_than_candidates_has_empty_steps():
    cur = ExitCurriculum("rotational", [2, 4], total_steps=10, rotation_period=3)
    assert [cur.active(t) for t in range(3)] == [[2], [4], []]


def test_gradual_documented_steps():
    # K = 4 candidates over T = 100 steps: stages of 25 steps, deepest first.
    cur = ExitCurriculum("gradual", [1, 3, 5, 7], total_steps=100)
    assert cur.active(0) == [7]
    assert cur.active(24) == [7]
    assert cur.active(25) == [5, 7]
    assert cur.active(50) == [3, 5, 7]
    assert cur.active(74) == [3, 5, 7]
    assert cur.active(75) == [1, 3, 5, 7]
    assert cur.active(99) == [1, 3, 5, 7]
    assert cur.active(500) == [1, 3, 5, 7]


def test_gradual_grows_monotonically_from_deepest_to_all():
    layers = [2, 3, 5, 6, 7]
    cur = ExitCurriculum("gradual", layers, total_steps=13)
    sizes = [len(cur.active(t)) for t in range(13)]
    assert sizes[0] == 1 and sizes[-1] == len(layers)
    assert sizes == sorted(sizes)
    for t in range(13):
        assert cur.active(t) == layers[len(layers) - sizes[t] :]  # always a deepest suffix


def test_curriculum_errors():
    with pytest.raises(ValueError, match=r"rotational.*'cyclic'"):
        ExitCurriculum("cyclic", [1], 10)
    with pytest.raises(ValueError, match="rotation_period"):
        ExitCurriculum("rotational", [1], 10, rotation_period=0)
    with pytest.raises(ValueError, match="total_steps"):
        ExitCurriculum("gradual", [1], 0)
    with pytest.raises(ValueError, match="candidate"):
        ExitCurriculum("none", [], 10)


# ---------------------------------------------------------------- loss

B, T, D, V, L = 3, 5, 8, 11, 3  # B*T = 15 tokens


class _Head(torch.nn.Module):
    """Final norm + LM head, like the model's; float64 so that comparisons can be tight."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D, dtype=torch.float64)
        self.lm_head = torch.nn.Linear(D, V, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, h):
        return self.lm_head(self.norm(h))


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = _Head()
    hiddens = [torch.randn(B, T, D, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(L)]
    teacher = torch.randn(B, T, V, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[0, :2] = -100
    labels[2, 4] = -100
    return head, hiddens, teacher, labels


def _value_and_grads(fn, head, hiddens, **kwargs):
    head.zero_grad()
    for h in hiddens:
        h.grad = None
    loss = fn(hiddens, head, torch.tensor([0.2, 0.3, 0.5]), **kwargs)
    loss.backward()
    grads = [h.grad.clone() for h in hiddens] + [p.grad.clone() for p in head.parameters()]
    return loss.detach(), grads


@pytest.mark.parametrize("kind", ["kl", "ce", "both"])
@pytest.mark.parametrize(
    ("chunk_size", "checkpoint_chunks"),
    [(1, False), (4, True), (7, True), (7, False), (1024, True)],  # 4 and 7 do not divide B*T = 15
)
def test_chunked_loss_matches_naive(kind, chunk_size, checkpoint_chunks):
    head, hiddens, teacher, labels = _problem()
    common = {"kind": kind, "teacher_logits": teacher, "labels": labels, "temperature": 2.0}
    ref, ref_grads = _value_and_grads(early_exit_loss_naive, head, hiddens, **common)
    got, got_grads = _value_and_grads(
        early_exit_loss, head, hiddens, chunk_size=chunk_size, checkpoint_chunks=checkpoint_chunks, **common
    )
    assert ref.item() > 0
    assert got.item() == pytest.approx(ref.item(), abs=1e-5)
    assert len(got_grads) == L + 3  # every hidden, norm weight and bias, LM head weight
    for g, r in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    assert teacher.grad is None  # teacher is detached inside


def test_chunked_loss_float32_and_stacked_input():
    head, hiddens, teacher, labels = _problem(1)
    head = head.float()
    stacked = torch.stack([h.detach().float() for h in hiddens])  # (L, B, T, D)
    kwargs = {"kind": "both", "teacher_logits": teacher.float(), "labels": labels}
    weights = [0.2, 0.3, 0.5]
    ref = early_exit_loss_naive(list(stacked), head, weights, **kwargs)
    got = early_exit_loss(stacked, head, weights, chunk_size=4, **kwargs)
    assert got.item() == pytest.approx(ref.item(), abs=1e-5)


def test_kl_without_labels_counts_every_position():
    head, hiddens, teacher, _ = _problem(2)
    ref = early_exit_loss_naive(hiddens, head, [1.0, 0.0, 0.0], kind="kl", teacher_logits=teacher)
    got = early_exit_loss(hiddens, head, [1.0, 0.0, 0.0], kind="kl", teacher_logits=teacher, chunk_size=6)
    with torch.no_grad():
        log_q = F.log_softmax(head(hiddens[0]), -1)
        by_hand = (F.softmax(teacher, -1) * (F.log_softmax(teacher, -1) - log_q)).sum(-1).mean()
    assert got.item() == pytest.approx(ref.item(), abs=1e-10)
    assert got.item() == pytest.approx(by_hand.item(), abs=1e-10)


def test_head_sees_at_most_chunk_size_rows():
    head, hiddens, teacher, labels = _problem()
    rows = []

    def spy(h):
        rows.append(h.shape[0])
        assert h.dim() == 2  # (chunk, D): never (B, T, D), let alone (L, B, T, D)
        return head(h)

    loss = early_exit_loss(
        hiddens, spy, [0.2, 0.3, 0.5], kind="both", teacher_logits=teacher, labels=labels, chunk_size=4
    )
    assert max(rows) == 4 and sum(rows) == L * B * T
    # With checkpoint_chunks (the default) backward recomputes each chunk's logits rather than
    # keeping them: the head runs a second time over every chunk, still 4 rows at most.
    loss.backward()
    assert max(rows) == 4 and sum(rows) == 2 * L * B * T


def test_kl_zero_when_student_equals_teacher():
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    for temperature in (1.0, 3.0):
        loss = early_exit_loss(
            [logits],
            lambda h: h,
            [1.0],
            kind="kl",
            teacher_logits=logits,
            temperature=temperature,
            chunk_size=4,
        )
        assert abs(loss.item()) < 1e-12
        (grad,) = torch.autograd.grad(loss, logits)
        assert grad.abs().max().item() < 1e-12


def test_hand_computed_kl_ce_and_temperature():
    # One token, V = 2: teacher uniform, student q = (3/4, 1/4), label 0.
    teacher = torch.zeros(1, 1, 2)
    student = torch.tensor([[[math.log(3.0), 0.0]]])
    kl = 0.5 * math.log(4.0 / 3.0)
    ce = -math.log(0.75)
    labels = torch.tensor([[0]])
    args = {"teacher_logits": teacher, "labels": labels}
    identity = lambda h: h  # noqa: E731 - the exit hidden already is the logits here
    assert early_exit_loss([student], identity, [1.0], kind="kl", **args).item() == pytest.approx(kl)
    assert early_exit_loss([student], identity, [1.0], kind="ce", **args).item() == pytest.approx(ce)
    assert early_exit_loss([student], identity, [1.0], kind="both", **args).item() == pytest.approx(kl + ce)
    # At τ = 2, student / τ gives q again from doubled logits; the loss is τ² · KL.
    doubled = early_exit_loss([2 * student], identity, [1.0], kind="kl", temperature=2.0, **args)
    assert doubled.item() == pytest.approx(4 * kl)


def test_all_positions_ignored_gives_zero_not_nan():
    head, hiddens, teacher, labels = _problem()
    labels = torch.full_like(labels, -100)
    loss = early_exit_loss(hiddens, head, [0.2, 0.3, 0.5], kind="both", teacher_logits=teacher, labels=labels)
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.isfinite(h.grad).all() and not h.grad.any() for h in hiddens)


def test_no_active_exit_gives_zero():
    loss = early_exit_loss([], lambda h: h, [], kind="ce", labels=torch.zeros(2, 3, dtype=torch.long))
    assert loss.item() == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "mse"}, r"kl.*'mse'"),
        ({"kind": "kl", "teacher_logits": None}, "teacher_logits"),
        ({"kind": "ce", "labels": None}, "labels"),
        ({"weights": [1.0, 2.0]}, "weights"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"temperature": 0.0}, "temperature"),
        ({"labels": torch.zeros(B, T + 1, dtype=torch.long)}, "labels"),
    ],
)
def test_loss_errors(kwargs, match):
    head, hiddens, teacher, labels = _problem()
    args = {"weights": [0.2, 0.3, 0.5], "kind": "both", "teacher_logits": teacher, "labels": labels}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        early_exit_loss(hiddens, head, args.pop("weights"), **args)


# ---------------------------------------------------------------- agreement_metrics


def _metric_logits():
    # Log-probabilities as logits, so that softmax returns these exact distributions.
    exit_p = torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]])
    final_p = torch.tensor([[[0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.2, 0.2, 0.6]]])
    # Per position: argmax agree / disagree / agree; sum of min = 0.8, 0.7, 1.0.
    return exit_p.log(), final_p.log()


def test_agreement_metrics_hand_made():
    exit_logits, final_logits = _metric_logits()
    m = agreement_metrics(exit_logits, final_logits)
    assert m["count"] == 3
    assert m["top1_matches"] == 2.0
    assert m["top1_agreement"] == pytest.approx(2 / 3)
    assert m["acceptance_sum"] == pytest.approx(2.5, abs=1e-6)
    assert m["expected_acceptance"] == pytest.approx(2.5 / 3, abs=1e-6)


def test_agreement_metrics_mask_and_aggregation():
    exit_logits, final_logits = _metric_logits()
    masked = agreement_metrics(exit_logits, final_logits, torch.tensor([[True, False, True]]))
    assert masked["count"] == 2
    assert masked["top1_agreement"] == 1.0
    assert masked["expected_acceptance"] == pytest.approx(0.9, abs=1e-6)
    # Callers aggregate over batches with the sums and counts.
    first = agreement_metrics(exit_logits[:, :1], final_logits[:, :1])
    rest = agreement_metrics(exit_logits[:, 1:], final_logits[:, 1:])
    count = first["count"] + rest["count"]
    assert (first["acceptance_sum"] + rest["acceptance_sum"]) / count == pytest.approx(2.5 / 3, abs=1e-6)
    empty = agreement_metrics(exit_logits, final_logits, torch.zeros(1, 3, dtype=torch.bool))
    assert empty["count"] == 0 and empty["top1_agreement"] == 0.0 and empty["expected_acceptance"] == 0.0


def test_agreement_metrics_identical_logits_is_perfect():
    logits = torch.randn(2, 4, 9)
    m = agreement_metrics(logits, logits)
    assert m["top1_agreement"] == 1.0
    assert m["expected_acceptance"] == pytest.approx(1.0, abs=1e-6)


def test_agreement_metrics_shape_error():
    with pytest.raises(ValueError, match="same shape"):
        agreement_metrics(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4))


# --- the trimmed exit loss: V' ids plus "other" ---------------------------------------------------

def _head_over(weight, vocab):
    """Exact student logits over the trimmed classes: the V' rows, and the logsumexp of the rest."""
    def head(h):
        logits = h @ weight.T  # (n, V)
        return vocab.fold_logits(logits)
    return head


@pytest.mark.parametrize("kind", ["kl", "ce", "both", "argmax"])
def test_the_trimmed_loss_over_the_whole_vocabulary_equals_the_full_loss(kind):
    torch.manual_seed(0)
    vocab_size, dim = 40, 8
    weight = torch.randn(vocab_size, dim)
    hidden = [torch.randn(2, 6, dim, requires_grad=True), torch.randn(2, 6, dim, requires_grad=True)]
    teacher = torch.randn(2, 6, vocab_size) * 3
    labels = torch.randint(0, vocab_size, (2, 6))
    labels[1, -2:] = -100
    perm = torch.randperm(vocab_size)
    vocab = TrimmedVocab(perm, vocab_size)
    assert not vocab.has_other and vocab.num_classes == vocab_size
    args = dict(kind=kind, teacher_logits=teacher, labels=labels, temperature=1.5, chunk_size=5)
    full = early_exit_loss(hidden, lambda h: h @ weight.T, [0.3, 0.7], **args)
    trimmed = early_exit_loss(hidden, lambda h: h @ weight[perm].T, [0.3, 0.7], vocab=vocab, **args)
    torch.testing.assert_close(trimmed, full)
    grads_full = torch.autograd.grad(full, hidden)
    grads_trimmed = torch.autograd.grad(trimmed, hidden)
    for a, b in zip(grads_full, grads_trimmed):
        torch.testing.assert_close(a, b)


def test_folding_keeps_each_distribution_whole_and_the_other_class_holds_the_rest():
    torch.manual_seed(1)
    logits = torch.randn(5, 30) * 2
    vocab = TrimmedVocab([3, 7, 1, 20], 30)
    folded = vocab.fold_logits(logits).softmax(-1)  # (5, 5)
    assert folded.shape == (5, 5)
    torch.testing.assert_close(folded.sum(-1), torch.ones(5))
    p = logits.softmax(-1)
    torch.testing.assert_close(folded[:, :4], p[:, [3, 7, 1, 20]])
    torch.testing.assert_close(folded[:, 4], 1 - p[:, [3, 7, 1, 20]].sum(-1))
    labels = torch.tensor([7, 0, -100, 20])
    assert vocab.fold_labels(labels, -100).tolist() == [1, 4, -100, 3]


def test_the_trimmed_kl_is_zero_exactly_when_the_student_matches_the_folded_teacher():
    torch.manual_seed(2)
    vocab_size, dim = 30, 30
    vocab = TrimmedVocab([0, 5, 9], vocab_size)
    teacher = torch.randn(1, 4, vocab_size)
    # A student whose hidden state is the teacher's logits and whose head is the identity: exact copy.
    same = early_exit_loss([teacher.clone()], _head_over(torch.eye(dim), vocab), [1.0], kind="kl",
                           teacher_logits=teacher, vocab=vocab)
    assert abs(float(same)) < 1e-6
    other = early_exit_loss([torch.randn(1, 4, dim)], _head_over(torch.eye(dim), vocab), [1.0], kind="kl",
                            teacher_logits=teacher, vocab=vocab)
    assert float(other) > 0.01


def test_trimmed_vocabulary_ids_are_checked():
    with pytest.raises(ValueError, match="ids in 0..9"):
        TrimmedVocab([3, 10], 10)
    with pytest.raises(ValueError, match="must not repeat"):
        TrimmedVocab([3, 3], 10)


@pytest.mark.parametrize("kind", ["kl", "ce", "both"])
def test_each_exits_own_loss_is_reported_and_weighs_into_the_total(kind):
    """`early_exit_losses` gives every exit's unweighted mean loss beside the total (what the training
    logs as exit_loss@l); the total is their weighted sum."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11)
    hiddens = [torch.randn(2, 5, 8) for _ in range(3)]
    teacher, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    labels[0, :2] = -100
    weights = [0.2, 0.3, 0.5]
    total, per_exit = early_exit_losses(hiddens, head, weights, kind=kind, teacher_logits=teacher,
                                        labels=labels, chunk_size=3)
    assert len(per_exit) == 3 and all(not p.requires_grad for p in per_exit)
    alone = [early_exit_loss([h], head, [1.0], kind=kind, teacher_logits=teacher, labels=labels, chunk_size=3)
             for h in hiddens]
    torch.testing.assert_close(torch.stack(per_exit), torch.stack(alone).detach())
    torch.testing.assert_close(total, sum(w * p for w, p in zip(weights, per_exit)))
