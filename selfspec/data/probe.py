"""Does the server serve MODEL? Checked before a single reply is asked for.

    check = await same_model(server, await server.models(), generator, "runs/smollm2/base", options)

First the server's `/v1/models`: the name to ask for (the one it lists, or `--server-model`), and where
the server says it (llama.cpp does), the size of its vocabulary against MODEL's. Then a greedy probe:
two prompts answered by the server and by MODEL in this process, `PROBE_TOKENS` tokens each. The
replies are the same model's when their texts (or, where the server returns them, their token ids) are
equal. Otherwise the share of the server's tokens that MODEL, fed the server's reply so far, would
have chosen itself says how near it is: below `min_probe_match` the server is refused in one line that
says what differed; above it (a quantized copy of MODEL) the run goes on with a warning.

The probe also settles what the run asks for: the reply's token ids, where the server takes the fields
that ask for them and returns ids (else the manifest says the text is tokenized with MODEL's tokenizer).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .distill import has_chat_template, prompt_ids
from .endpoint import Completion, Endpoint, EndpointError, EndpointOptions, request_body

PROBE_PROMPTS = ("What is the capital of France?", "Write two sentences about the sea.")
PROBE_TOKENS = 24  # per prompt: enough to tell a model from another, short enough for any server


@dataclass(frozen=True)
class ProbeResult:
    """What the check found: the server's name for the model, whether requests ask for token ids
    (`asks_ids`) and whether the replies carry them (`token_ids`: "server" or "tokenized"), the share of
    probe tokens that matched MODEL's greedy choice, and whether the replies were MODEL's exactly."""

    server_model: str
    asks_ids: bool
    token_ids: str
    match: float | None  # None: no probe ran (`--no-probe`)
    exact: bool


async def same_model(server: Endpoint, models: list[dict], generator, model_name: str,
                     options: EndpointOptions) -> ProbeResult:
    """The server's model name and the probe's verdict (see the module docstring); `models`: the entries
    of its /v1/models. An `EndpointError` of one line when the server serves another model."""
    name = served_name(server.url, models, {len(generator.tokenizer), generator.view.config.vocab_size},
                       model_name, options.server_model)
    replies, asks_ids = [], True
    for prompt in PROBE_PROMPTS:
        reply = None
        if asks_ids:
            try:
                reply = await server.complete(*_probe_request(generator, name, prompt, True), "the probe")
            except EndpointError as exc:  # selfspec serve, among others, refuses logprobs: ask without
                if exc.status is None or not 400 <= exc.status < 500:
                    raise
                asks_ids = False
        if reply is None:
            reply = await server.complete(*_probe_request(generator, name, prompt, False), "the probe")
        replies.append(reply)
    with_ids = asks_ids and all(r.token_ids is not None for r in replies)
    matched, total, exact, difference = 0, 0, True, None
    for prompt, reply in zip(PROBE_PROMPTS, replies):
        same, agree, count, ours = _compare(generator, prompt, reply, with_ids)
        exact &= same
        matched, total = matched + (count if same else agree), total + count
        difference = difference or (None if same else (prompt, ours, reply.text))
    share = matched / total if total else 1.0
    if not exact:
        _judge(server.url, model_name, share, difference, options.min_probe_match, (matched, total))
    return ProbeResult(name, with_ids, "server" if with_ids else "tokenized", round(share, 4), exact)


def unprobed(server: Endpoint, models: list[dict], tokenizer, model_name: str,
             options: EndpointOptions) -> ProbeResult:
    """`--no-probe`: the server's name for the model (`served_name`, its vocabulary checked against the
    tokenizer's where the server says it), no reply compared (MODEL is not loaded): match None."""
    name = served_name(server.url, models, {len(tokenizer)}, model_name, options.server_model)
    return ProbeResult(name, False, "tokenized", None, False)

def _probe_request(generator, name: str, prompt: str, ask_ids: bool) -> tuple[str, dict]:
    return request_body(name, prompt, has_chat_template(generator.tokenizer), PROBE_TOKENS,
                        {"temperature": 0.0}, ask_ids=ask_ids)


def served_name(url: str, models: list[dict], sizes: set[int], model_name: str, wanted: str | None) -> str:
    """The name to ask the server for: `wanted`, or the one model `models` (its /v1/models) lists (among
    several, the one named like MODEL); refused when it is not listed, or when the server's vocabulary is
    none of MODEL's `sizes` (its tokenizer's, its config's)."""
    ids = [m["id"] for m in models]
    if wanted is not None and wanted not in ids:
        raise EndpointError(f"the server at {url} serves {_names(ids)}, not {wanted!r}; pass one of "
                            f"them to --server-model")
    if wanted is None:
        named = [i for i in ids if i.rstrip("/") in (model_name.rstrip("/"), Path(model_name).name)]
        if len(ids) != 1 and len(named) != 1:
            raise EndpointError(f"the server at {url} serves {_names(ids)}; pass the one to use to "
                                f"--server-model")
        wanted = ids[0] if len(ids) == 1 else named[0]
    meta = next(m for m in models if m["id"] == wanted).get("meta")
    n_vocab = meta.get("n_vocab") if isinstance(meta, dict) else None
    if isinstance(n_vocab, int) and n_vocab not in sizes:
        raise EndpointError(f"the server at {url} serves another model than {model_name}: "
                            f"{wanted!r} has a vocabulary of {n_vocab} tokens, {model_name} of {max(sizes)}")
    return wanted


def _compare(generator, prompt: str, reply: Completion, with_ids: bool) -> tuple[bool, int, int, str]:
    """(whether the reply is MODEL's greedy one, how many of its tokens MODEL would have chosen given the
    reply before them, how many tokens it has, MODEL's own reply's text)."""
    tokenizer, ids = generator.tokenizer, prompt_ids(generator.tokenizer, prompt)
    local = generator.generate([ids], max_new_tokens=PROBE_TOKENS, temperature=0.0).sequences[0]
    ours = tokenizer.decode(local, skip_special_tokens=True)
    theirs = reply.token_ids if with_ids else tokenizer(reply.text, add_special_tokens=False)["input_ids"]
    if with_ids:
        eos = set(generator.eos_token_ids)
        same = [t for t in theirs if t not in eos] == [t for t in local if t not in eos]
    else:
        same = reply.text == ours
    if not theirs:
        return same, 0, 0, ours
    model = generator.view.model
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([ids + list(theirs)], device=device)).logits[0, len(ids) - 1:-1]
    agree = int((logits.argmax(-1).cpu() == torch.tensor(theirs)).sum())
    return same, agree, len(theirs), ours


def _judge(url: str, model_name: str, share: float, difference: tuple, least: float,
           counts: tuple[int, int]) -> None:
    """Refuse (below `least`) or warn about a server whose probe replies are not MODEL's."""
    prompt, ours, theirs = difference
    what = (f"its greedy replies to the probe prompts agree with {model_name}'s on {counts[0]} of "
            f"{counts[1]} tokens ({share:.0%}; to {prompt!r} {model_name} says {_start(ours)}, the server "
            f"{_start(theirs)})")
    if share < least:
        raise EndpointError(f"the server at {url} serves another model than {model_name}: {what}; pass the "
                            f"address of a server of {model_name} (a near copy: --min-probe-match)")
    warnings.warn(f"the server at {url} serves a near match of {model_name} (a quantized copy?): {what}; "
                  f"the replies are that model's", stacklevel=3)


def _start(text: str, chars: int = 40) -> str:
    line = " ".join(text.split())
    return repr(line if len(line) <= chars else line[:chars] + "...")


def _names(ids: list[str]) -> str:
    return ", ".join(repr(i) for i in ids[:8]) + (f" and {len(ids) - 8} more" if len(ids) > 8 else "") \
        if ids else "no model"
