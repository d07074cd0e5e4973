"""Which tokens of a constrained reply its grammar forced.

Under a grammar the engine drafts a forced token for free (llguidance's fast-forward tokens: where the
grammar allows one continuation only, `{"name": "` after an object's start), so the early exit is
never asked for it. An exit trained on the served format (`early_exit.skip_forced`) leaves those
tokens out of its loss: its one block of capacity goes to the tokens it will draft.

A reply is replayed through a matcher of its schema, token by token: a token is forced when it is the
first of the fast-forward tokens at its prefix, exactly the draft the engine would have made there.
"""

from __future__ import annotations

import numpy as np

from ..decoding.grammar import Constraint, GrammarTokenizer


def grammar_tokenizer_for(tokenizer) -> GrammarTokenizer:
    """llguidance's index of a Hugging Face fast `tokenizer`, to replay its replies (which tokens a
    grammar forces does not depend on the model's logits width)."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return GrammarTokenizer(tokenizer, len(tokenizer), eos)


def forced_flags(ids: list[int], assistant: list[bool], json_schema: str,
                 grammar_tokenizer: GrammarTokenizer) -> np.ndarray:
    """(T,) bool for a conversation's tokens `ids` (chat template applied) whose `assistant` flags
    mark the replies: true where a token of the first reply is forced by `json_schema` at its prefix.
    The replay stops at the end of that reply, where the grammar completes, or at a token the grammar
    refuses (a reply tokenized otherwise than the model wrote it): the tokens after it count as free."""
    forced = np.zeros(len(ids), dtype=bool)
    start = next((i for i, flag in enumerate(assistant) if flag), None)
    if start is None:
        return forced
    matcher = grammar_tokenizer.matcher(Constraint("json_schema", json_schema))
    for i in range(start, len(ids)):
        if not assistant[i] or matcher.is_stopped():
            break
        fast_forward = matcher.compute_ff_tokens()
        forced[i] = bool(fast_forward) and fast_forward[0] == ids[i]
        if not matcher.consume_token(ids[i]):
            break
    return forced
