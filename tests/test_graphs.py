"""CUDA-graph semantics, checked without a GPU (`backends.graphs`, emulated off CUDA): a replay rewrites
the outputs of the previous one, so the engine copies them out; a host read inside a capture is refused;
a new shape or a new static buffer is a new capture; a round of the static passes as graphs costs at
most two graph launches (the draft loop, the verification) and equals the eager passes' output, greedy,
sampled and under a grammar, on the CPU and on the emulated CUDA device. Inside a capture every operation
whose output's shape or values depend on data on the host is refused (one test each), and a replay that
would read another tensor or host value than its capture is refused too."""

import numpy as np
import pytest
import torch
from helpers import low_alpha_model, reference_greedy
from test_decoding_grammar import DRAFTERS, PERSON, constrained_reference, make_model, prompt_ids, tokenizer  # noqa: F401
from virtual_cuda import VirtualCuda, counts_per_round

from selfspec.backends import graphs
from selfspec.backends.graphs import CapturedPass, HostReadInCapture, ReplayMismatch, _Graph
from selfspec.decoding import NewRow, SelfSpecGenerator
from selfspec.decoding.grammar import Constraint

PROMPTS = [[5, 17, 33, 2, 71, 8, 5, 17, 33], [40, 3]]
NEW = 14


def _scale(x, buffer):
    buffer.add_(1)  # a static buffer, written in place by every replay
    return x * 2, x.sum(-1)


def test_a_replay_rewrites_the_previous_outputs_and_the_pass_copies_them_out():
    buffer = torch.zeros(3)
    graph = _Graph(_scale, (torch.ones(2, 3), buffer), {1}, None, real=False)
    first = graph.replay((torch.ones(2, 3), buffer))[0]
    assert first.tolist() == [[2.0] * 3] * 2
    graph.replay((torch.full((2, 3), 5.0), buffer))
    assert first.tolist() == [[10.0] * 3] * 2  # what a CUDA graph does to an output kept across replays
    captured = CapturedPass(_scale, static=(1,), device=torch.device("cpu"))
    kept = captured(torch.ones(2, 3), buffer)[0]
    captured(torch.full((2, 3), 5.0), buffer)
    assert kept.tolist() == [[2.0] * 3] * 2  # copied out: the caller may keep it
    assert buffer.tolist() == [6.0] * 3  # each capture ran the pass once, each of 4 replays once, in place


def test_a_new_shape_or_static_buffer_is_a_new_capture_and_the_same_is_a_replay():
    captured = CapturedPass(_scale, static=(1,), device=torch.device("cpu"))
    buffer = torch.zeros(3)
    captured(torch.ones(2, 3), buffer)
    captured(torch.zeros(2, 3), buffer)
    assert (captured.captures, captured.replays) == (1, 2)
    captured(torch.ones(4, 3), buffer)  # another shape
    captured(torch.ones(4, 3), torch.zeros(3))  # another address for the static buffer
    assert (captured.captures, captured.replays) == (3, 4)


def test_the_graphs_kept_are_bounded_the_least_recently_used_dropped():
    """A cache of rows joining a batch has buffers of its own: its graphs must not pile up (each holds
    its buffers)."""
    captured = CapturedPass(_scale, static=(1,), device=torch.device("cpu"))
    pooled = torch.zeros(3)
    for _ in range(graphs.KEPT + 4):
        captured(torch.ones(2, 3), torch.zeros(3))  # a new static buffer: a new capture
        captured(torch.ones(2, 3), pooled)  # the pooled cache's graph stays in use
    assert len(captured._graphs) == graphs.KEPT and captured.captures == graphs.KEPT + 5


# every operation whose output's shape or values come from the host, or from data the host must read
# first: a capture holds none of them (one case each)
REFUSED = {
    "item": lambda x: x * x.sum().item(),
    "tolist": lambda x: x * x.tolist()[0],
    "int": lambda x: x * int(x.sum()),
    "bool": lambda x: x if bool(x.any()) else -x,
    "to cpu": lambda x: x.to("cpu") + 1,
    "cpu": lambda x: x.cpu() + 1,
    "where(cond)": lambda x: torch.where(x > 0)[0].float().sum() + x,
    "argwhere": lambda x: torch.argwhere(x > 0).float().sum() + x,
    "nonzero": lambda x: x.nonzero().float().sum() + x,
    "unique": lambda x: torch.unique(x).sum() + x,
    "masked_select": lambda x: torch.masked_select(x, x > 0).sum() + x,
    "boolean index": lambda x: x[x > 0].sum() + x,
    "boolean index write": lambda x: x.clone().__setitem__(x > 0, 0.0) or x,
    "repeat_interleave": lambda x: x.repeat_interleave(torch.ones(3, dtype=torch.long)) + x,
    "repeat_interleave(repeats)": lambda x: torch.repeat_interleave(torch.ones(3, dtype=torch.long)) + x,
    "bincount": lambda x: torch.bincount(x.long()).float().sum() + x,
    "list index": lambda x: x[[0, 2, 1]] + x,
    "tensor": lambda x: x + torch.tensor([1.0, 2.0, 3.0]),
    "as_tensor": lambda x: x + torch.as_tensor([1.0, 2.0, 3.0]),
    "from_numpy": lambda x: x + torch.from_numpy(np.ones(3, dtype=np.float32)),
}


@pytest.mark.parametrize("body", REFUSED.values(), ids=REFUSED.keys())
def test_what_a_capture_cannot_hold_is_refused(body):
    assert body(torch.ones(3)).shape == (3,)  # each runs as written
    with pytest.raises(HostReadInCapture, match="inside a captured pass"):
        CapturedPass(body, static=(), device=torch.device("cpu"))(torch.ones(3))
    assert torch.from_numpy(np.zeros(1)).shape == (1,)  # refused inside the capture only


def test_what_a_capture_can_hold_is_captured():
    """Their fixed-shape forms: a three-argument where, repeat_interleave told its output size, a
    tensor of indices, a mask applied by masked_fill."""
    body = lambda x: (torch.where(x > 0, x, -x) + x.repeat_interleave(torch.ones(3, dtype=torch.long),
                                                                     output_size=3)
                      + x[torch.arange(3)] + x.masked_fill(x > 1, 0.0))
    assert CapturedPass(body, static=(), device=torch.device("cpu"))(torch.ones(3)).tolist() == [4.0] * 3


def test_a_replay_refuses_a_weight_moved_an_input_rebound_or_a_value_changed_after_capture():
    """A real replay reads what its capture read: the emulation refuses to read anything else."""
    weight = torch.nn.Parameter(torch.ones(3))
    held = {"buffer": torch.zeros(3), "scale": 2.0}
    body = lambda x: x * weight * held["scale"] + held["buffer"]
    captured = CapturedPass(body, static=(), device=torch.device("cpu"))
    assert captured(torch.ones(3)).tolist() == [2.0] * 3
    assert captured(torch.full((3,), 2.0)).tolist() == [4.0] * 3  # new values in the same input: a replay
    held["buffer"].add_(1)  # written in place: the captured address, read again
    assert captured(torch.ones(3)).tolist() == [3.0] * 3
    for change in (lambda: setattr(weight, "data", torch.full((3,), 5.0)),  # a weight moved
                   lambda: held.__setitem__("buffer", torch.zeros(3)),  # an input rebound
                   lambda: held.__setitem__("scale", 3.0)):  # a host value a graph froze at capture
        captured = CapturedPass(body, static=(), device=torch.device("cpu"))
        captured(torch.ones(3))
        change()
        with pytest.raises(ReplayMismatch, match="after capture"):
            captured(torch.ones(3))
    branch = {"on": True}
    captured = CapturedPass(lambda x: x * 2 if branch["on"] else x.exp().log(), static=(),
                            device=torch.device("cpu"))
    captured(torch.ones(3))
    branch["on"] = False
    with pytest.raises(ReplayMismatch, match="another path"):
        captured(torch.ones(3))


def _graph_calls(generator):
    """{kind: replays} of the generator's captured passes."""
    functions = generator.backend.passes._functions
    counts = {}
    for (kind, *_), fn in functions.items():
        counts[kind] = counts.get(kind, 0) + fn.replays
    return counts


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_round_is_at_most_two_graph_launches(k, sampled):
    """The k drafts and the last draft's pass are one graph, the verification with its acceptance
    another: every round of early-exit drafts replays exactly those two, greedy or sampled (each draft
    drawn on the device with its row's numbers); the prompts' prefill is one `run` each."""
    model = low_alpha_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2, static_passes="graph")
    sampling = {"temperature": 0.9, "seed": 3} if sampled else {}
    eager = SelfSpecGenerator(model, exit_layer=2, static_passes="eager")
    for prompt in PROMPTS:
        call = {"max_new_tokens": NEW, "eos_token_id": [], "num_speculations": k, **sampling}
        out = generator.generate([prompt], **call)
        want = (eager.generate([prompt], **call).sequences if sampled
                else [reference_greedy(model, prompt, NEW)])
        assert out.sequences == want
    counts = _graph_calls(generator)
    loop, verify = ("draft_loop_sampled", "verify_sampled") if sampled else ("draft_loop", "verify")
    rounds = counts[verify]
    assert counts[loop] == rounds and counts.get("draft", 0) == 0  # one loop graph per round
    assert counts["run"] == len(PROMPTS) and sum(counts.values()) == 2 * rounds + len(PROMPTS)
    assert out.stats.early_exit.accepted > 0


# kernel launches a round on graphs, the counts measured (`python tools/round_syncs.py`): the round's
# bookkeeping (positions, acceptance, rollback), the graphs' input copies and output copies
@pytest.mark.parametrize("k, sampling, launches", [(0, {}, 14), (4, {}, 23),
                                                   (4, {"temperature": 0.9, "seed": 3}, 31)])
def test_a_round_on_graphs_launches_a_bounded_number_of_operations_beside_its_graphs(k, sampling, launches):
    """At most 2 graph launches a round and the measured count of other launches (every operation outside
    a capture, a replay's input copies, results in tuples), where the passes as written launch hundreds
    (a tiny model's 4 blocks; a real model's eager count grows with its blocks)."""
    model = low_alpha_model("llama")
    counts = {}
    with VirtualCuda() as device:
        device.module(model)
        for mode in ("eager", "graph"):
            generator = SelfSpecGenerator(model, exit_layer=2, static_passes=mode)
            counts[mode] = counts_per_round(device, generator, [PROMPTS[0]], "early_exit", k, **sampling)[0]
    assert counts["graph"]["kernel_launches"] <= launches + 0.5, counts
    assert counts["graph"]["graph_launches"] <= (2 if k else 1), counts
    assert counts["eager"]["kernel_launches"] > 10 * counts["graph"]["kernel_launches"], counts


def test_sampling_and_a_grammar_on_graphs_equal_the_eager_passes(tokenizer):  # noqa: F811
    model = low_alpha_model("llama")
    eager = SelfSpecGenerator(model, exit_layer=2, static_passes="eager")
    graph = SelfSpecGenerator(model, exit_layer=2, static_passes="graph")
    for k in (0, 3):
        want = eager.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], num_speculations=k,
                              temperature=0.9, seed=7)
        got = graph.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], num_speculations=k,
                             temperature=0.9, seed=7)
        assert got.sequences == want.sequences, k
    model = make_model("llama", tokenizer)
    prompt = prompt_ids(tokenizer)
    expected, complete = constrained_reference(model, tokenizer, prompt, Constraint.of(PERSON), 60)
    graph = SelfSpecGenerator(model, tokenizer, exit_layer=2, static_passes="graph")
    for name, settings in DRAFTERS.items():
        out = graph.generate([prompt], max_new_tokens=60, json_schema=PERSON, settings=settings)
        assert out.sequences[0] == expected and out.complete == [complete], name


def test_graphs_on_the_emulated_cuda_device_are_plain_greedy():
    model = low_alpha_model("qwen3")
    with VirtualCuda() as device:
        device.module(model)
        expected = [reference_greedy(model, p, NEW) for p in PROMPTS]
        generator = SelfSpecGenerator(model, exit_layer=2, static_passes="graph")
        for drafter, k in (("early_exit", 0), ("early_exit", 4), ("ngram", 3), ("hybrid", 2)):
            out = generator.generate(PROMPTS, max_new_tokens=NEW, drafter=drafter, num_speculations=k,
                                     eos_token_id=[])
            assert out.sequences == expected, (drafter, k)


def _captures(generator) -> int:
    return sum(fn.captures for fn in generator.backend.passes._functions.values())


def test_a_batch_whose_rows_leave_and_join_replays_the_graphs_of_its_sizes():
    """The server's batch changes as requests finish, join and are cancelled: the pool keeps one set of
    buffers per capacity, a batch of B rows on its first B rows, so a pass captured for B rows is replayed
    whenever B rows decode again, rather than captured for each new composition of the batch."""
    model = low_alpha_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2, static_passes="graph", num_speculations=3)
    prompts = [*PROMPTS, [11, 12, 13, 14, 15, 16, 17]]
    lengths = (12, 5, 9)  # the rows finish at different rounds: the batch goes 3 -> 2 -> 1 rows

    def serve() -> list[list[int]]:
        engine = generator.engine(eos_token_id=[])
        for p, n in zip(prompts, lengths):
            engine.add(NewRow(p, n))
        engine.step()
        late = engine.add(NewRow(PROMPTS[1], 6))  # joins the running batch at the next step
        gone = engine.add(NewRow(PROMPTS[0], 30))
        engine.step()
        engine.cancel(gone)
        while not engine.done:
            engine.step()
        sequences = engine.output().sequences
        assert sequences[:3] == [reference_greedy(model, p, n) for p, n in zip(prompts, lengths)]
        assert sequences[late] == reference_greedy(model, PROMPTS[1], 6)
        assert sequences[gone] == reference_greedy(model, PROMPTS[0], 30)[:len(sequences[gone])]
        return sequences

    first = serve()  # grows the batch's buffers to its most rows (5): the next call captures on those once
    assert serve() == first
    captured = _captures(generator)
    assert serve() == first
    assert _captures(generator) == captured  # every batch size's graphs replayed, none captured again


@pytest.mark.parametrize("static", [None, "graph"])
@pytest.mark.parametrize("drafter, k, reads, uploads", [("early_exit", 0, 1, 0), ("early_exit", 4, 1, 0),
                                                        ("ngram", 3, 1, 0.1), ("hybrid", 2, 1.95, 0.25)])
def test_a_round_reads_the_device_once_and_uploads_without_waiting(static, drafter, k, reads, uploads):
    """Host syncs a round (just above the counts measured by `python tools/round_syncs.py`), counted on
    the emulated device as the syncs a longer decode adds per round it adds. Reads: the verification's
    decided tokens (`Engine._round`); the hybrid's copy after the early exit's drafts reads them too, in
    the rounds whose exit drafts it looks up in the host's n-gram index (`CopyProposer.propose`). Uploads:
    the lengths and pending tokens go up from pinned memory without blocking (`Batch.upload`), so a round
    uploads with a wait only the copies it drafts (a copy is found in one round of 5 to 15 here)."""
    model = low_alpha_model("llama")
    with VirtualCuda() as device:
        device.module(model)
        generator = SelfSpecGenerator(model, exit_layer=2, static_passes=static)
        counts = counts_per_round(device, generator, [PROMPTS[0]], drafter, k)[0]
    assert counts["host_reads"] <= reads, counts
    assert counts["host_uploads"] <= uploads, counts
