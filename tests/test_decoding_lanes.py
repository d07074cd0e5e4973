"""`Lanes`: the stepped engine decodes greedy and sampled rows in batches of their own. A seeded sampled row
then gets its text alone whatever greedy rows share the call, under any drafter (with copies too, whose
lengths follow a batch's acceptance), greedy rows keep the greedy path, and the output keeps the caller's
row order with the lanes' statistics together."""

import pytest
import torch
from helpers import low_alpha_model, reference_greedy, step_joining

from selfspec.decoding import DecodeSettings, NewRow, SamplingParams, SelfSpecGenerator
from selfspec.decoding.ngram import NGramConfig

SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (12,), generator=g).tolist() for _ in range(4)]
    return [p + p[:6] for p in prompts]  # a repeat in each: copies find matches


@pytest.fixture(scope="module")
def generator():
    hybrid = DecodeSettings(drafter="hybrid", exit_layer=2, num_speculations=2,
                            ngram=NGramConfig(min_ngram=1, max_ngram=3, max_copy=6))
    return SelfSpecGenerator(low_alpha_model("llama"), settings=hybrid)


def test_a_seeded_sampled_row_keeps_its_text_among_greedy_rows_under_the_hybrid_drafter(generator):
    prompts = _prompts()
    alone = generator.generate([prompts[3]], max_new_tokens=24, temperature=0.9, top_p=0.95, seed=11,
                               eos_token_id=[]).sequences[0]
    rows = [NewRow(p, 24) for p in prompts[:3]] + [NewRow(prompts[3], 24, seed=11, sampling=SAMPLED)]
    # the sampled row starts with the greedy rows; then it joins them after their first step
    for first, schedule in ((rows, {}), (rows[:3], {1: rows[3:]})):
        out, _ = step_joining(generator, first, schedule, eos_token_id=[])
        assert out.sequences[3] == alone
        assert out.sequences[:3] == [reference_greedy(generator.view.model, p, 24) for p in prompts[:3]]
        assert out.stats.generated_tokens == 4 * 24 and out.finish_reasons == ["length"] * 4


def test_each_kind_of_row_decodes_in_its_own_lane_at_its_own_settings(generator):
    """Greedy rows at the generator's settings, sampled rows at the sampled pick nearest the first sampled
    row's temperature; rows keep the caller's numbering, and the statistics count both lanes."""
    prompts = _prompts()
    saved = generator.format_settings
    generator.format_settings = {"sampled@0.8": DecodeSettings(exit_layer=3, num_speculations=3)}
    try:
        engine = generator.engine(eos_token_id=[])
        order = [engine.add(NewRow(prompts[0], 8, seed=1, sampling=SAMPLED)),
                 engine.add(NewRow(prompts[1], 8)),
                 engine.add(NewRow(prompts[2], 8, seed=2, sampling=SamplingParams(temperature=0.3)))]
        assert order == [0, 1, 2]
        assert engine.lane(True).options.settings == generator.format_settings["sampled@0.8"]
        assert engine.lane(False).options.settings == generator.settings
        seen = {}
        while not engine.done:
            for out in engine.step():
                seen.setdefault(out.row, []).extend(out.tokens)
        out = engine.output()
        assert [seen[row] for row in range(3)] == out.sequences and [len(s) for s in out.sequences] == [8] * 3
        assert out.sequences[1] == reference_greedy(generator.view.model, prompts[1], 8)
        assert out.stats.generated_tokens == 24
        assert out.stats.rounds == engine.lane(True).stats.rounds + engine.lane(False).stats.rounds
    finally:
        generator.format_settings = saved


def test_a_cancelled_row_and_its_text_are_found_in_its_lane():
    generator = SelfSpecGenerator(low_alpha_model("llama"), exit_layer=2, num_speculations=2)
    prompts = _prompts()
    engine = generator.engine(eos_token_id=[])
    greedy = engine.add(NewRow(prompts[0], 12))
    sampled = engine.add(NewRow(prompts[1], 12, seed=5, sampling=SAMPLED))
    engine.step()
    engine.cancel(sampled)
    while not engine.done:
        assert all(out.row == greedy for out in engine.step())
    out = engine.output()
    assert out.finish_reasons == ["length", "cancelled"] and len(out.sequences[0]) == 12
    assert 0 < len(out.sequences[1]) < 12


def test_a_refused_request_leaves_no_lane_behind():
    """A request `Engine.add` refuses (no prompt) raises before its lane is kept: the other lane's rows
    decode as if it had never been asked for."""
    from selfspec.errors import UserError

    generator = SelfSpecGenerator(low_alpha_model("llama"), exit_layer=2, num_speculations=2)
    prompt = _prompts()[0]
    engine = generator.engine(eos_token_id=[])
    engine.add(NewRow(prompt, 6))
    with pytest.raises(UserError, match="needs a prompt"):
        engine.add(NewRow([], 6, seed=1, sampling=SAMPLED))
    assert engine.lane(True) is None
    while not engine.done:
        engine.step()
    assert engine.output().sequences == [reference_greedy(generator.view.model, prompt, 6)]
