"""Long-context picks (`ContextSwitch`): a greedy decode at the generator's own settings switches to the
settings stored under "context@T" once its longest context reaches T tokens, in compiled calls and rounds
from Python alike, and keeps plain greedy's tokens; sampled rows, a call's own settings and constrained
calls never switch."""

import pytest
from helpers import kernels_unavailable, low_alpha_model, reference_greedy

from selfspec.decoding import (
    DecodeSettings,
    NewRow,
    SamplingParams,
    SelfSpecGenerator,
    context_key,
    context_picks,
)
from selfspec.decoding.ngram import NGramConfig
from selfspec.model import kernels

SHORT = DecodeSettings(exit_layer=1, num_speculations=3)  # a fixed k: a compiled call could run to the end
HYBRID = DecodeSettings(drafter="hybrid", exit_layer=1, num_speculations="auto",
                        ngram=NGramConfig(min_ngram=1, max_ngram=3, max_copy=6))
LONG = DecodeSettings(exit_layer=3, num_speculations=1)
PROMPTS = [[(5 * i + 3) % 96 for i in range(12)], [(7 * i + 1) % 96 for i in range(20)]]


@pytest.fixture(scope="module")
def model():
    return low_alpha_model("llama")


def _generator(model, backend: str, settings=SHORT, switches=((24, LONG),)) -> SelfSpecGenerator:
    if backend == "cpu_kernels" and kernels.extension() is None:
        kernels_unavailable()
    static = dict(static_passes="eager") if backend == "static" else dict(backend=backend)
    formats = {context_key(at): s for at, s in switches}
    return SelfSpecGenerator(model, settings=settings, format_settings=formats, **static)


def test_the_stored_picks_are_found_by_their_context():
    keys = [context_key(256), "sampled@0.8", "json_schema", "context@x", "context@0", context_key(64)]
    assert context_picks(keys) == [(64, "context@64"), (256, "context@256")]
    assert context_picks(["sampled@0.3"]) == []


@pytest.mark.parametrize("backend", ["reference", "cpu_kernels", "static"])
@pytest.mark.parametrize("settings", [SHORT, HYBRID], ids=["early_exit", "hybrid"])
def test_a_greedy_decode_switches_once_its_context_reaches_the_pick_and_keeps_plain_tokens(model, backend,
                                                                                           settings):
    """A 12-token prompt and 40 new tokens pass 24 tokens of context: the rounds before draft at the
    generator's k, those after at the pick's k = 1 and E = 3 (on the CPU kernels a fixed k's compiled call
    stops short of the switch, where it would otherwise run to the row's end)."""
    generator = _generator(model, backend, settings)
    out = generator.generate([PROMPTS[0]], max_new_tokens=40, eos_token_id=[])
    assert out.sequences[0] == reference_greedy(model, PROMPTS[0], 40)
    assert out.stats.exit_layer == 3
    before = generator.generate([PROMPTS[0]], max_new_tokens=8, eos_token_id=[])  # 20 tokens: no switch
    assert before.stats.exit_layer == 1
    if settings is SHORT:  # k = 3 (maybe cut at the row's end) until the switch, then k = 1
        assert before.stats.k_rounds.keys() <= {3, 2, 1, 0} and 3 in before.stats.k_rounds
        assert 3 in out.stats.k_rounds and out.stats.k_rounds[1] >= 5


def test_a_batch_switches_when_its_longest_row_reaches_the_pick(model):
    """Two switches (16 and 30 tokens); each step drafts at the last one the batch's longest context has
    reached, and the rows keep plain greedy's tokens."""
    generator = _generator(model, "reference", HYBRID,
                           switches=((16, DecodeSettings(exit_layer=2, num_speculations=2)), (30, LONG)))
    engine = generator.engine(eos_token_id=[])
    for prompt in PROMPTS:
        engine.add(NewRow(prompt, 24))
    engine.start()
    lane, longest, used = engine.lane(False), [], []
    while not engine.done:
        longest.append(int(lane.b.lengths.max()))  # the longer prompt starts at 19 positions
        engine.step()
        used.append(lane.b.drafting.exit_layer)  # the step's drafting: it switches before its round
    assert used == [2 if n < 30 else 3 for n in longest] and used[0] == 2 and used[-1] == 3
    out = engine.output()
    assert out.sequences == [reference_greedy(model, p, 24) for p in PROMPTS]


@pytest.mark.parametrize("backend", ["reference", "cpu_kernels"])
def test_sampled_rows_and_a_calls_own_settings_never_switch(model, backend):
    """A seeded sampled row draws what it draws without the pick (its drafts depend on it alone); a call
    that names its settings, drafter or k decodes at them throughout; so does a constrained call."""
    generator = _generator(model, backend)
    bare = _generator(model, backend, switches=())
    sampled = dict(max_new_tokens=40, temperature=0.9, seed=5, eos_token_id=[])
    out = generator.generate([PROMPTS[0]], **sampled)
    assert out.sequences == bare.generate([PROMPTS[0]], **sampled).sequences
    assert out.stats.exit_layer == 1 and 1 not in out.stats.k_rounds
    for own in (dict(settings=SHORT), dict(num_speculations=3), dict(drafter="early_exit")):
        out = generator.generate([PROMPTS[0]], max_new_tokens=40, eos_token_id=[], **own)
        assert out.stats.exit_layer == 1 and 1 not in out.stats.k_rounds, own
    engine = generator.engine(eos_token_id=[], sampling=SamplingParams(temperature=0.9))
    engine.add(NewRow(PROMPTS[0], 40, seed=5))
    while not engine.done:
        engine.step()
    assert engine.output().sequences == bare.generate([PROMPTS[0]], **sampled).sequences
