"""Continuous batching (`Engine.add` between steps): rows that join a running call at a round boundary
decode exactly what they decode alone, and the rows already running are not disturbed, for every
drafter, rows at any positions, a cache that must grow, a batch that emptied before they came, and
rows under a grammar."""

import numpy as np
import pytest
import torch
from helpers import FAMILIES, low_alpha_model, reference_greedy, step_joining, streamed

from selfspec.decoding import DecodeSettings, NewRow, SamplingParams, SelfSpecGenerator
from selfspec.errors import UserError

NEW = 12
FIRST = [[5, 17, 33, 2, 71, 8], [40, 3]]
LATER = {2: [NewRow([11, 12, 13, 14, 15, 16, 17, 18, 19], NEW)],  # before round 2: a longer prompt
         5: [NewRow([7, 7], 3), NewRow([60, 61, 62, 1, 2, 3, 4], 2 * NEW)]}  # its limit grows the cache
SETTINGS = {"plain": DecodeSettings(num_speculations=0),
            "early_exit": DecodeSettings(exit_layer=2, num_speculations=3),
            "ngram": DecodeSettings(drafter="ngram"),
            "hybrid": DecodeSettings(drafter="hybrid", exit_layer=1, num_speculations=2)}




def _rows(prompts, max_new_tokens, seeds=None):
    return [NewRow(p, max_new_tokens, None if seeds is None else seeds[i]) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_joining_at_round_boundaries_decode_what_they_decode_alone(family):
    model = low_alpha_model(family)
    generator = SelfSpecGenerator(model, exit_layer=2)  # checks every row's cache after every round
    later = [row for rows in LATER.values() for row in rows]
    expected = ([reference_greedy(model, p, NEW) for p in FIRST]
                + [reference_greedy(model, r.prompt, r.max_new_tokens) for r in later])
    for name, settings in SETTINGS.items():
        out, steps = step_joining(generator, _rows(FIRST, NEW), LATER, settings=settings, eos_token_id=[])
        assert out.sequences == expected, (family, name)
        seen = streamed(steps)
        assert [seen[row] for row in range(len(expected))] == expected  # streamed under their own rows
        assert len(steps) > max(LATER)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_a_row_joins_a_lone_row_that_runs_several_rounds_a_call(family):
    """With `rounds_per_step` a lone row runs several rounds in one compiled call a step; a row added
    before the next step joins, and both decode what they decode alone."""
    model = low_alpha_model(family)
    generator = SelfSpecGenerator(model, exit_layer=2)
    prompt, later = [5, 17, 33, 5, 17, 33, 8, 5, 17], NewRow([40, 3, 9], NEW)
    expected = [reference_greedy(model, prompt, 3 * NEW), reference_greedy(model, later.prompt, NEW)]
    for name in ("early_exit", "ngram"):
        out, steps = step_joining(generator, _rows([prompt], 3 * NEW), {3: [later]}, settings=SETTINGS[name],
                                  eos_token_id=[], rounds_per_step=8)
        assert out.sequences == expected, (family, name)
        seen = {}
        for outputs in steps:
            for o in outputs:
                seen.setdefault(o.row, []).append(o.rounds)
        assert seen[0][0] == seen[1][0] == 1  # a row's first round alone
        assert (max(seen[0]) > 1) == (family != "gpt2"), (family, name)  # GPT-2: no compiled rounds


def test_a_row_may_join_after_every_other_row_finished():
    """A row added after the last running row ended decodes at the next step; the engine is done when
    none is added."""
    model = low_alpha_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2)
    late = NewRow([9, 8, 7, 6], NEW)
    first = reference_greedy(model, FIRST[0], 2)  # 2 rounds at k = 0: steps 0 and 1
    plain = DecodeSettings(exit_layer=2, num_speculations=0)
    out, _ = step_joining(generator, _rows([FIRST[0]], 2), {2: [late]}, settings=plain, eos_token_id=[])
    assert out.sequences == [first, reference_greedy(model, late.prompt, NEW)]
    out, steps = step_joining(generator, _rows([FIRST[0]], 2), {3: [late]}, settings=plain, eos_token_id=[])
    assert out.sequences == [first] and len(steps) == 2


def test_a_seeded_sampled_row_draws_the_same_tokens_whenever_it_joins():
    model = low_alpha_model("qwen2")
    generator = SelfSpecGenerator(model, exit_layer=2)
    row = NewRow([3, 1, 4, 1, 5], NEW, seed=1234)
    alone = generator.generate([row.prompt], max_new_tokens=NEW, temperature=0.9, seed=[1234],
                               eos_token_id=[], num_speculations=2)
    for start in (0, 1, 4):
        out, _ = step_joining(generator, _rows(FIRST, NEW, seeds=[7, 8]), {start: [row]},
                              sampling=SamplingParams(temperature=0.9),
                              eos_token_id=[], settings=DecodeSettings(exit_layer=2, num_speculations=2))
        assert out.sequences[2] == alone.sequences[0], start


@pytest.mark.parametrize("name", ["early_exit", "ngram", "hybrid"])
def test_a_batch_over_draft_max_rows_takes_plain_steps_and_decodes_the_same(name):
    """`draft_max_rows`: rounds of more running rows than it draft nothing, the others draft as before;
    greedy output is the same either way. Two rows start, a third joins before round 2 (three run),
    two more before round 5 (rows end at different lengths, so the batch shrinks again)."""
    model = low_alpha_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2)
    prompts = [[5, 17, 33, 5, 17, 33, 2, 5, 17], [40, 3, 40, 3, 40]]
    later = [row for rows in LATER.values() for row in rows]
    expected = ([reference_greedy(model, p, NEW) for p in prompts]
                + [reference_greedy(model, r.prompt, r.max_new_tokens) for r in later])
    out, steps = step_joining(generator, _rows(prompts, NEW), LATER, settings=SETTINGS[name], eos_token_id=[],
                              draft_max_rows=2)
    assert out.sequences == expected
    # (running rows, drafts verified in the round, summed over its rows)
    rounds = [(len(outputs), sum(o.drafted for o in outputs)) for outputs in steps]
    assert all(drafted == 0 for running, drafted in rounds if running > 2), rounds
    assert sum(drafted for running, drafted in rounds if running <= 2) > 0, rounds
    assert max(running for running, _ in rounds) > 2
    assert out.stats.plain_steps >= sum(running > 2 for running, _ in rounds)


def test_draft_max_rows_leaves_sampled_rounds_drafting():
    """A sampled row's tokens must not depend on its batch-mates, and a plain step draws other numbers
    than a round: sampled batches draft whatever their size."""
    model = low_alpha_model("qwen2")
    generator = SelfSpecGenerator(model, exit_layer=2)
    kwargs = dict(max_new_tokens=NEW, temperature=0.9, seed=[7, 8, 9], eos_token_id=[], num_speculations=2)
    out = generator.generate(FIRST + [[1, 2, 3]], draft_max_rows=1, **kwargs)
    assert out.stats.draft_steps > 0
    assert out.sequences == generator.generate(FIRST + [[1, 2, 3]], **kwargs).sequences


def test_rows_under_a_grammar_join_any_call_and_bad_rows_are_refused():
    from test_decoding_grammar import PERSON, constrained_reference, make_model, prompt_ids

    from selfspec.data import train_tokenizer
    from selfspec.decoding.grammar import Constraint

    pytest.importorskip("llguidance")
    tokenizer = _json_tokenizer(train_tokenizer)
    model = make_model("llama", tokenizer)
    generator = SelfSpecGenerator(model, tokenizer, exit_layer=2)
    prompt = prompt_ids(tokenizer)
    constraint = Constraint.of(json_schema=PERSON)
    expected, _ = constrained_reference(model, tokenizer, prompt, constraint, 40)
    joining = {2: [NewRow(prompt, 40, constraint=constraint), NewRow(prompt[:5], 6)]}
    settings = DecodeSettings(exit_layer=2, num_speculations=3)
    out, _ = step_joining(generator, [NewRow(prompt, 40, constraint=constraint)], joining, settings=settings,
                          eos_token_id=[], structured=True)
    assert out.sequences[0] == out.sequences[1] == expected
    assert out.complete[:2] == [True, True] and out.complete[2] is True  # the free row: no grammar to finish
    free = generator.generate([prompt[:5]], max_new_tokens=6, eos_token_id=[], num_speculations=3)
    assert out.sequences[2] == free.sequences[0]

    # a constrained row joins a call that started without a grammar (which it opens), at the default
    # adaptive k: the exit's α counts its own drafts only, not the grammar's forced tokens
    out, _ = step_joining(SelfSpecGenerator(model, tokenizer, exit_layer=2), _rows([prompt[:5]], 6),
                          {0: [NewRow(prompt, 40, constraint=constraint)]}, eos_token_id=[])
    assert out.sequences == [free.sequences[0], expected] and out.complete == [True, True]
    for bad in (NewRow([], 5), NewRow(prompt, 0)):
        with pytest.raises(UserError, match="needs a prompt and max_new_tokens"):
            step_joining(generator, _rows([prompt], 5), {1: [bad]})


def _json_tokenizer(train_tokenizer):
    """The byte-level tokenizer the grammar tests train (stdlib code and JSON)."""
    import sysconfig
    import tempfile
    from pathlib import Path

    from test_decoding_grammar import _json_examples

    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [(root / name).read_text()[:20000] for name in ("json/encoder.py", "textwrap.py")]
    return train_tokenizer(texts + _json_examples(), Path(tempfile.mkdtemp()), vocab_size=400)


def test_the_cache_grows_its_slots_for_rows_that_need_more():
    from selfspec.decoding import KVCache

    small, large = KVCache(2, 2, 8), KVCache(2, 1, 20)
    for cache, rows, fill in ((small, 2, 1.0), (large, 1, 2.0)):
        cache.set_positions(torch.arange(3).expand(rows, 3), [0] * rows)
        cache.update(torch.full((rows, 1, 3, 4), fill), torch.full((rows, 1, 3, 4), -fill), 0)
        cache.written(1, 2)  # layer 1 claims the positions without buffers: never written
    small.add_rows(large)
    assert small.capacity == 20 and small.batch_size == 3 and small.keys[0].shape == (3, 1, 20, 4)
    assert small.keys[0][:2, :, :3].eq(1).all() and small.keys[0][2, :, :3].eq(2).all()
    assert small.keys[0][:, :, 3:].eq(0).all() and small.keys[1] is None
    assert np.array_equal(small.lengths[0], [3, 3, 3])
