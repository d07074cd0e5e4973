"""The proposers behind one method: `propose(state, room) -> int` appends up to `room` drafts to the round's
`RoundState` and says how many. (Their drafts in a whole decode, token for token against plain decoding,
are the engine's tests: test_decoding_speculative, _hybrid, _grammar, test_backends.)"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import torch

from selfspec.decoding.batch import no_lap
from selfspec.decoding.controller import FixedK
from selfspec.decoding.ngram import NGramConfig, RowIndexes
from selfspec.decoding.policy import CopyPolicy
from selfspec.decoding.proposers import CopyProposer, EarlyExitProposer, ForcedProposer, Proposer, RoundState


def test_every_proposer_has_the_one_signature():
    one = inspect.signature(Proposer.propose)
    for proposer in (EarlyExitProposer, CopyProposer, ForcedProposer):
        assert inspect.signature(proposer.propose) == one, proposer.__name__


def _state(policy, rows: np.ndarray, k_max: int) -> RoundState:
    b = SimpleNamespace(rows=rows, grammar=None, forces=False, steps=torch.arange(16),
                        lap=no_lap, pending_dev=torch.full((len(rows),), 2))
    return RoundState(b, policy, policy.plan(rows), k_max, unrun=[b.pending_dev[:, None]])


def test_a_copy_is_the_plans_at_the_rounds_start_then_the_policys_within_the_copy_length():
    config = NGramConfig(max_ngram=2, min_ngram=2, max_copy=4)
    policy = CopyPolicy(config, FixedK(2), copy_controller=FixedK(3))
    policy.start([[1, 2, 3, 1, 2]])
    state = _state(policy, np.array([0]), k_max=2)
    assert state.plan.copied.tolist() == [[3, 1, 2]]
    copies = CopyProposer(lambda: None)
    assert copies.propose(state, state.k_left) == 2  # the plan's copy, cut to the drafts the round has left
    assert state.draft.tokens.tolist() == [[3, 1]] and len(state.unrun) == 2 and state.k_left == 0
    state.k_max = 8  # after drafts: the policy's copy after them (2 3 1 around the period), cut to the 1
    assert copies.propose(state, state.k_left) == 1  # the round may still copy (3 in all)
    assert state.draft.tokens.tolist() == [[3, 1, 2]]
    assert [(s.source, s.start, s.length) for s in state.draft.segments] == [("copy", 0, 3)]
    assert copies.propose(state, state.k_left) == 0  # the copy length is spent
    assert ForcedProposer().propose(state, state.k_left) == 0  # a call without forced tokens


def test_the_policy_asks_the_rows_indexes_for_copies_padded_to_one_draft():
    indexes = RowIndexes(NGramConfig(max_ngram=2, min_ngram=2, max_copy=4))
    indexes.add([[1, 2, 3, 1, 2], [5, 6, 7]])
    assert indexes.copies(np.array([0, 1]), 4).tolist() == [[3, 1, 2, 3], [7, 7, 7, 7]]
    indexes.extend(np.array([1]), np.array([[5, 6, 0]]), np.array([2]))
    assert indexes.history(1).tolist() == [5, 6, 7, 5, 6]
    assert indexes.copies(np.array([1]), 2, extra=np.array([[7]])).tolist() == [[5, 6]]
    assert indexes.copies(np.array([0]), 2, extra=np.array([[9]])).shape == (1, 0)
