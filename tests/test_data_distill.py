"""On-policy distillation data: the model's own replies, resumable after a kill, refused when the
directory was made by another model or tokenizer."""

import json

import datasets
import pytest
from helpers import CHATML, chat_checkpoint

from selfspec.cli import main
from selfspec.data import ChatDataError, load_chat_corpus
from selfspec.data.chat import pack_chat_dataset
from selfspec.data.distill import RESPONSES, ReplyOptions, distill_prompts, distill_responses
from selfspec.decoding import SelfSpecGenerator


@pytest.fixture(scope="module")
def chat_ckpt(tiny_run, tmp_path_factory):
    return chat_checkpoint(tiny_run, tmp_path_factory.mktemp("distill"), [f"def f{i}(x):" for i in range(7)])


def _generator(chat_ckpt):
    return SelfSpecGenerator(chat_ckpt["model"], chat_ckpt["tokenizer"], exit_layer=2, drafter="ngram")


def _pairs(n=7):
    return [(f"p{i}", f"def f{i}(x):") for i in range(n)]


def test_replies_are_the_models_own_greedy_continuations(chat_ckpt, tmp_path):
    options = ReplyOptions(batch_size=2, max_new_tokens=6)
    summary = distill_responses(_generator(chat_ckpt), _pairs(3), tmp_path, options, model_name="tiny",
                                progress=False)
    assert summary["rows"] == 3 and summary["new_rows"] == 3
    rows = [json.loads(line) for line in (tmp_path / RESPONSES).read_text().splitlines()]
    tokenizer = chat_ckpt["tokenizer"]
    for row, (_, prompt) in zip(rows, _pairs(3)):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        plain = chat_ckpt["model"].generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
        eos = tokenizer.eos_token_id
        plain = plain[:(plain == eos).nonzero()[0, 0] + 1] if (plain == eos).any() else plain
        assert row["messages"][1]["content"] == tokenizer.decode(plain, skip_special_tokens=True).strip()
        assert row["messages"][0] == {"role": "user", "content": prompt}
        # a reply the token limit cut is marked: training leaves it out
        assert row.get("truncated", False) == (len(plain) == 6 and int(plain[-1]) != eos)
    # The file is chat data for the fine-tune as it is, less the truncated replies.
    whole = sum(not row.get("truncated") for row in rows)
    if whole:
        corpus = load_chat_corpus(str(tmp_path / RESPONSES))
        assert sum(len(split) for split in corpus.values()) == whole
    # `data.keep_truncated: true` trains on the cut ones too
    corpus = load_chat_corpus(str(tmp_path / RESPONSES), keep_truncated=True)
    assert sum(len(split) for split in corpus.values()) == 3


def test_a_killed_run_resumes_to_the_same_file_as_an_uninterrupted_one(chat_ckpt, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    options = ReplyOptions(batch_size=2, max_new_tokens=5)
    distill_responses(_generator(chat_ckpt), _pairs(), whole, options, model_name="tiny", progress=False)
    distill_responses(_generator(chat_ckpt), _pairs(4), killed, options, model_name="tiny", progress=False)
    with (killed / RESPONSES).open("a") as handle:
        handle.write('{"id": "p4", "messages": [{"ro')  # a write torn by the kill
    summary = distill_responses(_generator(chat_ckpt), _pairs(), killed, options, model_name="tiny",
                                progress=False)
    assert summary["new_rows"] == 3 and summary["rows"] == 7
    assert (killed / RESPONSES).read_text() == (whole / RESPONSES).read_text()


def test_a_directory_from_another_model_or_tokenizer_is_refused(chat_ckpt, tmp_path):
    options = ReplyOptions(max_new_tokens=4)
    distill_responses(_generator(chat_ckpt), _pairs(2), tmp_path, options, model_name="tiny", progress=False)
    with pytest.raises(ChatDataError, match="was made with another model"):
        distill_responses(_generator(chat_ckpt), _pairs(2), tmp_path, options, model_name="other",
                          progress=False)
    other_tokenizer = type(chat_ckpt["tokenizer"]).from_pretrained(chat_ckpt["dir"])
    other_tokenizer.chat_template = CHATML.replace("<|im_start|>", "<s>")
    generator = SelfSpecGenerator(chat_ckpt["model"], other_tokenizer, exit_layer=2, drafter="ngram")
    with pytest.raises(ChatDataError, match="another tokenizer"):
        distill_responses(generator, _pairs(2), tmp_path, options, model_name="tiny", progress=False)


def test_the_command_line_writes_replies_and_bad_prompt_sources_are_one_line(chat_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["distill-data", str(chat_ckpt["dir"]), "--prompts", str(chat_ckpt["prompts"]),
                 "--out", str(out), "--limit", "3", "--max-new-tokens", "4"]) == 0
    assert len((out / RESPONSES).read_text().splitlines()) == 3
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["q" * 3000]}) + "\n")
    with pytest.raises(ChatDataError, match="holds no usable prompt"):
        distill_prompts(str(empty))
    assert main(["distill-data", str(chat_ckpt["dir"]), "--prompts", str(empty), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and "no usable prompt" in err[-1]


def test_json_extract_replies_are_the_models_constrained_outputs(chat_ckpt, tmp_path):
    """`--prompts json-extract`: train-split extraction prompts, categories in turn, each reply the
    model's own output under its schema (valid JSON of that schema when complete)."""
    import jsonschema

    triples = distill_prompts("json-extract")[:4]
    assert [t[0].split("-")[2] for t in triples] == ["people", "products", "events", "tool_calls"]
    assert len({t[0] for t in distill_prompts("json-extract")}) == len(distill_prompts("json-extract"))
    options = ReplyOptions(batch_size=2, max_new_tokens=40, max_prompt_tokens=200)
    summary = distill_responses(_generator(chat_ckpt), triples, tmp_path, options, model_name="tiny",
                                progress=False)
    assert summary["rows"] == 4
    rows = [json.loads(line) for line in (tmp_path / RESPONSES).read_text().splitlines()]
    gen = _generator(chat_ckpt)
    tokenizer = chat_ckpt["tokenizer"]
    for row, (_, prompt, schema) in zip(rows, triples):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        alone = gen.generate([tokenizer(text, add_special_tokens=False)["input_ids"]], max_new_tokens=40,
                             json_schema=schema)
        assert row["messages"][1]["content"] == tokenizer.decode(alone.sequences[0],
                                                                 skip_special_tokens=True).strip()
        if alone.complete[0]:
            jsonschema.validate(json.loads(row["messages"][1]["content"]), schema)
    assert json.loads((tmp_path / "manifest.json").read_text())["constrained"] is True
    # each reply keeps its schema, so that training can tell the tokens it forced (skip_forced)
    assert [row["json_schema"] for row in rows] == [schema for *_, schema in triples]
    corpus = load_chat_corpus(str(tmp_path / RESPONSES))
    everything = datasets.concatenate_datasets([corpus[name] for name in corpus])
    blocks = pack_chat_dataset(everything, tokenizer, 16, max_tokens_per_conversation=512, skip_forced=True)
    target, drafted = blocks["target_mask"][:], blocks["draft_mask"][:]
    assert not (drafted & ~target).any() and 0 < drafted.sum() < target.sum()


def test_a_sampled_run_continued_draws_what_an_uninterrupted_one_draws(chat_ckpt, tmp_path):
    """Each reply's seed is the run's plus its prompt's index, whatever batch it lands in: a run killed
    after 3 prompts and continued (its batches now start elsewhere) writes the uninterrupted file."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    options = ReplyOptions(batch_size=2, max_new_tokens=6, temperature=1.0, seed=5)
    distill_responses(_generator(chat_ckpt), _pairs(), whole, options, model_name="tiny", progress=False)
    distill_responses(_generator(chat_ckpt), _pairs(3), killed, options, model_name="tiny", progress=False)
    distill_responses(_generator(chat_ckpt), _pairs(), killed, options, model_name="tiny", progress=False)
    assert (killed / RESPONSES).read_text() == (whole / RESPONSES).read_text()


def test_a_second_run_on_the_same_directory_and_a_bad_limit_are_one_line(chat_ckpt, tmp_path, capsys):
    from selfspec.data.replies import ReplyFile

    with ReplyFile(tmp_path, {"model": "tiny"}):  # a run in progress holds the directory
        with pytest.raises(ChatDataError, match="another distill-data run is writing"):
            distill_responses(_generator(chat_ckpt), _pairs(2), tmp_path, ReplyOptions(max_new_tokens=4),
                              model_name="tiny", progress=False)
    for limit in ("0", "-3"):
        assert main(["distill-data", str(chat_ckpt["dir"]), "--prompts", str(chat_ckpt["prompts"]),
                     "--out", str(tmp_path / "out"), "--limit", limit]) == 2
        assert "--limit must be an integer of 1 or more" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()  # refused before anything was written
