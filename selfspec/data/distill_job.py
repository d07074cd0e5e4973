"""One distillation as `selfspec distill-data` and a recipe's `data.distill` run it: the options, MODEL
loaded, its prompts, and the replies generated in this process or (`--endpoint`) by a server.

    distill_data(DistillOptions(model="runs/smollm2/base", out="runs/smollm2/distill", limit=256,
                                endpoint="http://127.0.0.1:8000/v1"))
    distill_data(recipe_options(cfg.data, cfg.model.name_or_path))   # a recipe's data.distill
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError
from ..decoding import DRAFTERS
from ..flags import option
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

    def check(self):
        if self.limit is not None and (type(self.limit) is not int or self.limit < 1):
            raise ConfigError(f"--limit must be an integer of 1 or more (the first prompts to answer), got "
                              f"{self.limit!r}")


def distill_data(options: DistillOptions) -> dict:
    """The model's own replies to `options.prompts` into `options.out/responses.jsonl`, in this process
    or through `options.endpoint` (see `selfspec.data.distill` and `distill_endpoint.py`); prints a summary
    line and returns the summary."""
    from ..checkpoint import load_tuned
    from ..model.loading import load_tokenizer
    from .distill_endpoint import distill_through_endpoint

    pairs = distill_prompts(options.prompts)[:options.limit]

    def load():
        if options.endpoint is not None and not options.probe:  # the server decodes: a tokenizer will do
            return load_tokenizer(options.model)
        return load_tuned(options.model, drafter=options.drafter, num_speculations="auto")

    if options.endpoint is None:
        summary = distill_responses(load(), pairs, options.out, options, model_name=str(options.model),
                                    force=options.force)
        where = ""
    else:
        summary = distill_through_endpoint(load, pairs, options.out, options, model_name=str(options.model),
                                           force=options.force)
        match = ("skipped" if summary["probe_match"] is None else "exact" if summary["probe_exact"]
                 else f"{summary['probe_match']:.1%} of tokens")
        refused = (f"; {summary['refused']} prompts refused by the server, in {summary['errors']} "
                   f"(--retry-refused asks again)" if summary["refused"] else "")
        where = f" through {summary['endpoint']} ({summary['server_model']!r}: probe {match}{refused})"
    print(f"{summary['file']}: {summary['rows']} replies ({summary['new_rows']} new, "
          f"{summary['tokens']:,} tokens in {summary['seconds']} s{where}); "
          f"{summary['skipped_long']} prompts over {options.max_prompt_tokens} tokens skipped")
    return summary


def recipe_options(data, model: str) -> DistillOptions:
    """The `DistillOptions` of a recipe's data section (`config.DataConfig`): its `distill` mapping, the
    model `model`, the replies into the directory of `data.source`. An unknown or misplaced key is a
    one-line `ConfigError` naming it."""
    fields = sorted({f.name for f in dataclasses.fields(DistillOptions)} - {"model", "out"})
    for key in data.distill:
        if key in ("model", "out"):
            raise ConfigError(f"data.distill.{key} is not set there: the model is model.name_or_path, the "
                              f"replies go to the directory of data.source")
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean 'data.distill.{close[0]}'?" if close else f"valid: {', '.join(fields)}"
            raise ConfigError(f"unknown config key 'data.distill.{key}'; {hint}")
    return DistillOptions(model=model, out=str(Path(data.source).parent), **data.distill)
