"""Chat data: ShareGPT recovery from a cut-off file, chat files, the split by conversation id, and
packed blocks whose target mask is exactly the assistant text."""

import copy
import json

import pytest
from helpers import CHATML

from selfspec.data import ChatDataError, is_chat_source, load_chat_corpus, pack_chat_dataset, pack_split
from selfspec.data.chat import chat_tokens, read_chat_jsonl, read_sharegpt, split_of


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_run):
    tokenizer = copy.deepcopy(tiny_run["tokenizer"])
    tokenizer.chat_template = CHATML
    return tokenizer


def sharegpt_record(i, turns=(("human", "What is {i}?"), ("gpt", "It is the number {i}."))):
    return {"id": f"conv{i}_0", "conversations": [{"from": f, "value": v.format(i=i)} for f, v in turns]}


def test_a_cut_off_sharegpt_file_gives_every_complete_record(tmp_path):
    records = [sharegpt_record(i) for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text[:text.index('"conv4_0"') + 20]  # inside the fifth record
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    conversations, complete = read_sharegpt(path)
    assert complete == 4
    assert [c["id"] for c in conversations] == [f"conv{i}_0" for i in range(4)]
    assert conversations[0]["messages"] == [{"role": "user", "content": "What is 0?"},
                                            {"role": "assistant", "content": "It is the number 0."}]
    path.write_text(text)  # the whole file reads whole
    assert read_sharegpt(path)[1] == 5


def test_sharegpt_records_without_an_assistant_reply_are_dropped(tmp_path):
    records = [sharegpt_record(0, (("human", "only a question"),)),
               sharegpt_record(1, (("gpt", "a reply to nothing"), ("human", "Q"), ("gpt", "A"))),
               sharegpt_record(2, (("human", "Q"), ("bing", "A"), ("unknown", "x"), ("gpt", "   ")))]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(records))
    conversations, complete = read_sharegpt(path)
    assert complete == 3
    assert [c["id"] for c in conversations] == ["conv1_0", "conv2_0"]
    assert [m["role"] for m in conversations[0]["messages"]] == ["user", "assistant"]
    assert conversations[1]["messages"] == [{"role": "user", "content": "Q"},
                                            {"role": "assistant", "content": "A"}]


def test_chat_jsonl_reads_messages_sharegpt_turns_and_prompt_response(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"id": "x", "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
            {"prompt": "p", "response": "r"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversations = read_chat_jsonl(path)
    assert [c["messages"][-1]["content"] for c in conversations] == ["hello", "b", "r"]
    assert conversations[1]["id"] == "x"
    assert is_chat_source(str(path)) and is_chat_source("sharegpt")
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "plain"}) + "\n")
    assert not is_chat_source(str(text)) and not is_chat_source("stdlib")
    text_json = tmp_path / "text.json"
    text_json.write_text(json.dumps([{"text": "plain"}]))
    sharegpt_json = tmp_path / "s.json"
    sharegpt_json.write_text(json.dumps([sharegpt_record(0)]))
    assert not is_chat_source(str(text_json)) and is_chat_source(str(sharegpt_json))


def test_the_split_is_by_conversation_and_never_depends_on_order(tmp_path):
    assert split_of("abc_0") == split_of("abc_7") == split_of("abc")
    for ids in ([f"c{i}" for i in range(4000)],
                [f"json-extract-tool_calls-{i}" for i in range(4000)]):  # an underscore inside the id
        splits = [split_of(i) for i in ids]
        assert 0.015 < splits.count("test") / len(ids) < 0.025
        assert 0.015 < splits.count("validation") / len(ids) < 0.025
    path = tmp_path / "many.jsonl"
    rows = [{"id": f"c{i}_{part}", "prompt": f"q{i}", "response": f"a{i}"}
            for i in range(600) for part in (0, 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = load_chat_corpus(str(path))
    seen = {name: {i.rsplit("_", 1)[0] for i in corpus[name]["id"]} for name in corpus}
    assert not seen["train"] & seen["test"] and not seen["train"] & seen["validation"]
    assert sum(len(corpus[n]) for n in corpus) == 1200
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))
    assert set(load_chat_corpus(str(path))["test"]["id"]) == set(corpus["test"]["id"])


def test_the_target_mask_is_exactly_the_assistant_replies_and_their_end_of_turn(chat_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"},
                {"role": "assistant", "content": "return x + 1"}, {"role": "user", "content": "and g?"},
                {"role": "assistant", "content": "return 2 * x"}]
    ids, mask = chat_tokens(messages, chat_tokenizer)
    assert ids == chat_tokenizer(chat_tokenizer.apply_chat_template(messages, tokenize=False),
                                 add_special_tokens=False)["input_ids"]
    targets = chat_tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert targets == "return x + 1<|im_end|>\nreturn 2 * x<|im_end|>\n"
    short_ids, short_mask = chat_tokens(messages, chat_tokenizer, max_tokens=10)
    assert short_ids == ids[:10] and short_mask == mask[:10]


def test_packed_chat_blocks_keep_ids_and_mask_aligned(chat_tokenizer, tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"id": f"c{i}", "prompt": f"question number {i}" + " and more" * (i % 3 * 8),
             "response": f"answer number {i} " * 3} for i in range(200)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = load_chat_corpus(str(path))["train"]
    blocks = pack_split(train, chat_tokenizer, 64, max_blocks=6, cache_dir=tmp_path / "cache")
    assert blocks["input_ids"][:].shape == (6, 64) and blocks["target_mask"][:].shape == (6, 64)
    stream_ids, stream_mask, skipped = [], [], 0
    for messages in train["messages"]:
        ids, mask = chat_tokens(messages, chat_tokenizer, 64)
        if not any(mask):  # the prompt fills the cap: left out
            skipped += 1
            continue
        stream_ids += ids
        stream_mask += mask
    assert blocks["input_ids"][:].flatten().tolist() == stream_ids[:384]
    assert blocks["target_mask"][:].flatten().tolist() == stream_mask[:384]
    assert skipped > 0 and blocks["target_mask"][:].any(1).all()
    again = pack_chat_dataset(train, chat_tokenizer, 64, max_blocks=6, cache_dir=tmp_path / "cache")  # cached
    assert again["target_mask"][:].tolist() == blocks["target_mask"][:].tolist()


@pytest.mark.parametrize("content, message", [
    ("[]", "holds no conversation with an assistant turn"),
    ('{"not": "a list"}', "is not a ShareGPT file"),
])
def test_unusable_chat_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ChatDataError, match=message):
        load_chat_corpus(str(path))


def test_a_conversation_file_without_assistant_turns_is_a_clear_error(tmp_path):
    path = tmp_path / "users.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hello?"}]}) + "\n")
    with pytest.raises(ChatDataError, match="no conversation with an assistant turn"):
        load_chat_corpus(str(path))
    path.write_text(json.dumps({"question": "hello?"}) + "\n")
    with pytest.raises(ChatDataError, match="none of messages, conversations or prompt/response"):
        read_chat_jsonl(path)


def test_a_tokenizer_without_a_chat_template_is_a_clear_error(tiny_run):
    with pytest.raises(ChatDataError, match="no chat template"):
        chat_tokens([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                    tiny_run["tokenizer"])


def test_questions_in_the_common_format_and_their_first_turns(tmp_path):
    from selfspec.data.questions import first_turns, read_questions

    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": "math" if i % 2 else "writing",
             "turns": [f"q{i}", f"follow-up {i}"]} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    questions = read_questions(path)
    assert [q["turns"] for q in questions] == [r["turns"] for r in rows]
    assert [q["question_id"] for q in first_turns(questions, per_category=2)] == [0, 1, 2, 3]
    path.write_text(json.dumps({"question_id": 1, "turns": []}) + "\n")
    with pytest.raises(ChatDataError, match="needs turns"):
        read_questions(path)
