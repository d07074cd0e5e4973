"""Per-request sampling: rows of one batch each bring their own temperature, top-k, top-p, seed, stop
strings and grammar (or none), and each gets what it gets alone: greedy rows token for token, sampled
rows with their seed exactly (the early exit at a fixed k: a round's drafts then depend on the row
alone). On every backend, graph mode (emulated) included; rows start together or join later."""

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from helpers import step_joining, tiny_model

from selfspec.data.tokenizer import train_tokenizer
from selfspec.decoding import NewRow, SamplingParams, SelfSpecGenerator
from selfspec.decoding.grammar import Constraint
from selfspec.sampling import RowSampling

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# four settings: greedy, a plain temperature, top-k, top-p
SETTINGS = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=5),
            SamplingParams(temperature=0.7, top_p=0.9)]
BACKENDS = [("reference", None), ("cpu_kernels", None), ("static", "eager"), ("static", "graph")]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [(root / "json/encoder.py").read_text()[:20000]]
    texts += [json.dumps({"name": "Maria Lopez", "age": 34, "city": "Madrid"})] * 20
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=300)


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model("llama", vocab_size=len(tokenizer), seed=4, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=tokenizer.eos_token_id)


def _requests(tokenizer) -> list[NewRow]:
    """8 rows: the four settings twice (seeded), the last greedy row under a JSON schema."""
    texts = ["def f(x):", "import json", "class A:", "return", "Text: Maria, 34.", "for i in",
             "while True:", "JSON:"]
    rows = []
    for i, text in enumerate(texts):
        sampling = SETTINGS[i % 4]
        constraint = Constraint.of(json_schema=SCHEMA) if i == 7 else None
        rows.append(NewRow(tokenizer(text)["input_ids"], 10 + i, seed=100 + i, constraint=constraint,
                           sampling=sampling))
    return rows


def _alone(generator, row: NewRow) -> list[int]:
    """The request decoded by itself through `generate`."""
    s = row.sampling
    out = generator.generate([row.prompt], max_new_tokens=row.max_new_tokens, temperature=s.temperature,
                             top_k=s.top_k, top_p=s.top_p, seed=row.seed,
                             json_schema=None if row.constraint is None else SCHEMA)
    return out.sequences[0]


@pytest.mark.parametrize("backend,static", BACKENDS)
def test_rows_with_their_own_settings_each_get_what_they_get_alone(model, tokenizer, backend, static):
    generator = SelfSpecGenerator(model, tokenizer, exit_layer=2, num_speculations=3, backend=backend,
                                  static_passes=static)
    rows = _requests(tokenizer)
    # five rows start the batch, three join at later steps (the schema row among them)
    out, _ = step_joining(generator, rows[:5], {1: rows[5:7], 3: rows[7:]}, eos_token_id=[])
    for i, row in enumerate(rows):
        assert out.sequences[i] == _alone(generator, row)[:len(out.sequences[i])], (i, row.sampling)
        assert len(out.sequences[i]) == row.max_new_tokens or i == 7  # the schema row may complete early
    assert tokenizer.decode(out.sequences[7]).startswith('{"name": "')  # the grammar held in the batch


def test_a_graph_serves_every_setting(model, tokenizer):
    """Graph mode keeps one captured pass per shape for sampled rounds, whatever the rows' settings: a
    row decoded again under each other setting captures nothing new."""
    generator = SelfSpecGenerator(model, tokenizer, exit_layer=2, num_speculations=3, static_passes="graph")
    prompt = tokenizer("def f(x):")["input_ids"]

    def captures(sampling: SamplingParams) -> int:
        generator.generate([prompt], max_new_tokens=12, temperature=sampling.temperature,
                           top_k=sampling.top_k, top_p=sampling.top_p, seed=5, eos_token_id=[])
        return sum(f.captures for key, f in generator.backend.passes._functions.items()
                   if key[0].endswith("sampled"))

    first = captures(SETTINGS[1])
    assert first >= 2  # the draft loop's graph and the verification's
    assert [captures(s) for s in (SETTINGS[2], SETTINGS[3], SamplingParams(temperature=1.3))] == [first] * 3


def test_stop_strings_are_per_request(model, tokenizer):
    generator = SelfSpecGenerator(model, tokenizer, exit_layer=2, num_speculations=3)
    prompt = tokenizer("def f(x):")["input_ids"]
    free = generator.generate([prompt], max_new_tokens=20, eos_token_id=[]).sequences[0]
    text = tokenizer.decode(free)
    stop = text[len(tokenizer.decode(free[:4])):][:2]  # a string that completes after the fourth token
    assert stop
    out, _ = step_joining(generator, [NewRow(prompt, 20, stop_strings=(stop,)), NewRow(prompt, 20)], {},
                          eos_token_id=[])
    assert stop in tokenizer.decode(out.sequences[0]) and len(out.sequences[0]) < 20
    assert stop not in tokenizer.decode(out.sequences[0][:-1])  # it ends at the token completing it
    assert out.texts[0] == text[:text.find(stop)]  # the text ends before it (OpenAI's semantics)
    assert out.sequences[1] == free and out.texts[1] == text
    assert out.finish_reasons == ["stop", "length"]


def test_row_sampling_processes_each_row_as_it_would_alone():
    """A row's processed logits and probabilities do not depend on its batch-mates' settings."""
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 50)
    batch = RowSampling.of(SETTINGS, logits.device).probs(logits)
    for row, params in enumerate(SETTINGS):
        alone = RowSampling.of([params], logits.device).probs(logits[row:row + 1])
        assert torch.equal(batch[row:row + 1], alone), params
    assert torch.equal(batch[0], torch.nn.functional.one_hot(logits[0].argmax(-1), 50).float())
    top_k = batch[2] > 0
    assert (top_k.sum(-1) == 5).all()
    assert torch.equal(SETTINGS[3].probs(logits[3]), batch[3])  # one request's own processing
