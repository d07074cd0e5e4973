"""The training objective as one `nn.Module`: layer dropout, the final CE and the early-exit losses.

Wrapping the whole forward in a module is what lets `accelerate.prepare` hand it to DDP/FSDP: the
blocks are called one by one through `DecoderView` inside this module's `forward`, so gradient
synchronisation and FSDP's all-gathers happen exactly as they would for the plain model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from ..agreement import IGNORE_INDEX, exit_layer_metrics, shifted_labels
from ..config import EarlyExitConfig
from ..cpu import to_device
from ..errors import UserError
from ..model import DecoderView
from .early_exit import ExitCurriculum, TrimmedVocab, early_exit_losses, layer_weights
from .layer_dropout import LayerDropout, apply_block


class FrozenTeacher(nn.Module):
    """The frozen teacher's logits (B, T) -> (B, T, V) as one module's forward: `model` (a copy of the
    original model, eval mode, no gradients) run through `DecoderView`, as the student's blocks are.

    One module whose forward is the whole pass is what FSDP shards (`training.loop.shard_teacher`):
    its root hooks gather the embedding, final norm and head for the pass, each block's hooks that
    block's weights, and a sharded teacher computes the very logits of an unsharded one."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return DecoderView(self.model)(input_ids)


class SelfSpecObjective(nn.Module):
    """loss = final_weight · CE(final layer, labels) + weight · Σ_l w_l · exit_loss(layer l), under
    layer dropout.

    model: the Hugging Face causal LM (possibly a PEFT model) being trained.
    early_exit: the `early_exit` section: the loss kind, scale, weights, temperature, chunking,
        token fraction, teacher and curriculum of the exit losses (default: its defaults).
    exit_layers: the candidate exits as ints; None: `early_exit.layers` parsed against the model's
        depth. Empty (or layers None) disables the exit losses.
    layer_dropout: per-block skip sampler, or None for no dropout.
    total_steps: the run's length, which the gradual curriculum is laid out over.
    frozen_model: the teacher of `teacher: frozen` for a full fine-tune (the original model, without
        dropout), kept as a `FrozenTeacher` (`frozen_model`, a plain attribute: neither trained nor
        saved); under LoRA the base with adapters disabled is the teacher, so the weights are never
        copied.
    seed: draws the positions of `token_fraction` < 1 (a pure function of seed and step).
    exit_vocab: exit losses over V' ids plus "other" (`TrimmedVocab`, which `early_exit.draft_vocab_size`
        asks for and the training data's token counts rank). The student's "other" logit is
        w·norm(h) + b, one trained row beside the head (it exists for the loss only; a draft
        proposes from the V' ids), initialised at the mean head row of the other ids and
        log(V - V'): a lower bound of their logsumexp by Jensen's inequality.
    exit_adapter: an exit adapter (trainable: adapter; `ExitAdapter` or `ExitBlock`) applied to the
        exit hidden states before the head; the exits' losses then train it, and the frozen model's
        own final layer is the teacher.
    """

    def __init__(self, model: nn.Module, early_exit: EarlyExitConfig | None = None,
                 exit_layers: Sequence[int] | None = None, *, layer_dropout: LayerDropout | None = None,
                 total_steps: int = 1, frozen_model: nn.Module | None = None, seed: int = 0,
                 exit_vocab: TrimmedVocab | None = None, exit_adapter: nn.Module | None = None):
        super().__init__()
        self.model = model
        # a plain attribute: the same modules, not registered twice
        self.__dict__["view"] = DecoderView(model)
        ee = self.early_exit = early_exit if early_exit is not None else EarlyExitConfig()
        if exit_layers is None:
            exit_layers = ee.layer_list(self.view.num_layers)
        self.layer_dropout = layer_dropout
        self.applied_dropout: float | None = None  # the last batch's share of skipped (block, row) pairs
        self.exit_layers = list(exit_layers)
        self.curriculum = (ExitCurriculum(ee.curriculum, self.exit_layers, total_steps, ee.rotation_period)
                           if self.exit_layers else None)
        self.seed = seed
        # A plain attribute, not a submodule: the frozen teacher is neither trained nor saved, and what
        # prepares the student (DDP, FSDP) leaves it alone (`training.loop.shard_teacher` shards it).
        if frozen_model is not None and not isinstance(frozen_model, FrozenTeacher):
            frozen_model = FrozenTeacher(frozen_model)
        self.__dict__["frozen_model"] = frozen_model
        if ee.teacher == "frozen" and frozen_model is None and not hasattr(model, "disable_adapter"):
            raise UserError("early_exit.teacher = 'frozen' needs frozen_model for a full fine-tune "
                            "(or a PEFT model)")
        self.exit_vocab = exit_vocab
        self.exit_adapter = exit_adapter
        if exit_vocab is not None:
            head = self.view.lm_head.weight.detach()  # (V, D)
            exit_vocab.to(head.device)
            if exit_vocab.has_other:
                outside = exit_vocab.class_of == exit_vocab.token_ids.numel()  # (V,)
                self.other_row = nn.Parameter(head[outside].mean(0).clone())  # (D,)
                self.other_bias = nn.Parameter(torch.tensor(math.log(int(outside.sum())), dtype=head.dtype))

    @property
    def _no_split_modules(self) -> list[str]:
        """The model's block classes: what accelerate's FSDP wraps as units when the launch config
        names none (it reads this attribute of the module it prepares, which is this one)."""
        return list(getattr(self.model, "_no_split_modules", None) or [])

    # accelerate's FSDP2 preparation reads these of the module it prepares, which is this one: with
    # `fsdp_cpu_ram_efficient_loading` it moves the module to `meta` and back, which gives a tied head a
    # parameter of its own, and re-ties it only through `tie_weights`; and it shards the embeddings (one
    # unit for a tied pair) as `get_input_embeddings` / `get_output_embeddings` name them
    def tie_weights(self, *args, **kwargs) -> None:
        """The model's own `tie_weights` (a tied head shares the embedding's parameter again)."""
        tie = getattr(self.model, "tie_weights", None)
        if tie is not None:
            tie(*args, **kwargs)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        return self.model.get_output_embeddings()

    def _exit_head(self):
        """norm + head for the exit losses: (n, D) -> (n, V) logits, or (n, V' [+1]) over the trimmed
        vocabulary."""
        view, vocab = self.view, self.exit_vocab
        if vocab is None:
            return view.exit_logits
        # The V' rows, gathered once per forward; their gradient flows back into the head.
        weight = view.lm_head.weight.index_select(0, vocab.token_ids)  # (V', D)
        bias = getattr(view.lm_head, "bias", None)
        bias = None if bias is None else bias.index_select(0, vocab.token_ids)

        def head(hidden: torch.Tensor) -> torch.Tensor:
            normed = view.final_norm(hidden)  # (n, D)
            logits = F.linear(normed, weight, bias)  # (n, V')
            if not vocab.has_other:
                return logits
            other = F.linear(normed, self.other_row[None].to(normed.dtype),
                             self.other_bias[None].to(normed.dtype))  # (n, 1)
            return torch.cat([logits, other], dim=-1)  # (n, V' + 1)

        return head

    def forward(self, input_ids: torch.Tensor | None = None, step: int = 0,
                target_mask: torch.Tensor | None = None, draft_mask: torch.Tensor | None = None,
                **features) -> dict[str, torch.Tensor]:
        """The losses of one batch (B, T); `target_mask` (B, T) limits them to chat data's assistant
        tokens, `draft_mask` (B, T) the exit losses to the tokens the exit drafts (`early_exit.
        skip_forced`: not those a grammar forced). With `features` (`training.features`: exit_hidden,
        teacher_ids, teacher_probs) the frozen model is not run: the exit adapter trains on the stored
        exit states and teacher."""
        exit_mask = target_mask if draft_mask is None else draft_mask
        if features:
            return self._cached_exit_loss(target_mask=exit_mask, **features)
        view, ee = self.view, self.early_exit
        batch = input_ids.shape[0]
        drop = None
        if self.layer_dropout is not None:  # (N, B) on the host, where `apply_block` decides
            drop = self.layer_dropout.sample(step, batch, training=self.training)
        active = self.curriculum.active(step) if self.exit_layers else []

        hidden = view.embed(input_ids)  # (B, T, D)
        context = view.context(hidden)
        exits = []  # hidden states (B, T, D) after l blocks, for each active exit layer l
        # Without a final loss nothing behind the deepest exit needs a gradient.
        grad_end = max(active) if active and ee.final_weight == 0 else view.num_layers
        for index in range(view.num_layers):
            block = lambda h, i=index: view.run_block(i, h, context)
            with torch.no_grad() if index >= grad_end else nullcontext():
                hidden = block(hidden) if drop is None else apply_block(block, hidden, drop[index])
            if index + 1 in active:
                exits.append(hidden if self.exit_adapter is None
                             else self.exit_adapter(hidden, view, context))
        labels = shifted_labels(input_ids, target_mask)
        with torch.no_grad() if grad_end < view.num_layers else nullcontext():
            logits = view.exit_logits(hidden)  # (B, T, V)
            # A sum over the targets / their count: a batch without targets gives 0, not nan.
            targets = (labels != IGNORE_INDEX).sum().clamp(min=1)
            final_ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                       ignore_index=IGNORE_INDEX, reduction="sum") / targets

        out = {"final_ce": final_ce.detach()}
        # the share of (block, row) pairs this batch skipped, the rate applied: counted on the host, where
        # the draws are, so that logging it sends nothing to the device
        self.applied_dropout = None if drop is None else float(drop.float().mean())
        loss = ee.final_weight * final_ce
        if exits:
            teacher_logits = self._teacher_logits(input_ids, logits) if ee.kind != "ce" else None
            exit_labels = labels if draft_mask is None else shifted_labels(input_ids, draft_mask)
            if ee.token_fraction < 1.0:
                exits, teacher_logits, exit_labels = self._subsample(exits, teacher_logits, exit_labels, step)
            weights = layer_weights(ee.scale, active, view.num_layers)  # (L,) host floats
            exit_loss, per_exit = early_exit_losses(exits, self._exit_head(), weights, kind=ee.kind,
                                                    teacher_logits=teacher_logits, labels=exit_labels,
                                                    temperature=ee.temperature, chunk_size=ee.chunk_size,
                                                    vocab=self.exit_vocab)
            loss = loss + ee.weight * exit_loss
            out["exit_loss"] = exit_loss.detach()
            # each exit's own loss, as `exits` holds them: by depth
            out.update({f"exit_loss@{layer}": value for layer, value in zip(sorted(active), per_exit)})
        out["loss"] = loss
        return out

    def exit_metrics(self, blocks: torch.Tensor, layers: list[int], exit_layer: int, batch_size: int,
                     reduce=None, target_mask: torch.Tensor | None = None) -> dict[int, dict[str, float]]:
        """`agreement.exit_layer_metrics` of the model being trained at `layers`, the exit adapter read
        at `exit_layer`, and the trimmed draft vocabulary: the evaluation. A method of the objective
        because FSDP2 shards the objective's own weights (embedding, final norm, head: its root unit)
        and gathers them only around a forward method: the training loop registers this one
        (`torch.distributed.fsdp.register_fsdp_forward_method`)."""
        adapter, vocab = self.exit_adapter, self.exit_vocab
        return exit_layer_metrics(self.model, blocks, layers, batch_size=batch_size, reduce=reduce,
                                  target_mask=target_mask,
                                  exit_adapters=None if adapter is None else {exit_layer: adapter},
                                  draft_vocab=None if vocab is None else vocab.token_ids)

    def _cached_exit_loss(self, exit_hidden: torch.Tensor, teacher_ids: torch.Tensor,
                          teacher_probs: torch.Tensor, target_mask: torch.Tensor | None = None) -> dict:
        """Soft CE from stored exit states (B, T, D) to the stored teacher top K (B, T, K), through the
        exit adapter and the (trimmed) head, at the positions that predict a target (mask[t + 1]).

        The K probabilities are renormalised (argmax: the first alone, weight 1). Ids outside a
        trimmed vocabulary fold into its "other" class: the gather then adds their weights there."""
        view = self.view
        hidden = exit_hidden.to(view.dtype)
        if self.exit_adapter is not None:
            hidden = self.exit_adapter(hidden, view, view.context(hidden))
        valid = (target_mask[:, 1:] if target_mask is not None
                 else torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)[:, 1:])
        hidden = hidden[:, :-1][valid]  # (n, D): position t predicts token t + 1
        ids = teacher_ids[:, :-1][valid].long()  # (n, K)
        weights = teacher_probs[:, :-1][valid].float()  # (n, K)
        if self.early_exit.kind == "argmax":
            ids, weights = ids[:, :1], torch.ones_like(weights[:, :1])
        weights = weights / weights.sum(-1, keepdim=True)
        classes = ids if self.exit_vocab is None else self.exit_vocab.class_of[ids]
        log_q = torch.log_softmax(self._exit_head()(hidden).float(), -1)  # (n, V or V' + 1)
        loss = -(weights * log_q.gather(-1, classes)).sum(-1).mean() if len(hidden) else hidden.sum() * 0
        return {"exit_loss": loss.detach(), "loss": loss}

    def _subsample(self, exits, teacher_logits, labels, step: int):
        """The same random `token_fraction` of the B*T positions for every exit, fresh each step.

        The exit losses cost a (tokens, vocab) head pass per exit: on a random subset of positions
        they cost proportionally less and stay an unbiased estimate of the full-token loss. The
        subset is a pure function of (seed, step), so a resumed run draws the same positions.
        """
        batch, length = labels.shape
        count = max(1, math.ceil(self.early_exit.token_fraction * batch * length))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        index = to_device(torch.randperm(batch * length, generator=generator)[:count], labels.device)  # (n,)
        exits = [h.flatten(0, 1)[index][None] for h in exits]  # each (1, n, D)
        if teacher_logits is not None:
            teacher_logits = teacher_logits.flatten(0, 1)[index][None]  # (1, n, V)
        return exits, teacher_logits, labels.flatten()[index][None]

    def _teacher_logits(self, input_ids: torch.Tensor, own_logits: torch.Tensor) -> torch.Tensor:
        if self.early_exit.teacher == "self":
            return own_logits.detach()
        with torch.no_grad():
            if self.frozen_model is not None:
                return self.frozen_model(input_ids)
            # LoRA: the base model is the original weights with the adapters switched off.
            with self.model.disable_adapter() if hasattr(self.model, "disable_adapter") else nullcontext():
                return DecoderView(self.model)(input_ids)
