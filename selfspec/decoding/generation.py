"""`GenerationConfig`: what one `SelfSpecGenerator.generate` call asks for.

As Hugging Face's `generate` takes a `GenerationConfig` and keyword arguments that override its
fields, so does selfspec's: `generate(prompts, config, max_new_tokens=64)` decodes with `config`'s
fields and 64 tokens. How the call drafts is the generator's `DecodeSettings`, which `num_speculations`
and `drafter` override for this call only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the policy and controller import nothing of a call's request
    from .controller import Controller
    from .policy import DraftPolicy


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """One `generate` call's request; every field has the default a bare call uses.

    max_new_tokens: the most tokens generated per row (0: none).
    temperature/top_k/top_p: 0 = greedy; the same processing applies to draft and target.
    seed: int (row i uses seed + i), a list of per-row seeds, or None (drawn from torch's global
        generator). Each row's numbers depend only on its own seed and positions, so with a fixed k a
        row's result does not depend on its batch-mates; a batch-shared adaptive k changes where
        rounds end and thus which numbers are used, never the distribution.
    eos_token_id: int or list; None = the model's own (generation config, then config, then
        tokenizer); [] = never stop at eos. The eos token is included in the output.
    stop_strings: strings that end a row once its decoded output contains one (needs a tokenizer);
        the token completing it is the last one kept in `sequences`, and the row's text in `texts`
        ends before it (OpenAI's `stop`).
    num_speculations/drafter: override the settings' k and drafter for this call: k an int (0: plain
        decoding, whatever the drafter: no copies either), "auto" (cost model), "window" (the
        articles' rule) or a `Controller`; drafter "early_exit", "ngram" or "hybrid" (`policy.py`), or
        a `DraftPolicy` that plans the rounds itself.
    json_schema/regex/grammar: structured output (needs `selfspec[structured]` and a fast tokenizer):
        a JSON schema (dict or JSON text), a regex or a Lark grammar the output must follow, one for
        every row or a list with one per row (None: that row is free). The output is then exactly
        constrained decoding's: the target's tokens masked by the grammar (`grammar.py`). A row ends
        when its grammar is complete; `GenerationOutput.complete` says which rows' outputs are.
    draft_max_rows: a greedy round of more running rows than this drafts nothing (a plain step); 0:
        no greedy round drafts; None: every round drafts. Where a pass costs about in proportion to
        its rows times k + 1 positions (a CPU past a few positions), a rejected draft costs what a kept
        token does and a batch decodes faster plainly. Greedy only, so the output is the same either
        way; a sampled row's tokens then still do not depend on its batch-mates.
    profile: time each part of every round (`profile.PARTS`) into `GenerationStats.profile`.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | Sequence[int] | None = None
    eos_token_id: int | Sequence[int] | None = None
    stop_strings: str | Sequence[str] | None = None
    num_speculations: int | str | Controller | None = None
    drafter: str | DraftPolicy | None = None
    json_schema: dict | str | Sequence[dict | str | None] | None = None
    regex: str | Sequence[str | None] | None = None
    grammar: str | Sequence[str | None] | None = None
    draft_max_rows: int | None = None
    profile: bool = False

    def with_overrides(self, overrides: dict) -> GenerationConfig:
        """A copy with `overrides` (field name -> value) set; a TypeError names a key that is no field,
        as a call with an unknown keyword argument does."""
        unknown = overrides.keys() - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"generate() got an unexpected keyword argument {sorted(unknown)[0]!r} "
                            f"(the fields of GenerationConfig are its keywords)")
        return dataclasses.replace(self, **overrides) if overrides else self
