"""One distillation as `selfspec distill-data` and a recipe's `data.distill` run it: the options, MODEL
loaded, its prompts, and the replies generated in this process or (`--endpoint`) by a server.

    distill_data(DistillOptions(model="runs/smollm2/base", out="runs/smollm2/distill", limit=256,
                                endpoint="http://127.0.0.1:8000/v1"))
"""

from __future__ import annotations

from dataclasses import dataclass

from ..decoding import DRAFTERS
from ..options import option
from .distill import ReplyOptions, distill_prompts, distill_responses
from .endpoint import EndpointOptions


@dataclass(frozen=True, kw_only=True)
class DistillOptions(ReplyOptions, EndpointOptions):
    """`selfspec distill-data` (`distill_data`)."""

    model: str = option(positional=True)
    """a checkpoint directory with a chat tokenizer (e.g. runs/smollm2/base)"""
    prompts: str = "sharegpt"
    """sharegpt (its train split), a question .jsonl (turns), a prompt file (one per line, .jsonl prompt), or
    json-extract (extraction prompts, each reply under its schema)"""
    out: str = option(flag="--out")
    """directory for responses.jsonl and manifest.json"""
    limit: int | None = None
    """answer only the first prompts"""
    drafter: str = option("ngram", choices=DRAFTERS)
    """how to decode them fast in this process; every drafter gives the model's own replies (lossless)"""
    force: bool = False
    """start --out again"""


def distill_data(options: DistillOptions) -> dict:
    """The model's own replies to `options.prompts` into `options.out/responses.jsonl`, in this process
    or through `options.endpoint` (see `selfspec.data.distill` and `distill_endpoint`); prints a summary
    line and returns the summary."""
    from ..checkpoint import load_tuned
    from .distill_endpoint import distill_through_endpoint

    pairs = distill_prompts(options.prompts)[:options.limit]
    generator = load_tuned(options.model, drafter=options.drafter, num_speculations="auto")
    if options.endpoint is None:
        summary = distill_responses(generator, pairs, options.out, options, model_name=str(options.model),
                                    force=options.force)
        where = ""
    else:
        summary = distill_through_endpoint(generator, pairs, options.out, options,
                                           model_name=str(options.model), force=options.force)
        match = "exact" if summary["probe_exact"] else f"{summary['probe_match']:.1%} of tokens"
        where = (f" through {summary['endpoint']} ({summary['server_model']!r}: probe {match}, token ids "
                 f"{'from the server' if summary['token_ids'] == 'server' else 'tokenized'})")
    print(f"{summary['file']}: {summary['rows']} replies ({summary['new_rows']} new, "
          f"{summary['tokens']:,} tokens in {summary['seconds']} s{where}); "
          f"{summary['skipped_long']} prompts over {options.max_prompt_tokens} tokens skipped")
    return summary
