"""Static passes (`backends.static_passes`, `SelfSpecGenerator(static_passes=...)`): the path for CUDA
graphs, proven on CPU. Every decoding pass runs at fixed shapes (WIDTH rows, every cache slot under a
mask from the positions, keys scattered in place), so greedy output equals plain decoding's for every
Llama family, batch, k, η and drafter, as written ("eager") and captured ("graph": CUDA graphs,
emulated off CUDA); the passes really run (counted); the cache is reused between calls; a model
without them, or the removed "compile" mode, is a one-line error."""

import pytest
import torch
from helpers import low_alpha_model, ranking_counts, reference_greedy, step_joining, tiny_model

from selfspec.backends import static_passes
from selfspec.decoding import DecodeSettings, NewRow, SelfSpecGenerator
from selfspec.decoding.runner import Runner
from selfspec.errors import UserError

NEW = 14
LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # mistral's window of 8 is shorter than the rows
BATCHES = {
    "one": [[5, 17, 33, 2, 71, 8]],
    "ragged": [[5, 17, 33, 2, 71, 8], [40, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19]],
}


@pytest.fixture
def calls(monkeypatch):
    """{method: how many calls ran (returned something)} for StaticPasses' three entry points."""
    counts = {}
    for name in ("run", "verify_greedy", "draft_loop"):
        method = getattr(static_passes.StaticPasses, name)

        def counted(self, *args, _method=method, _name=name, **kwargs):
            out = _method(self, *args, **kwargs)
            counts[_name] = counts.get(_name, 0) + (out is not None)
            return out

        monkeypatch.setattr(static_passes.StaticPasses, name, counted)
    return counts


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("family", LLAMA_FAMILIES)
def test_static_greedy_equals_plain_greedy_for_every_family_batch_k_and_eta(family, mode, calls):
    model = low_alpha_model(family)
    generator = SelfSpecGenerator(model, exit_layer=2, static_passes=mode)
    accepted = 0
    for name, prompts in BATCHES.items():
        expected = [reference_greedy(model, p, NEW) for p in prompts]
        for k in (0, 1, 3, 7):
            for eta in (0.0, 0.02):
                settings = DecodeSettings(exit_layer=2, num_speculations=k, stop_below=eta)
                out = generator.generate(prompts, max_new_tokens=NEW, eos_token_id=[], settings=settings)
                assert out.sequences == expected, (family, name, k, eta)
                accepted += out.stats.early_exit.accepted
    assert accepted > 0  # the drafts were real
    assert calls["draft_loop"] > 0 and calls["verify_greedy"] > 0


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_copies_the_hybrid_and_sampling_run_static_passes_too(family, mode, calls):
    """Copies verify in a whole-model static call; the hybrid's copy after the loop runs its tail through
    blocks [0, E) as a static `run`; sampling's passes are `run`s."""
    model = low_alpha_model(family)
    generator = SelfSpecGenerator(model, exit_layer=2, static_passes=mode)
    prompts = [[5, 17, 33, 5, 17, 33, 5, 17], [9, 9, 4, 9, 9, 4]]  # repeats: copies to find
    expected = [reference_greedy(model, p, NEW) for p in prompts]
    for kwargs in (dict(drafter="ngram", num_speculations=3), dict(drafter="hybrid", num_speculations=4)):
        out = generator.generate(prompts, max_new_tokens=NEW, eos_token_id=[], **kwargs)
        assert out.sequences == expected, kwargs
        assert out.stats.copy.drafted > 0
    sampled = generator.generate(prompts, max_new_tokens=NEW, eos_token_id=[], num_speculations=3,
                                 temperature=0.8, seed=0)
    assert all(len(s) == NEW for s in sampled.sequences)
    assert calls["run"] > 0


def test_rounds_are_capped_to_the_static_width():
    """k beyond WIDTH - 1 drafts would need a wider pass: the round stops at WIDTH - 1."""
    model = tiny_model("llama", num_layers=2)
    generator = SelfSpecGenerator(model, exit_layer=2, static_passes="eager")  # E = N: every draft right
    out = generator.generate([[5, 17, 33]], max_new_tokens=40, eos_token_id=[], num_speculations=24)
    assert out.sequences == [reference_greedy(model, [5, 17, 33], 40)]
    assert len(out.stats.accepted_histogram) == static_passes.WIDTH  # 0 .. WIDTH - 1 accepted


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_bf16_static_speculative_output_equals_static_plain_output(mode):
    """Every pass at WIDTH rows: a position rounds alike in a plain step and in a verification, without
    the fixed width that other bf16 passes need."""
    model = low_alpha_model("llama").to(torch.bfloat16)
    generator = SelfSpecGenerator(model, exit_layer=2, static_passes=mode)
    generator.runner.fixed_width = False
    prompts = BATCHES["ragged"]
    plain = generator.generate(prompts, max_new_tokens=24, eos_token_id=[], num_speculations=0)
    for k in (2, 5):
        out = generator.generate(prompts, max_new_tokens=24, eos_token_id=[], num_speculations=k)
        assert out.sequences == plain.sequences, k
        assert out.stats.early_exit.accepted > 0


def test_the_cache_buffers_are_kept_per_batch_size_and_length_bucket(monkeypatch):
    """Captured passes write fixed addresses: a second call writes the first call's buffers; rows
    joining a running batch get their own."""
    model = low_alpha_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2, static_passes="eager")
    made = []
    cache = Runner.new_cache
    monkeypatch.setattr(Runner, "new_cache", lambda *args: made.append(cache(*args)) or made[-1])
    prompts = BATCHES["one"]
    first = generator.generate(prompts, max_new_tokens=NEW, eos_token_id=[], num_speculations=3)
    again = generator.generate(prompts, max_new_tokens=NEW - 3, eos_token_id=[], num_speculations=3)
    assert again.sequences[0] == first.sequences[0][:NEW - 3]
    assert made[0] is not made[1] and made[0].capacity == made[1].capacity == 256
    assert [k.data_ptr() for k in made[0].keys] == [k.data_ptr() for k in made[1].keys]
    both, _ = step_joining(generator, [NewRow(prompts[0], NEW)], {0: [NewRow(prompts[0], NEW)]},
                           eos_token_id=[], settings=generator.settings.override(num_speculations=3))
    assert both.sequences == [first.sequences[0]] * 2
    assert made[3].keys[0].data_ptr() != made[2].keys[0].data_ptr()  # the joining row's cache is its own


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_two_engines_of_one_generator_decode_side_by_side_each_as_alone(mode):
    """Each engine steps a runner of its own (`Runner.for_engine`) whose pooled buffers no other live
    engine writes: stepped in turn, two decodes of one generator each give their prompt's greedy
    output (they wrote each other's caches when the runner, and its pool, were the generator's)."""
    model = low_alpha_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2, static_passes=mode, num_speculations=3)
    prompts = BATCHES["one"] + BATCHES["ragged"][1:2]
    engines = [generator.engine(eos_token_id=[]) for _ in prompts]
    for engine, prompt in zip(engines, prompts):
        engine.add(NewRow(prompt, NEW))
        engine.start()
    ours = [{k.data_ptr() for k in e.lane(False).b.cache.keys if k is not None} for e in engines]
    assert not ours[0] & ours[1]  # buffers of their own
    while not all(engine.done for engine in engines):
        for engine in engines:
            if not engine.done:
                engine.step()
    assert [e.output().sequences[0] for e in engines] == [reference_greedy(model, p, NEW) for p in prompts]


def test_families_without_static_passes_and_bad_modes_are_user_errors():
    with pytest.raises(UserError, match="Llama-family"):
        SelfSpecGenerator(tiny_model("gpt2"), exit_layer=2, static_passes="eager")
    with pytest.raises(UserError, match="static_passes must be one of eager, graph"):
        SelfSpecGenerator(tiny_model("llama"), exit_layer=2, static_passes="graphs")
    with pytest.raises(UserError, match="'compile' was removed: torch.compile left the passes uncaptured"):
        SelfSpecGenerator(tiny_model("llama"), exit_layer=2, static_passes="compile")
    plain = SelfSpecGenerator(tiny_model("gpt2"), exit_layer=2)  # unset: every family as before
    assert plain.static_passes is None




@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_trimmed_heads_tie_goes_to_the_lowest_token_id_as_everywhere(mode):
    """Two tokens with the same head row always tie, the higher id the more frequent (first in the trimmed
    head's frequency order): the draft takes the lowest id, as argmax over the whole vocabulary, the
    engine's backend and the compiled loop do, so its drafts are the target's and are accepted."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight[5] *= 50
        model.lm_head.weight[7] = model.lm_head.weight[5]  # 5 and 7 lead every position, tied
    counts = ranking_counts([7, 5, *range(8, 40)], 96)  # 7 ranked before 5
    stats = {}
    for backend in (None, mode):
        generator = SelfSpecGenerator(model, exit_layer=2, draft_vocab_size=34, token_counts=counts,
                                      static_passes=backend)
        out = generator.generate([[1, 2, 3]], max_new_tokens=NEW, num_speculations=3, eos_token_id=[])
        assert out.sequences == [[5] * NEW]
        stats[backend] = (out.stats.early_exit.drafted, out.stats.early_exit.accepted)
    assert stats[mode] == stats[None] and stats[None][1] > 0, stats
