"""Early-exit losses: which exit layers to train, how to weight them, and a memory-light loss.

Conventions: a model has N decoder blocks; the exit "at layer l" is the output of block l-1, i.e.
the hidden state after l blocks (l in 1..N). Early-exit candidates are l in 1..N-1: the final layer
N always gets its own CE loss in the training loop. Each exit is read out through the model's own
final norm + LM head (``head_fn``).

This module is pure torch and knows nothing of models. Which layers a config names is parsed by
`selfspec.config.parse_layers`; how well an exit agrees with the final layer is `selfspec.agreement`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..agreement import IGNORE_INDEX, low_precision_to_float
from ..config import Curriculum, ExitLoss, ExitScale, check_choice, check_layer
from ..errors import UserError


def layer_weights(kind: str, layers: Sequence[int], num_layers: int) -> torch.Tensor:
    """Return the loss weight of each exit layer, float32 of shape (len(layers),), summing to 1.

    Pass the layers active at this step (after the curriculum): the weights are normalised over
    exactly those, so the early-exit loss keeps the same scale whichever subset is on.
    Unnormalised weight of exit layer l (blocks run, 1-based):

    - ``uniform``: 1;
    - ``linear``: l;
    - ``sqrt``: sqrt(l);
    - ``sum_l``: l * (l + 1) / 2 = sum(range(l + 1)).

    torchtune's ``sum_l_loss_scale`` is ``cumsum(layer_ids + 1)`` over the listed exits, with 0-based
    block ids, i.e. the running sum of the listed l's. That equals l * (l + 1) / 2 when the list is
    every layer from 1 up (``"all"``); for a sparse list it would make a layer's weight depend on
    which other layers happen to be active, so here it depends on l alone. ``linear`` and ``sqrt``
    match torchtune's ``layer_ids + 1`` and ``sqrt(layer_ids + 1)``.

    Layers may range over 1..N (N allowed for callers that weight the final layer together).
    An empty ``layers`` gives an empty tensor.
    """
    check_choice("early-exit weight kind", kind, ExitScale)
    for layer in layers:
        check_layer(layer, num_layers, num_layers)
    ls = torch.tensor(list(layers), dtype=torch.float64)  # (L,)
    if kind == "uniform":
        raw = torch.ones_like(ls)
    elif kind == "linear":
        raw = ls
    elif kind == "sqrt":
        raw = ls.sqrt()
    else:  # sum_l
        raw = ls * (ls + 1) / 2
    if raw.numel() == 0:
        return raw.float()
    return (raw / raw.sum()).float()


class ExitCurriculum:
    """Which early-exit candidates get a loss at each step. Stateless in ``step``, so resume is free.

    Kinds, for K sorted candidates c_0 < ... < c_{K-1}:

    - ``none``: all candidates at every step.
    - ``rotational``: candidate i is active at step t when i % R == t % R (R = ``rotation_period``),
      so each step trains about K / R exits and every candidate is active exactly once in any R
      consecutive steps. With R > K some steps have no active exit (empty list).
    - ``gradual``: switched on from the top down. Training is split into K equal stages; at step t the
      n(t) = min(K, 1 + floor(K * t / T)) deepest candidates are active, so step 0 trains only
      c_{K-1}, candidate c_i switches on at step ceil((K-1-i) * T / K), and all are on for the last
      T / K steps (and any step >= T). The torchtune variant differs (nothing at step 0,
      ``fraction_scale``); this one always trains at least one exit.
    """

    def __init__(self, kind: str, layers: Sequence[int], total_steps: int, rotation_period: int = 2) -> None:
        check_choice("early-exit curriculum", kind, Curriculum)
        if not layers:
            raise UserError("early-exit curriculum needs at least one candidate layer, got []")
        if kind == "rotational" and rotation_period < 1:
            raise UserError(f"rotation_period must be >= 1, got {rotation_period}")
        if kind == "gradual" and total_steps < 1:
            raise UserError(f"total_steps must be >= 1 for the gradual curriculum, got {total_steps}")
        self.kind = kind
        self.layers = sorted(set(layers))
        self.total_steps = total_steps
        self.rotation_period = rotation_period

    def active(self, step: int) -> list[int]:
        """Return the sorted candidate layers that get an early-exit loss at training step ``step``."""
        k = len(self.layers)
        if self.kind == "none":
            return list(self.layers)
        if self.kind == "rotational":
            phase = step % self.rotation_period
            return [layer for i, layer in enumerate(self.layers) if i % self.rotation_period == phase]
        n_active = min(k, 1 + (k * max(step, 0)) // self.total_steps)  # integer maths: exact stages
        return self.layers[k - n_active :]


class TrimmedVocab:
    """The exit loss over V' frequent token ids plus one "other" class that holds the rest.

    A full exit loss reads the whole LM head per position (SmolLM2: 49,152 x 576, eight times one
    block), so it used to run on a fraction of the positions. Over V' ids it costs V'/V of that and
    can cover every position. The teacher's mass outside the V' ids is folded into the "other"
    class and the student gets an "other" logit too, so the loss stays a proper divergence between
    two distributions over V' + 1 classes. With V' = V there is no other class and the loss equals
    the full one. The draft head trimmed to the same ids (`decoding.draft_head`) proposes from them.

    token_ids: (V',) distinct ids in 0..V-1 (e.g. `frequent_tokens(counts, V')`).
    """

    def __init__(self, token_ids, vocab_size: int):
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        if ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise UserError(f"trimmed vocabulary ids must be a non-empty list of ids in 0..{vocab_size - 1}")
        if ids.unique().numel() != ids.numel():
            raise UserError("trimmed vocabulary ids must not repeat")
        self.token_ids, self.vocab_size = ids, vocab_size
        self.has_other = ids.numel() < vocab_size
        # class of every token id: its place among the V' ids, or V' (other) outside them
        self.class_of = torch.full((vocab_size,), ids.numel(), dtype=torch.long)
        self.class_of[ids] = torch.arange(ids.numel())

    @property
    def num_classes(self) -> int:
        """V' + 1 with an "other" class, V' when the ids cover the whole vocabulary."""
        return self.token_ids.numel() + int(self.has_other)

    def to(self, device) -> TrimmedVocab:
        self.token_ids, self.class_of = self.token_ids.to(device), self.class_of.to(device)
        return self

    def fold_logits(self, teacher: torch.Tensor) -> torch.Tensor:
        """Logits (n, V) -> (n, V' [+1]) whose softmax is the folded softmax: the V' ids' own
        logits and, for "other", the logsumexp of all the rest (exact, not an estimate)."""
        sub = teacher.index_select(-1, self.token_ids)  # (n, V')
        if not self.has_other:
            return sub
        outside = teacher.index_fill(-1, self.token_ids, float("-inf"))  # (n, V): only the other ids
        return torch.cat([sub, outside.logsumexp(-1, keepdim=True)], dim=-1)

    def fold_labels(self, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """Token ids -> classes (V' for ids outside the subset); ignore_index stays."""
        valid = labels != ignore_index
        return torch.where(valid, self.class_of[labels.clamp(min=0)], labels)


def _teacher_targets(teacher: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher probabilities p (n, V) and Σ_v p log p (n,), computed once and shared by every exit.

    KL(p || q) = Σ p log p − Σ p log q: the first term has no gradient, so per exit and chunk only
    log q and one weighted sum remain to compute.
    """
    log_p = F.log_softmax(low_precision_to_float(teacher.detach()) / temperature, dim=-1)  # (n, V)
    p = log_p.exp()
    # 0 where p == 0, so a -inf teacher logit does not give 0 * -inf = nan.
    neg_entropy = torch.where(p > 0, p * log_p, 0.0).sum(-1)  # (n,)
    return p, neg_entropy


def _token_loss_sum(
    logits: torch.Tensor,
    teacher: tuple[torch.Tensor, torch.Tensor] | None,
    labels: torch.Tensor | None,
    kind: str,
    temperature: float,
    ignore_index: int,
) -> torch.Tensor:
    """Sum over valid rows of the per-token loss for one chunk; logits (n, V), teacher = (p (n, V),
    Σ p log p (n,)) from `_teacher_targets`, labels (n,)."""
    logits = low_precision_to_float(logits)
    valid = None if labels is None else labels != ignore_index  # (n,)
    total = logits.new_zeros(())
    if kind in ("kl", "both"):
        p, neg_entropy = teacher
        log_q = F.log_softmax(logits / temperature, dim=-1)  # (n, V) student
        kl_tok = neg_entropy - (p * log_q).sum(-1)  # (n,)
        if valid is not None:
            kl_tok = torch.where(valid, kl_tok, 0.0)
        total = total + kl_tok.sum() * temperature**2
    if kind in ("ce", "both", "argmax"):  # argmax: `labels` are the teacher's argmax classes
        total = total + F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return total


def _as_exit_list(exit_hidden: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(exit_hidden, torch.Tensor):
        if exit_hidden.dim() != 4:
            raise ValueError(f"exit_hidden tensor must be (L, B, T, D), got shape {tuple(exit_hidden.shape)}")
        return list(exit_hidden.unbind(0))
    return list(exit_hidden)


def _validate_loss_args(
    hiddens: list[torch.Tensor],
    weights: torch.Tensor,
    kind: str,
    teacher_logits: torch.Tensor | None,
    labels: torch.Tensor | None,
    temperature: float,
) -> None:
    check_choice("early-exit loss kind", kind, ExitLoss)
    if weights.shape != (len(hiddens),):
        raise ValueError(
            f"weights must have shape ({len(hiddens)},) (one per exit), got {tuple(weights.shape)}"
        )
    if not temperature > 0:
        raise UserError(f"temperature must be > 0, got {temperature}")
    if kind in ("kl", "both", "argmax") and teacher_logits is None:
        raise ValueError(f"early-exit loss kind {kind!r} needs teacher_logits")
    if kind in ("ce", "both") and labels is None:
        raise ValueError(f"early-exit loss kind {kind!r} needs labels")
    for h in hiddens:
        if h.dim() != 3:
            raise ValueError(f"each exit hidden must be (B, T, D), got shape {tuple(h.shape)}")
        bt = tuple(h.shape[:2])
        if teacher_logits is not None and tuple(teacher_logits.shape[:2]) != bt:
            raise ValueError(
                f"teacher_logits must be (B, T, V) with (B, T) = {bt}, got {tuple(teacher_logits.shape)}"
            )
        if labels is not None and tuple(labels.shape) != bt:
            raise ValueError(f"labels must be (B, T) = {bt}, got {tuple(labels.shape)}")


def _zero_loss(teacher_logits: torch.Tensor | None, labels: torch.Tensor | None) -> torch.Tensor:
    ref = teacher_logits if teacher_logits is not None else labels
    return torch.zeros((), device=None if ref is None else ref.device)


def _flat_targets(kind: str, teacher_logits: torch.Tensor | None, labels: torch.Tensor | None,
                  temperature: float, vocab: TrimmedVocab | None) -> tuple[tuple | None, torch.Tensor | None]:
    """The targets flattened over (B*T,): the teacher's (`_teacher_targets`, for kl and both; folded to
    V' + 1 classes with `vocab`) and the labels (argmax: the teacher's argmax where a label counts;
    folded with `vocab`)."""
    ignore_index = IGNORE_INDEX
    # Flatten (B, T) -> (B*T,) once; reshape of contiguous tensors is a view, no copy.
    teacher_flat = None
    labels_flat = None if labels is None else labels.reshape(-1)  # (B*T,)
    if teacher_logits is not None and kind in ("kl", "both", "argmax"):
        teacher_2d = low_precision_to_float(teacher_logits.detach())
        teacher_2d = teacher_2d.reshape(-1, teacher_logits.shape[-1])  # (n, V)
        if kind == "argmax":
            argmax = teacher_2d.argmax(-1)  # (n,)
            labels_flat = argmax if labels_flat is None else torch.where(labels_flat != ignore_index, argmax,
                                                                         labels_flat)
        else:
            if vocab is not None:  # fold at temperature τ, then undo the 1/τ that _teacher_targets applies
                teacher_2d = vocab.fold_logits(teacher_2d / temperature) * temperature  # (n, V' + 1)
            teacher_flat = _teacher_targets(teacher_2d, temperature)
    if vocab is not None and labels_flat is not None:
        labels_flat = vocab.fold_labels(labels_flat, ignore_index)
    return teacher_flat, labels_flat


def early_exit_loss(*args, **kwargs) -> torch.Tensor:
    """The weighted early-exit loss of `early_exit_losses` (same arguments), a scalar tensor."""
    return early_exit_losses(*args, **kwargs)[0]


def early_exit_losses(
    exit_hidden: Sequence[torch.Tensor] | torch.Tensor,
    head_fn: Callable[[torch.Tensor], torch.Tensor],
    weights: torch.Tensor | Sequence[float],
    *,
    kind: str,
    teacher_logits: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    checkpoint_chunks: bool = True,
    vocab: TrimmedVocab | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Weighted early-exit loss over exits, computed in token chunks: (the scalar tensor, each exit's own
    loss unweighted and detached, in the order of the exits: what the training logs per exit).

    Args:
        exit_hidden: L exit hidden states, a list of (B, T, D) or one (L, B, T, D) tensor.
        head_fn: the model's final norm + LM head, mapping (n, D) to logits (n, V).
        weights: (L,) weight of each exit (e.g. :func:`layer_weights` of the active layers).
        kind: ``kl`` (distil from the teacher), ``ce`` (to the labels), ``both`` (their sum) or
            ``argmax`` (CE to the teacher's argmax: the direct surrogate of greedy acceptance). Soft
            CE to the teacher is KL plus the teacher's entropy, which has no gradient: ``kl`` is it.
        teacher_logits: (B, T, V) logits of the full model; detached here (no gradient to it).
        labels: (B, T) targets, already shifted (position t predicts labels[:, t]). Positions equal
            to ``IGNORE_INDEX`` (-100) are left out of both KL and CE; with no labels every position
            counts.
        temperature: τ. KL(teacher || student) uses softmax(teacher / τ), log_softmax(student / τ)
            and is multiplied by τ², as in distillation, so gradients keep their scale across τ.
        chunk_size: tokens (rows of the flattened B*T) per chunk.
        checkpoint_chunks: recompute each chunk's logits in backward instead of keeping them, so
            that the backward pass too holds one (chunk, V) logits block at a time.
        vocab: the loss over V' ids plus "other" (`TrimmedVocab`): ``head_fn`` then returns
            (n, vocab.num_classes) logits, and the teacher and the labels are folded to match.

    Loss of one exit = (Σ over valid tokens of τ²·KL and/or CE) / number of valid tokens; the result
    is Σ_e weights[e] · loss_e. If no token is valid the result is 0 (not NaN), so a fully padded
    micro-batch on one rank does not poison the all-reduced gradient.

    Memory: never builds an (L, B, T, V) or even a (B, T, V) student tensor: it loops over exits and
    over chunks of tokens, so the peak is one (chunk, V) logits block (plus its softmaxes).
    """
    ignore_index = IGNORE_INDEX
    hiddens = _as_exit_list(exit_hidden)
    if chunk_size < 1:
        raise UserError(f"chunk_size must be >= 1, got {chunk_size}")
    weights_t = torch.as_tensor(weights, dtype=torch.float32)
    _validate_loss_args(hiddens, weights_t, kind, teacher_logits, labels, temperature)
    if not hiddens:
        return _zero_loss(teacher_logits, labels), []

    teacher_flat, labels_flat = _flat_targets(kind, teacher_logits, labels, temperature, vocab)
    if labels_flat is None:
        n_valid = hiddens[0].shape[0] * hiddens[0].shape[1]
    else:  # counted on the device, with no host read; divided in float64 as the host would
        n_valid = (labels_flat != ignore_index).sum().clamp(min=1).double()

    def chunk_loss(h: torch.Tensor, t: tuple | None, y: torch.Tensor | None) -> torch.Tensor:
        # The (chunk, V) logits live only inside this call (and again in its recomputation).
        return _token_loss_sum(head_fn(h), t, y, kind, temperature, ignore_index)

    use_checkpoint = checkpoint_chunks and torch.is_grad_enabled()
    total, per_exit = None, []
    for weight, hidden in zip(weights_t.tolist(), hiddens, strict=True):
        h_flat = hidden.reshape(-1, hidden.shape[-1])  # (B*T, D)
        exit_sum = None
        for start in range(0, h_flat.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            t_chunk = None if teacher_flat is None else (teacher_flat[0][rows], teacher_flat[1][rows])
            y_chunk = None if labels_flat is None else labels_flat[rows]  # (chunk,)
            if use_checkpoint:
                part = checkpoint(chunk_loss, h_flat[rows], t_chunk, y_chunk, use_reentrant=False)
            else:
                part = chunk_loss(h_flat[rows], t_chunk, y_chunk)
            exit_sum = part if exit_sum is None else exit_sum + part
        scale = weight / n_valid
        per_exit.append((exit_sum.detach() / n_valid).float())
        term = exit_sum * (scale.to(exit_sum.dtype) if torch.is_tensor(scale) else scale)
        total = term if total is None else total + term
    return total, per_exit
