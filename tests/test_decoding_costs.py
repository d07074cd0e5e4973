"""The round's costs by context length (`RoundCosts`) and the gate that drafts only where it pays
(`CostGate`), alone and through `generate`: under costs at which no draft can pay, every drafter
falls back to plain steps (and probes again now and then), output unchanged; under cheap costs
nothing changes; a long context that makes drafting too dear switches it off there only."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import reference_greedy, tiny_model

from selfspec.decoding import CostGate, DecodeSettings, RoundCosts, SelfSpecGenerator
from selfspec.errors import UserError

CHEAP = RoundCosts((1,), (0.01,), (0.0,), exit_layer=2)
DEAR = RoundCosts((1,), (2.0,), (1.0,), exit_layer=2)  # a draft costs 2 plain steps, a drafted position 1


def test_round_costs_interpolate_between_lengths_and_extrapolate_past_them():
    costs = RoundCosts((64, 1024), (0.3, 0.5), (0.0, 0.2), exit_layer=3)
    assert costs.at(64) == pytest.approx((0.3, 0.0))
    assert costs.at(544) == pytest.approx((0.4, 0.1))
    assert costs.at(2048) == pytest.approx((0.3 + 0.2 * 1984 / 960, 0.2 * 1984 / 960))
    assert costs.at(1) == pytest.approx((0.3 - 0.2 * 63 / 960, 0.0))  # below 0 clipped
    assert RoundCosts.from_json(costs.to_json()) == costs
    assert costs.applies_to(3, 0) and not costs.applies_to(3, 512) and not costs.applies_to(4, 0)
    # a round of 2 drafts at 64: 2·0.3 + 1 + 0 plain steps; copies make theirs for nothing
    assert costs.round_costs(2, 64) == pytest.approx([1.0, 1.3, 1.6])
    assert costs.round_costs(2, 64, drafted=False) == pytest.approx([1.0, 1.0, 1.0])


def test_measured_rounds_price_each_k_by_its_own_round_and_past_them_a_step_more_each():
    """A round of j drafts as measured (`RoundCosts.rounds`), not k·c + 1 + k·s: 1 and 2 drafts measured
    at two lengths (interpolated between), 3 drafts the 2-draft round plus a draft step and a position;
    copies (no draft loop) and plain steps as before."""
    costs = RoundCosts((64, 1024), (0.3, 0.5), (0.0, 0.2), exit_layer=3, rounds=((1.4, 1.6), (1.6, 2.2)))
    assert costs.round_costs(0, 64)[0] == 1.0 and costs.round_costs(1, 64)[1] == pytest.approx(1.4)
    assert costs.round_costs(2, 544)[2] == pytest.approx(1.9)  # halfway between 1.6 and 2.2
    assert costs.round_costs(3, 64)[3] == pytest.approx(1.6 + 0.3 + 0.0)
    assert costs.round_costs(2, 64, drafted=False)[2] == pytest.approx(1.0)  # copies: 1 + 2·s
    assert RoundCosts.from_json(costs.to_json()) == costs
    # past the measured lengths a falling segment would go below a plain step: a round costs at least one
    falling = RoundCosts((64, 128), (0.3, 0.3), (0.0, 0.0), exit_layer=3, rounds=((1.4,), (1.2,)))
    assert falling.round_costs(1, 10_000) == [1.0, 1.0]
    # the gate's choice follows: at α = 5 / 8 one draft (1.625 / 1.4 = 1.161) beats two (2.016 / 1.8 =
    # 1.120) where the linear costs price two higher (1.625 / 1.3 = 1.250 against 2.016 / 1.6 = 1.260)
    for rounds, k in (((1.4, 1.8),) * 2, 1), ((), 2):
        gate = CostGate(dataclasses.replace(costs, rounds=rounds), min_tested=1)
        gate.record({"early_exit": (2, np.array([2, 0, 1, 2, 0]))})
        assert gate.alpha("early_exit") == 5 / 8 and gate.k("early_exit", 2, 64) == k, rounds


def test_copies_are_priced_by_their_own_measured_rounds_where_measured():
    """Copies' positions run every block: rounds of 1, 4 and 10 copies measured at two lengths price 1..10
    copies (interpolated in the length, then in the count, along the last segment past it), not 1 + k·s.
    With them, an α at which the early exit's s says copies pay cuts them to plain steps."""
    linear = RoundCosts((64, 1024), (0.3, 0.5), (0.05, 0.05), exit_layer=3)
    costs = dataclasses.replace(linear, copy_lengths=(1, 4, 10),
                                copy_rounds=((1.5, 2.1, 3.0), (1.7, 2.3, 3.8)))
    assert costs.round_costs(10, 64, drafted=False) == pytest.approx(
        [1.0, 1.5, 1.7, 1.9, 2.1, 2.25, 2.4, 2.55, 2.7, 2.85, 3.0])
    assert costs.round_costs(4, 544, drafted=False)[4] == pytest.approx(2.2)  # halfway between 2.1 and 2.3
    assert costs.round_costs(12, 64, drafted=False)[12] == pytest.approx(3.3)  # past 10: 0.15 a copy
    assert costs.round_costs(2, 64) == linear.round_costs(2, 64)  # the early exit's rounds as before
    assert RoundCosts.from_json(costs.to_json()) == costs
    one = dataclasses.replace(linear, copy_lengths=(4,), copy_rounds=((1.8,), (2.0,)))
    assert one.round_costs(2, 64, drafted=False) == pytest.approx([1.0, 1.2, 1.4])
    # noise that makes more copies measure cheaper never prices long copies as free: a copy more costs
    # at least as much (a running maximum), and past the last count at least as much as it
    noisy = dataclasses.replace(linear, copy_lengths=(1, 2), copy_rounds=((1.5, 1.2), (1.5, 1.2)))
    assert noisy.round_costs(4, 64, drafted=False) == pytest.approx([1.0, 1.5, 1.5, 1.5, 1.5])
    # α = 0.4: 2 copies yield 1.56 tokens, at 1 + 2·0.05 = 1.1 steps the best k (1.418 tokens a step); at
    # the measured rounds no k pays (1 copy: 1.4 / 1.5, 2: 1.56 / 1.7, 4: 1.6496 / 2.1)
    for priced, k in ((linear, 2), (costs, 0)):
        gate = CostGate(priced, min_tested=1)
        gate.record({"copy": (5, np.array([2, 0, 0]))})
        assert gate.alpha("copy") == pytest.approx(2 / 5) and gate.k("copy", 4, 64) == k


@pytest.mark.parametrize("entry", [{"lengths": [64], "draft": [0.3]}, {"lengths": [64, 32], "draft": [1, 1],
                                    "verify_slope": [0, 0], "exit_layer": 1}, {"lengths": "x"},
                                   {"lengths": [64], "draft": [0.3], "verify_slope": [0], "exit_layer": 1,
                                    "rounds": [[1.4], [1.6]]},
                                   {"lengths": [64], "draft": [0.3], "verify_slope": [0], "exit_layer": 1,
                                    "rounds": [[0.0]]},
                                   {"lengths": [64], "draft": [0.3], "verify_slope": [0], "exit_layer": 1,
                                    "copy_lengths": [1, 4], "copy_rounds": [[1.2]]},
                                   {"lengths": [64], "draft": [0.3], "verify_slope": [0], "exit_layer": 1,
                                    "copy_lengths": [4, 1], "copy_rounds": [[1.2, 1.1]]},
                                   {"lengths": [64], "draft": [0.3], "verify_slope": [0], "exit_layer": 1,
                                    "copy_rounds": [[1.2]]},
                                   *({"lengths": [64], "draft": [0.3], "verify_slope": [0], "exit_layer": 1,
                                      "copy_lengths": lengths, "copy_rounds": rounds}
                                     for lengths, rounds in (([1], [[float("nan")]]), ([1], [[0.0]]),
                                                             ("12", [[1, 1]]), ([1.7], [[1.2]]), ([1], "1"),
                                                             ([0], [[1.2]])))])
def test_malformed_round_costs_are_one_line_errors(entry):
    with pytest.raises(UserError, match="round_costs"):
        RoundCosts.from_json(entry)


def test_a_copy_round_is_priced_by_the_same_runs_plain_steps_where_it_had_some():
    """`_copy_round`: a copy run's drafted rounds (draft + verify time) over a plain step, the run's own
    plain steps where it had any (both sides in the same seconds), else the plain run's; None where no
    round copied; never below a plain step."""
    from types import SimpleNamespace

    from selfspec.evaluation.context_costs import _copy_round

    plain = SimpleNamespace(plain_time=2.0, plain_steps=4)  # 0.5 s a step
    run = SimpleNamespace(rounds=6, plain_steps=2, plain_time=0.4, draft_time=0.2, verify_time=1.0)
    assert _copy_round(run, plain) == pytest.approx((1.2 / 4) / 0.2)  # its own steps: 0.2 s each
    alone = SimpleNamespace(rounds=4, plain_steps=0, plain_time=0.0, draft_time=0.2, verify_time=3.8)
    assert _copy_round(alone, plain) == pytest.approx(2.0)  # 1 s a round over the plain run's 0.5 s a step
    assert _copy_round(SimpleNamespace(rounds=3, plain_steps=3, plain_time=0.6, draft_time=0.0,
                                       verify_time=0.0), plain) is None
    cheap = SimpleNamespace(rounds=2, plain_steps=1, plain_time=1.0, draft_time=0.0, verify_time=0.1)
    assert _copy_round(cheap, plain) == 1.0


def test_the_gate_drafts_until_it_knows_alpha_then_stops_where_drafts_cannot_pay_and_probes_again():
    gate = CostGate(DEAR, min_tested=4, probe_every=3)
    assert gate.k("early_exit", 3, 100) == 3  # no α yet: the controller's k
    gate.record({"early_exit": (3, np.array([3, 3]))})  # every draft accepted: 6 of 6
    assert gate.alpha("early_exit") == 1.0
    # even at α = 1: 4 tokens for 3·2 + 1 + 3 = 10 plain steps' time
    assert gate.k("early_exit", 3, 100) == 0
    for _ in range(2):
        gate.record({})
        assert gate.k("early_exit", 3, 100) == 0
    gate.record({})
    assert gate.k("early_exit", 3, 100) == 3  # the probe
    gate.record({"early_exit": (3, np.array([0]))})
    assert gate.k("early_exit", 3, 100) == 0
    # copies cost no draft step, but each copied position still costs a plain step here
    gate.record({"copy": (4, np.array([4, 4]))})
    assert gate.k("copy", 4, 100) == 0
    # each source probes after its own idle rounds: the early exit drafting keeps no copy from a probe
    for _ in range(3):
        gate.record({"early_exit": (1, np.array([1]))})
    assert gate.k("copy", 4, 100) == 4 and gate.probing
    # a probe not taken (no copy matched) is offered again only after another 3 rounds
    gate.record({"early_exit": (1, np.array([1]))})
    assert gate.k("copy", 4, 100) == 0 and not gate.probing
    cheap = CostGate(CHEAP, min_tested=1)
    cheap.record({"early_exit": (2, np.array([1]))})  # α = 1/2
    assert cheap.k("early_exit", 4, 100) == 4


def test_the_gate_says_how_many_rounds_a_call_may_run_before_a_cut_source_is_due_its_probe():
    """`CostGate.rounds_to_probe`: None while no source was cut to no drafts, else the rounds left until
    the cut source's probe (`probe_every` idle rounds), at least 1; a k that drafts again clears it."""
    gate = CostGate(DEAR, min_tested=4, probe_every=5)
    assert gate.k("early_exit", 3, 100) == 3 and gate.rounds_to_probe() is None  # α not known: no cut
    gate.record({"early_exit": (3, np.array([3, 3]))})
    assert gate.k("early_exit", 3, 100) == 0 and gate.rounds_to_probe() == 5
    for left in (4, 3, 2, 1):
        gate.record({})
        assert gate.k("early_exit", 3, 100) == 0 and gate.rounds_to_probe() == left
    gate.record({})
    assert gate.k("early_exit", 3, 100) == 3 and gate.rounds_to_probe() is None  # the probe itself


@pytest.mark.parametrize("backend", ["reference", "cpu_kernels"])
def test_a_cut_row_probes_on_time_in_compiled_calls_too(backend, monkeypatch):
    """Plain steps after a cut last `probe_every` rounds (16), then a round drafts again: a compiled call
    of plain steps ends at the probe (`DraftPolicy.rounds_cap`). A call of `GATED_ROUNDS` (32) read its
    17th round as a probe refused and counted the idle rounds again from 0, so the row drafted again only
    where a call happened to end on a due probe (84 plain rounds in a row here)."""
    model = tiny_model("llama", num_layers=4)
    drafted = []
    record = CostGate.record
    monkeypatch.setattr(CostGate, "record", lambda gate, drafts: (
        drafted.append(drafts.get("early_exit", (0,))[0] > 0), record(gate, drafts))[1])
    generator = SelfSpecGenerator(model, settings=DecodeSettings(drafter="early_exit", exit_layer=2,
                                                                 num_speculations=3), backend=backend)
    calls = []  # each compiled call's (k, max_rounds)
    rounds = generator.backend.greedy_rounds
    generator.backend.greedy_rounds = lambda *args, **kwargs: (
        calls.append((args[3].k, args[6])) or rounds(*args, **kwargs))
    generator.round_costs = DEAR
    prompt = [5, 6, 7, 8] * 6
    out = generator.generate([prompt], max_new_tokens=100, eos_token_id=[])
    assert out.sequences[0] == reference_greedy(model, prompt, 100)
    runs = "".join("d" if d else "." for d in drafted).split("d")
    assert max(len(r) for r in runs) == 16 and sum(len(r) == 16 for r in runs) >= 3, drafted
    if backend == "cpu_kernels":  # the rounds ran in compiled calls: the plain ones end at the probe
        assert (0, 16) in calls and all(most <= 16 for k, most in calls if k == 0), calls


def test_a_call_that_still_learns_one_sources_alpha_ends_at_the_other_sources_probe():
    """A hybrid whose early exit is cut while a copy has tested a few drafts (the gate still learns the
    copies' α: calls of `LEARN_ROUNDS`) still ends its call where the early exit's probe is due."""
    from selfspec.decoding.ngram import NGramConfig
    from selfspec.decoding.policy import LEARN_ROUNDS, make_policy

    gate = CostGate(DEAR, min_tested=4, probe_every=16)
    policy = make_policy("hybrid", 3, NGramConfig(), gate)
    policy.start([[5, 6, 7, 8] * 6])
    gate.record({"early_exit": (3, np.array([3, 3]))})  # α known: no draft of the exit pays
    gate.record({"copy": (3, np.array([0]))})  # one copy tested: the copies' α still unknown
    for _ in range(11):
        gate.record({})
    assert policy.fused_drafts(0).k == 0 and gate.learning(policy.sources)
    assert policy.rounds_cap([0]) == 16 - gate.idle["early_exit"] < LEARN_ROUNDS


def test_the_gate_learns_its_first_alpha_from_a_sources_first_drafts_and_not_from_a_silent_one():
    """`CostGate.learning` (a gated call's first rounds run alone for it): until `min_tested` rounds
    passed with nothing tested, or while a source has tested a few drafts but fewer than `min_tested`."""
    gate = CostGate(DEAR, min_tested=4)
    assert gate.learning(("early_exit", "copy"))
    for _ in range(4):  # no copy matched, no draft made: nothing to wait for
        gate.record({})
    assert not gate.learning(("early_exit", "copy"))
    gate.record({"copy": (3, np.array([1]))})  # 2 tested: α not known yet
    assert gate.learning(("early_exit", "copy")) and not gate.learning(("early_exit",))
    gate.record({"copy": (3, np.array([3]))})
    assert not gate.learning(("early_exit", "copy"))


def test_the_gate_leaves_an_exit_it_has_no_draft_costs_for_alone():
    gate = CostGate(DEAR, gates_early_exit=False, min_tested=1)
    gate.record({"early_exit": (3, np.array([3])), "copy": (2, np.array([2]))})
    assert gate.k("early_exit", 3, 100) == 3 and gate.k("copy", 2, 100) == 0


@pytest.mark.parametrize("drafter", ["early_exit", "ngram", "hybrid"])
@pytest.mark.parametrize("backend", ["reference", "cpu_kernels"])
def test_drafting_falls_back_to_plain_steps_where_it_cannot_pay_and_the_output_is_unchanged(drafter, backend):
    model = tiny_model("llama", num_layers=4)
    prompt = [5, 6, 7, 8] * 6  # a repeat: copies find matches
    settings = DecodeSettings(drafter=drafter, exit_layer=2, num_speculations=3)
    expected = reference_greedy(model, prompt, 80)
    counts = {}
    for name, costs in (("none", None), ("cheap", CHEAP), ("dear", DEAR)):
        generator = SelfSpecGenerator(model, settings=settings, backend=backend)
        generator.round_costs = costs
        out = generator.generate([prompt], max_new_tokens=80, eos_token_id=[])
        assert out.sequences[0] == expected, name
        counts[name] = (out.stats.rounds, out.stats.plain_steps, out.stats.drafted)
    # drafts until α is known and at each probe (a compiled call's rounds: up to 8), plain steps otherwise
    rounds, plain, drafted = counts["dear"]
    assert plain >= rounds / 2 and plain > counts["none"][1] and drafted < counts["none"][2], counts
    if drafter == "early_exit":  # a gate that never cuts leaves a fixed k's rounds as they were (an
        # adaptive copy length may change at other rounds: compiled calls end where the gate reads counts)
        assert counts["cheap"] == counts["none"], counts


def test_a_long_context_switches_drafting_off_where_its_costs_say_so_only():
    """Costs that grow with the context: free up to 100 tokens, past any α's reach by 300; a short
    prompt drafts throughout, a long one decodes plainly after the first rounds."""
    model = tiny_model("llama", num_layers=4, max_position_embeddings=512)
    costs = RoundCosts((16, 100, 300), (0.0, 0.0, 1.5), (0.0, 0.0, 0.6), exit_layer=2)
    generator = SelfSpecGenerator(model, settings=DecodeSettings(drafter="early_exit", exit_layer=2,
                                                                 num_speculations=2))
    generator.round_costs = costs
    rng = np.random.default_rng(0)
    short, long = rng.integers(0, 96, 12).tolist(), rng.integers(0, 96, 380).tolist()
    for prompt, plain_share in ((short, 0.0), (long, 0.6)):
        out = generator.generate([prompt], max_new_tokens=48, eos_token_id=[])
        assert out.sequences[0] == reference_greedy(model, prompt, 48)
        share = out.stats.plain_steps / out.stats.rounds
        assert (share == 0.0) if plain_share == 0.0 else share >= plain_share, (len(prompt), share)


def test_rounds_overlap_only_where_the_measured_gain_says_so():
    """An overlapped round's speed over a plain round's, by length: overlap where it is at least 1 (and
    where nothing was measured), not where the context's passes slow each other down."""
    costs = RoundCosts((64, 2000), (0.3, 0.4), (0.0, 0.1), exit_layer=2, overlap_gain=(1.2, 0.9))
    assert costs.overlap_pays(64) and costs.overlap_pays(800) and not costs.overlap_pays(2000)
    assert RoundCosts.from_json(costs.to_json()) == costs
    assert RoundCosts((64,), (0.3,), (0.0,), exit_layer=2).overlap_pays(10**6)
    with pytest.raises(UserError, match="overlap_gain"):
        RoundCosts((64, 128), (0.3, 0.3), (0.0, 0.0), exit_layer=2, overlap_gain=(1.0,))

    model = tiny_model("llama", num_layers=4, max_position_embeddings=512)
    generator = SelfSpecGenerator(model, settings=DecodeSettings(drafter="early_exit", exit_layer=2,
                                                                 num_speculations=2, overlap=True),
                                  backend="cpu_kernels")
    asked = []
    rounds = generator.backend.greedy_rounds
    generator.backend.greedy_rounds = lambda *args, **kwargs: asked.append(args[7]) or rounds(*args, **kwargs)
    generator.round_costs = RoundCosts((16, 300), (0.01, 0.01), (0.0, 0.0), exit_layer=2,
                                       overlap_gain=(1.1, 0.5))
    rng = np.random.default_rng(1)
    for length, overlapped in ((12, True), (380, False)):
        prompt = rng.integers(0, 96, length).tolist()
        asked.clear()
        out = generator.generate([prompt], max_new_tokens=24, eos_token_id=[])
        assert out.sequences[0] == reference_greedy(model, prompt, 24)
        assert asked and set(asked) == {overlapped}, (length, asked)
    # costs measured at another exit say nothing of this one's overlap: its settings decide
    generator.round_costs = dataclasses.replace(generator.round_costs, exit_layer=3)
    asked.clear()
    generator.generate([prompt], max_new_tokens=24, eos_token_id=[])
    assert asked and set(asked) == {True}


@pytest.mark.parametrize("backend", ["reference", "cpu_kernels"])
def test_a_seeded_sampled_row_keeps_its_text_under_a_gate_alone_in_a_batch_and_in_rounds_from_python(backend):
    """The gate cuts greedy rows' drafts only: a sampled row's draws follow its drafts, and the gate's
    cuts follow the batch's longest context, its pooled acceptance and where a compiled call ends. Under
    costs that would cut every round, a seeded sampled row decodes the same text alone (in one compiled
    call where the backend has them), from Python rounds and beside a longer row; greedy rows are still
    cut."""
    model = tiny_model("llama", num_layers=4, max_position_embeddings=512)
    rng = np.random.default_rng(2)
    prompt, longer = rng.integers(0, 96, 12).tolist(), rng.integers(0, 96, 200).tolist()
    settings = DecodeSettings(drafter="early_exit", exit_layer=2, num_speculations=3)
    sampled = dict(max_new_tokens=48, eos_token_id=[], temperature=0.9, top_p=0.95, seed=7)
    texts = {}
    for name, costs, fused in (("no gate", None, True), ("gate", DEAR, True),
                               ("gate, from Python", DEAR, False)):
        generator = SelfSpecGenerator(model, settings=dataclasses.replace(settings, fused=fused),
                                      backend=backend)
        generator.round_costs = costs
        texts[name] = generator.generate([prompt], **sampled).sequences[0]
        if costs is not None:
            texts[name + ", in a batch"] = generator.generate([prompt, longer], **sampled).sequences[0]
            greedy = generator.generate([prompt], max_new_tokens=48, eos_token_id=[])
            assert greedy.stats.plain_steps >= greedy.stats.rounds / 2, name  # still cuts greedy rows
        else:
            assert generator.generate([prompt], **sampled).stats.plain_steps == 0
    assert all(text == texts["no gate"] for text in texts.values()), texts
