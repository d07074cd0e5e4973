"""Every backend against the reference backend (`selfspec.backends`), token for token.

The reference runs each round as torch operations (MKL's products, every compiled call declined); the
CPU kernels backend runs the same rounds as compiled calls and fused rounds, the static backend every
pass at fixed shapes, as written and captured as graphs (the same rounds exactly). The matrix covers
each family with each drafter, and across the cases k, the batch size, greedy and sampled decoding (same
seeds, so the same random numbers) and a JSON schema.
"""

from __future__ import annotations

import itertools
import sysconfig
from pathlib import Path

import pytest
import torch
from helpers import FAMILIES, kernels_unavailable, low_alpha_model, tiny_model

from selfspec.backends import BACKENDS, CpuKernelsBackend, ReferenceBackend, StaticBackend, make_backend
from selfspec.data import train_tokenizer
from selfspec.decoding import DecodeSettings, NewRow, SelfSpecGenerator
from selfspec.errors import UserError
from selfspec.model import DecoderView, kernels

PROMPTS = [[5, 17, 17, 9, 5, 17, 17, 9, 5, 17], [3, 8, 1, 40, 3, 8, 1], [60, 61, 62, 63, 64, 65, 60, 61, 62]]
NEW = 24
DRAFTERS = ("early_exit", "ngram", "hybrid")
KS = (0, 1, 4)


def _cases():
    """(family, drafter, k, rows, sampled): every combination."""
    return list(itertools.product(FAMILIES, DRAFTERS, KS, (1, 3), (False, True)))


def _outcome(out) -> tuple:
    """What must not depend on the backend: the tokens, and the drafts behind them (the rounds, the drafts
    proposed and accepted, per draft source): a backend that drafted otherwise could still emit the
    target's tokens, its wrong drafts rejected."""
    s = out.stats
    return (out.sequences, s.rounds, s.drafted, s.accepted, s.accepted_histogram, s.draft_steps,
            s.plain_steps, [(part.drafted, part.accepted) for part in (s.copy, s.forced, s.early_exit)])


def _decode(model, backend: str, drafter: str, k: int, rows: int, sampled: bool,
            static_passes: str | None = None) -> tuple:
    settings = DecodeSettings(drafter=drafter, exit_layer=2, num_speculations=k)
    gen = SelfSpecGenerator(model, settings=settings, backend=backend, static_passes=static_passes)
    sampling = {"temperature": 0.8, "top_k": 20, "seed": 11} if sampled else {}
    return _outcome(gen.generate(PROMPTS[:rows], max_new_tokens=NEW, eos_token_id=[], **sampling))


def _backends(family: str) -> list[str]:
    """The backends that run `family` besides the reference (static passes: the Llama family only)."""
    return [name for name in BACKENDS if name != "reference" and not (name == "static" and family == "gpt2")]


@pytest.mark.parametrize("family,drafter,k,rows,sampled", _cases())
def test_every_backend_decodes_as_the_reference(family, drafter, k, rows, sampled):
    model = low_alpha_model(family)
    expected = _decode(model, "reference", drafter, k, rows, sampled)
    for backend in _backends(family):
        got = outcome = _decode(model, backend, drafter, k, rows, sampled)
        want = expected
        if backend == "static":  # its passes captured as graphs: the same rounds, drafts and tokens
            assert _decode(model, backend, drafter, k, rows, sampled, static_passes="graph") == outcome
        if drafter != "early_exit" and (backend == "static" or not sampled):
            # where a backend schedules copies otherwise, the drafts may differ (the tokens never): its
            # compiled draft loop looks for a copy once, after the early exit's drafts (the reference, after
            # each); fused rounds adapt the copy length between calls of several rounds, not between rounds
            # (test_decoding_draft_loop compares both at a fixed length); static passes cap a round at
            # WIDTH - 1 drafts, a copy too
            got, want = got[0], want[0]
        assert got == want, backend


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [(root / name).read_text()[:20000] for name in ("json/encoder.py", "textwrap.py")]
    examples = ['{"name": "Maria Lopez", "age": 34, "city": "Madrid"}'] * 40
    return train_tokenizer(texts + examples, tmp_path_factory.mktemp("tok"), vocab_size=400)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


SCHEMA_CASES = [("llama", "early_exit", False), ("qwen3", "hybrid", False), ("mistral", "ngram", True),
                ("qwen2", "early_exit", True)]


@pytest.mark.parametrize("family,drafter,sampled", SCHEMA_CASES)
def test_every_backend_decodes_as_the_reference_under_a_json_schema(family, drafter, sampled, tokenizer):
    model = tiny_model(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    prompt = tokenizer('Maria Lopez, 34. JSON: {"name": "Maria Lopez", "age": 34}. Again:')["input_ids"]
    settings = DecodeSettings(drafter=drafter, exit_layer=2, num_speculations=3)
    sampling = {"temperature": 0.8, "seed": 5} if sampled else {}

    def decode(backend, static_passes=None):
        gen = SelfSpecGenerator(model, tokenizer, settings=settings, backend=backend,
                                static_passes=static_passes)
        return _outcome(gen.generate([prompt, prompt[3:]], max_new_tokens=40, json_schema=PERSON, **sampling))

    expected = decode("reference")
    for backend in _backends(family):
        assert decode(backend) == expected, backend
    assert decode("static", static_passes="graph") == expected


def test_the_reference_runs_no_compiled_call_and_the_cpu_kernels_do():
    if kernels.extension() is None:
        kernels_unavailable()
    model = tiny_model("llama")
    calls = []

    def counted(module):
        class Counting:
            def __getattr__(self, name):
                function = getattr(module, name)
                if not callable(function) or isinstance(function, type):
                    return function
                return lambda *args: (calls.append(name), function(*args))[1]
        return Counting()

    def stepped(backend):  # a row that joins a running batch is prefilled too
        gen = SelfSpecGenerator(model, exit_layer=2, num_speculations=3, backend=backend)
        engine = gen.engine(eos_token_id=[])
        engine.add(NewRow(PROMPTS[0], max_new_tokens=NEW))
        engine.step()
        engine.add(NewRow(PROMPTS[1], max_new_tokens=NEW))
        while not engine.done:
            engine.step()
        return engine.output().sequences

    for backend, expect_calls in (("reference", False), ("cpu_kernels", True)):
        calls.clear()
        with kernels.wrapped(counted):
            _decode(model, backend, "early_exit", 3, 1, False)
            joined = stepped(backend)
        assert bool(calls) == expect_calls, (backend, sorted(set(calls)))
    assert "greedy_rounds" in calls  # the declared capability, fused rounds, ran
    assert joined == stepped("reference")


def test_the_engine_asks_a_backend_for_round_calls_only_where_it_may_have_them(monkeypatch):
    """`Backend.round_calls`: the reference declines every round call, so a round does not ask it (its
    draft loop and verification run from Python); a backend that has them is asked (rounds from Python:
    not fused), and both decode alike."""
    model = tiny_model("llama")
    settings = DecodeSettings(drafter="early_exit", exit_layer=2, num_speculations=3, fused=False)
    asked, outputs = [], {}
    for backend in ("reference", "cpu_kernels"):
        gen = SelfSpecGenerator(model, settings=settings, backend=backend)
        cls = type(gen.runner.backend)

        def counted(self, *args, name=backend, declined=cls.verify_greedy, **kwargs):
            asked.append(name)
            return declined(self, *args, **kwargs)
        monkeypatch.setattr(cls, "verify_greedy", counted)
        outputs[backend] = gen.generate([PROMPTS[0]], max_new_tokens=NEW, eos_token_id=[]).sequences
    assert "reference" not in asked and (kernels.extension() is None or "cpu_kernels" in asked), asked
    assert outputs["cpu_kernels"] == outputs["reference"]


def test_make_backend_picks_and_refuses():
    view = DecoderView(tiny_model("llama"))
    assert isinstance(make_backend(view), CpuKernelsBackend)  # a CPU
    assert isinstance(make_backend(view, "reference"), ReferenceBackend)
    static = make_backend(view, None, "graph")
    assert isinstance(static, StaticBackend) and static.mode == "graph" and not static.fused_rounds
    assert CpuKernelsBackend.fused_rounds and not ReferenceBackend.fused_rounds
    with pytest.raises(UserError, match="backend must be one of"):
        make_backend(view, "cuda")
    with pytest.raises(UserError, match="runs on the static backend"):
        make_backend(view, "reference", "eager")
    with pytest.raises(UserError, match="static passes need a Llama-family model"):
        make_backend(DecoderView(tiny_model("gpt2")), "static")


def test_a_generator_runs_on_the_backend_it_names():
    model = tiny_model("qwen2")
    assert SelfSpecGenerator(model, exit_layer=2, backend="reference").backend.name == "reference"
    assert SelfSpecGenerator(model, exit_layer=2, static_passes="eager").backend.name == "static"
    with torch.inference_mode():
        gen = SelfSpecGenerator(model, exit_layer=2, backend="static")
        assert gen.backend.mode == "eager" and gen.backend.pools_caches  # caches in buckets, reused
        assert gen.backend.max_pass_positions == 16
