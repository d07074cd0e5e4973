"""Tuned checkpoints: a `save_pretrained` directory (safetensors) + tokenizer + `selfspec.json`.

The directory loads with plain `AutoModelForCausalLM.from_pretrained` and with
`selfspec.load_tuned(path)`, which also reads how to draft (`DecodeSettings`: drafter, E, k, V', copies).

`selfspec.json` schema (version 1); the decode settings are `DecodeSettings.to_json()`'s fields,
read by `read_settings` and written by `save_tuned` and `write_settings` only:
    format_version  1
    kind            "tuned" (a self-speculative fine-tune) or "base" (a pretrained base model)
    drafter         "early_exit", "ngram" or "hybrid" (see decoding/policy.py)
    exit_layer      E: the draft runs blocks [0, E)
    num_speculations  k: the early exit's drafts per round (int, "auto" or "window")
    draft_vocab_size  V': the draft head's vocabulary (the V' most frequent tokens of
                    token_counts.safetensors); 0: the whole vocabulary
    stop_below      η: the early exit stops a round's drafts below this top probability; 0: never
    ngram           the copy settings {max_ngram, min_ngram, max_copy}
    overlap         whether a round drafts the next round's tokens beside its verification
    fused           whether a lone row's rounds run many in one compiled call (absent: true)
    fastest         optional, written by a sweep: {drafter: {settings: {the eight fields above},
                    speedup, tokens_per_second}}, each drafter at its fastest measured setting
    sweep           optional: {speedup, interval, coverage, report, prompts_from, candidates} of the
                    sweep that chose the settings (`candidates`: the cells it re-timed)
    formats         optional: {kind: {settings, fastest, and the sweep's record}} of sweeps under a kind of
                    constraint ("json_schema", ...) or sampled at temperature T ("sampled@T"; "sampled"
                    from sweeps that did not record T), each the default of such calls, or after long
                    prompts ("context@T": greedy decodes at the checkpoint's settings switch to it once
                    their longest context reaches T tokens; `selfspec eval sweep --context`)
    round_costs     optional, written by a greedy sweep's write-back: {device type: {lengths, draft,
                    verify_slope, exit_layer, draft_vocab_size, overlap_gain?}}, a round's costs by
                    context length (`decoding.RoundCosts`), from which decoding drafts only where
                    drafting pays
    token_counts    optional: where token_counts.safetensors was counted {source, tokens, vocab_size}
    exit_adapter    optional: {exit_layer, file, kind, ...} of an exit adapter that the draft at that E
                    reads (trainable: adapter): kind "mlp" with hidden_size, intermediate_size, or
                    "block" with init_layers (the model blocks its stack was copied from; a
                    one-block checkpoint of before stacks has init_layer)
    exit_choice     optional: how the fine-tune chose E and k among its candidate exits
                    {exit_layer, num_speculations, predicted_speedup, candidates: {E: {acceptance_rate,
                    draft_cost, num_speculations, predicted_speedup}}}
    base_model      where the weights came from (path or hub id)
    training        the run config (dict) that produced it
    metrics         final metrics (per-layer agreement, perplexity, ...)
    created         ISO timestamp
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
import warnings
from pathlib import Path

from .cpu import on_a_thread_that_ends
from .decoding.settings import FIELDS as SETTINGS_FIELDS
from .decoding.settings import DecodeSettings
from .errors import UserError
from .files import atomic_directory, atomic_file, write_json_atomic
from .model import num_layers as count_layers
from .model.exit_adapter import ADAPTER_FILE, load_exit_adapter, save_exit_adapter

META_FILE = "selfspec.json"
TOKEN_COUNTS_FILE = "token_counts.safetensors"  # (V,) int64 "counts": token frequencies for the draft head
FORMAT_VERSION = 1


class CheckpointError(UserError):
    """A directory that is not a usable selfspec checkpoint; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where a checkpoint came from, as its selfspec.json records it.

    kind: "tuned" (trained by selfspec) or "base" (imported or pretrained, its exit untrained);
    base_model: the model it was fine-tuned from; training: the run's configuration; metrics: its final
    figures; exit_choice: how E and k were chosen among the candidate exits (`metrics.choose_exit`);
    token_counts_source: what the token counts for a trimmed draft head were counted on.
    """

    kind: str = "tuned"
    base_model: str | None = None
    training: dict = dataclasses.field(default_factory=dict)
    metrics: dict = dataclasses.field(default_factory=dict)
    exit_choice: dict | None = None
    token_counts_source: str | None = None


def save_tuned(path: str | Path, model, tokenizer=None, *, settings: DecodeSettings,
               provenance: Provenance | None = None, state_dict: dict | None = None, token_counts=None,
               exit_adapter=None, dtype=None, adapter_state: dict | None = None) -> Path:
    """Save model (safetensors) + tokenizer + selfspec.json into `path`, atomically.

    settings: how the checkpoint decodes by default (`DecodeSettings`, E set; a fine-tune with a
    trimmed exit loss stores the V' its exit was trained on). provenance: where it came from
    (`Provenance`; default a tuned checkpoint with no record). state_dict: the weights to write when
    the module's own are sharded (FSDP); default its own. token_counts: (V,) token frequencies (of
    the training data) for a trimmed draft head.
    exit_adapter: an `ExitAdapter` trained for `settings.exit_layer`, saved beside the model;
    adapter_state: its weights when its own are sharded (FSDP), default its own.
    dtype: the torch dtype the weights and the exit adapter are written at, which config.json then
    names (a run that trained float32 master copies of a 16-bit model saves that model's dtype);
    None: as they are.

    Everything is written into a temporary sibling directory first and renamed into place at the end,
    so a crash leaves either the old checkpoint or the new one, never a mixture. A PEFT model is
    merged into plain weights first (the saved model needs no peft to load).
    """
    path, provenance = Path(path), provenance or Provenance()
    num_layers = count_layers(model)
    if settings.exit_layer is None or not 1 <= settings.exit_layer <= num_layers:
        raise CheckpointError(f"exit_layer = {settings.exit_layer} is outside 1..{num_layers} for this model")
    if settings.draft_vocab_size and token_counts is None:
        raise CheckpointError("draft_vocab_size needs token_counts (the ranking of the V' ids)")
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    if state_dict is not None:
        state_dict = _without_tied_copies(model, state_dict)
    if dtype is not None:
        weights = model.state_dict() if state_dict is None else state_dict
        if any(t.is_floating_point() and t.dtype != dtype for t in weights.values()):
            state_dict = _at_dtype(weights, dtype)
    with atomic_directory(path) as staging:  # written beside `path`, then renamed into place
        model.save_pretrained(staging, safe_serialization=True, state_dict=state_dict)
        if dtype is not None and model.dtype != dtype:  # save_pretrained named the model's own
            config = copy.deepcopy(model.config)
            config.dtype = str(dtype).removeprefix("torch.")
            config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        meta = {"format_version": FORMAT_VERSION, "kind": provenance.kind, **settings.to_json(),
                "base_model": provenance.base_model,
                "training": provenance.training, "metrics": provenance.metrics,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if token_counts is not None:
            meta["token_counts"] = _write_token_counts(staging, token_counts, provenance.token_counts_source)
        if exit_adapter is not None:
            save_exit_adapter(exit_adapter, staging, dtype, adapter_state)
            meta["exit_adapter"] = {"exit_layer": settings.exit_layer, "file": ADAPTER_FILE,
                                    **exit_adapter.shape}
        choice = provenance.exit_choice
        if choice is not None:
            candidates = {str(e): v for e, v in choice["candidates"].items()}
            meta["exit_choice"] = {**choice, "candidates": candidates}
        write_json_atomic(staging / META_FILE, meta)
    return path


def _at_dtype(state_dict: dict, dtype) -> dict:
    """`state_dict` with its floating tensors cast to `dtype`; tensors that shared their memory (tied
    weights) still do, so that save_pretrained writes a tied weight once."""
    cast = {}
    out = {}
    for name, tensor in state_dict.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
            if key not in cast:
                cast[key] = tensor.to(dtype)
            tensor = cast[key]
        out[name] = tensor
    return out


def read_meta(path: str | Path) -> dict:
    """The selfspec.json of a checkpoint directory (CheckpointError when missing or malformed)."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{str(path)!r} has no {META_FILE}; "
                              f"pass a directory written by `selfspec train` "
                              f"or use SelfSpecGenerator(model, tokenizer, exit_layer=E) for other models")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path} is not valid JSON ({exc.msg}); re-save the checkpoint") from None
    if meta.get("format_version") != FORMAT_VERSION or "exit_layer" not in meta:
        raise CheckpointError(f"{meta_path} has format_version {meta.get('format_version')!r}; "
                              f"this selfspec reads version {FORMAT_VERSION}")
    return meta


def update_meta(path: str | Path, **fields) -> dict:
    """Merge fields into a checkpoint's selfspec.json (decode settings go through `write_settings`)."""
    meta = read_meta(path)
    meta.update(fields)
    write_json_atomic(Path(path) / META_FILE, meta)
    return meta


def read_settings(path: str | Path, meta: dict | None = None) -> DecodeSettings:
    """The checkpoint's decode settings (selfspec.json's top level); CheckpointError when malformed."""
    meta = read_meta(path) if meta is None else meta
    try:
        return DecodeSettings.from_json({key: meta[key] for key in SETTINGS_FIELDS if key in meta})
    except ValueError as exc:
        raise CheckpointError(f"{Path(path) / META_FILE}: {exc}") from None


def fastest_settings(path: str | Path, meta: dict | None = None,
                     constraint_kind: str | None = None) -> dict[str, DecodeSettings]:
    """{drafter: settings} of each drafter at its fastest, as a sweep stored them (empty without one);
    with `constraint_kind`, as a sweep under constraints of that kind stored them in `formats`."""
    meta = read_meta(path) if meta is None else meta
    try:
        own = read_settings(path, meta)
        entries = (meta.get("fastest", {}) if constraint_kind is None
                   else meta.get("formats", {}).get(constraint_kind, {}).get("fastest", {}))
        return {drafter: DecodeSettings.from_json(entry["settings"]) if "settings" in entry
                else _flat_fastest(entry, own) for drafter, entry in entries.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{Path(path) / META_FILE}: bad \"fastest\" entry ({exc}); re-run "
                              f"`selfspec eval sweep --write-back`") from None


def sweep_candidates(path: str | Path, meta: dict | None = None,
                     constraint_kind: str | None = None) -> list[tuple[str, DecodeSettings, float]]:
    """The cells the last `selfspec eval sweep --write-back` re-timed, as (drafter, settings, the
    sweep's speedup), fastest first; with `constraint_kind`, those of a sweep under such constraints.
    A CheckpointError when no sweep stored them."""
    meta = read_meta(path) if meta is None else meta
    record = (meta.get("sweep") if constraint_kind is None
              else meta.get("formats", {}).get(constraint_kind)) or {}
    if "candidates" not in record:
        raise CheckpointError(f"{Path(path) / META_FILE} holds no re-timed sweep cells; run `selfspec eval "
                              f"sweep --model {path} --write-back` first")
    try:
        return [(entry["drafter"], DecodeSettings.from_json(entry["settings"]), float(entry["speedup"]))
                for entry in record["candidates"]]
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{Path(path) / META_FILE}: bad sweep candidates ({exc}); re-run "
                              f"`selfspec eval sweep --write-back`") from None


def format_settings(path: str | Path, meta: dict | None = None) -> dict[str, DecodeSettings]:
    """{kind: settings}: what calls under a constraint of that kind ("json_schema", "regex", "lark"),
    sampled calls ("sampled@T") and greedy decodes past T tokens of context ("context@T") decode with,
    as sweeps stored them (empty without one)."""
    meta = read_meta(path) if meta is None else meta
    try:
        return {kind: DecodeSettings.from_json(entry["settings"])
                for kind, entry in meta.get("formats", {}).items()}
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{Path(path) / META_FILE}: bad \"formats\" entry ({exc}); re-run "
                              f"`selfspec eval sweep --write-back` with the sweep that stored it") from None


def _flat_fastest(entry: dict, own: DecodeSettings) -> DecodeSettings:
    """A "fastest" entry as sweeps wrote it before `DecodeSettings` (flat: drafter, exit_layer,
    num_speculations, vocab, min_ngram; 0 meant "none"), on top of the checkpoint's own settings."""
    drafter, min_ngram = entry["drafter"], entry.get("min_ngram") or None
    if drafter == "ngram":  # it had no E, k or V' of its own
        return own.override(drafter="ngram", min_ngram=min_ngram)
    return own.override(drafter=drafter, exit_layer=entry.get("exit_layer") or None,
                        num_speculations=entry.get("num_speculations"),
                        draft_vocab_size=entry.get("vocab", 0),
                        min_ngram=min_ngram if drafter == "hybrid" else None)


def resolve_settings(path: str | Path, constraint_kind: str | None = None,
                     **overrides) -> tuple[DecodeSettings, dict[str, DecodeSettings], object]:
    """How to decode the model at `path`: (settings, each drafter's fastest, token counts or None).

    settings: the checkpoint's own (a plain model directory without selfspec.json: the defaults),
    with `overrides` (`DecodeSettings.override`'s keywords; None keeps a field) applied. The fastest
    settings a sweep stored count only when nothing is overridden: a flag means the user's setting.
    constraint_kind: the calls decode under constraints of that kind ("json_schema", ...): a sweep's
    `formats` entry for it, when there is one, takes the place of the checkpoint's own and fastest.
    """
    has_meta = (Path(path) / META_FILE).is_file()
    meta = read_meta(path) if has_meta else {}
    overridden = any(value is not None for value in overrides.values())
    formats = format_settings(path, meta) if has_meta and not overridden else {}
    if constraint_kind in formats:
        settings, fastest = formats[constraint_kind], fastest_settings(path, meta, constraint_kind)
    else:
        settings = (read_settings(path, meta) if has_meta else DecodeSettings()).override(**overrides)
        fastest = fastest_settings(path, meta) if has_meta and not overridden else {}
    sizes = [settings.draft_vocab_size, *(s.draft_vocab_size for s in fastest.values())]
    return settings, fastest, token_counts_for(path, max(sizes)) if has_meta else None


def write_settings(path: str | Path, settings: DecodeSettings, **fields) -> dict:
    """Make `settings` the checkpoint's default decode settings, with other selfspec.json fields
    (a sweep's "fastest" and "sweep"); returns the new selfspec.json."""
    return update_meta(path, **settings.to_json(), **fields)


def _write_token_counts(directory: Path, counts, source: str | None) -> dict:
    """Write token_counts.safetensors into `directory` atomically; the summary for selfspec.json."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    counts = torch.as_tensor(np.asarray(counts, dtype=np.int64))
    if counts.dim() != 1 or counts.numel() == 0 or bool((counts < 0).any()):
        raise CheckpointError("token counts must be a non-empty 1-D array of counts >= 0")
    with atomic_file(directory / TOKEN_COUNTS_FILE) as tmp:
        save_file({"counts": counts}, str(tmp))
    return {"source": source, "tokens": int(counts.sum()), "vocab_size": counts.numel()}


def save_token_counts(path: str | Path, counts, source: str | None = None) -> dict:
    """Store token frequencies (V,) in an existing checkpoint (for a trimmed draft head); returns the
    summary recorded in its selfspec.json ({source, tokens, vocab_size})."""
    read_meta(path)  # a checkpoint, or a clear error
    summary = _write_token_counts(Path(path), counts, source)
    update_meta(path, token_counts=summary)
    return summary


def read_token_counts(path: str | Path):
    """The checkpoint's token frequencies (V,) as int64 NumPy, or None when it has none."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    file = Path(path) / TOKEN_COUNTS_FILE
    if not file.is_file():
        return None
    try:
        return load_file(str(file))["counts"]
    except (SafetensorError, KeyError, OSError) as exc:
        raise CheckpointError(f"{file} is damaged ({exc}); "
                              f"recount it with `selfspec draft-vocab {path}`") from None


def token_counts_for(path: str | Path, size: int | None):
    """The checkpoint's token counts (or None), which a draft head of V' = `size` ids needs: a
    CheckpointError that says how to count them when `size` > 0 and they are missing."""
    counts = read_token_counts(path)
    if size and counts is None:
        raise CheckpointError(f"draft_vocab_size = {size} needs {TOKEN_COUNTS_FILE} in {path}; count it with "
                              f"`selfspec draft-vocab {path}`")
    return counts


def draft_vocab(path: str | Path, size: int | None):
    """The token ids of a V'-token draft head from the checkpoint's counts (None: the whole head)."""
    if not size:
        return None
    from .decoding.draft_head import frequent_tokens

    return frequent_tokens(token_counts_for(path, size), int(size))


def load_tuned(path: str | Path, device: str = "auto", dtype: str = "auto",
               settings: DecodeSettings | None = None, *, backend: str | None = None,
               static_passes: str | None = None, **overrides):
    """Load a checkpoint as a `SelfSpecGenerator` ready for lossless fast generation.

    A tuned checkpoint decodes with `settings`, by default its own (what `selfspec eval sweep
    --write-back` stored), and calls under a constraint with its `formats` entry for that kind when
    the caller sets nothing (`format_settings`). Any other Hugging Face causal LM (a directory
    without selfspec.json, or a hub id) loads too: it decodes with `settings` or the keywords, else
    with copies from the context (the drafter that is never slower than plain decoding), and a
    warning says so. Other keywords override single fields, as `DecodeSettings.override` takes them
    (exit_layer, num_speculations, drafter, draft_vocab_size, stop_below, min_ngram, overlap, fused; None
    keeps a field; draft_vocab_size 0: the whole head). device: "auto" is
    CUDA when there is one, else the CPU. static_passes: "graph" runs the decoding passes at fixed
    shapes captured as CUDA graphs ("eager": the same passes as written); backend:
    "reference", "cpu_kernels" or "static" (None or "auto": the default); see `SelfSpecGenerator`.
    """
    import torch

    from .decoding import SelfSpecGenerator
    from .model.loading import load_causal_lm, load_tokenizer

    if settings is not None and not isinstance(settings, DecodeSettings):
        raise CheckpointError(f"load_tuned(path, device, dtype, settings): settings must be a "
                              f"DecodeSettings, got {settings!r}; pass the other fields as keywords")
    tuned = (Path(path) / META_FILE).is_file()
    meta = read_meta(path) if tuned else {}
    told = settings is not None or any(v is not None for v in overrides.values())
    untold = (not tuned and settings is None
              and all(overrides.get(name) is None for name in ("exit_layer", "drafter")))
    # a sweep's settings for constrained calls count only when the caller set nothing
    formats = format_settings(path, meta) if tuned and not told else {}
    if settings is None:  # the checkpoint's own; a plain model's: copies, or the early exit when told
        settings = (read_settings(path, meta) if tuned
                    else DecodeSettings(drafter="ngram" if untold else "early_exit"))
    settings = settings.override(**overrides)
    counts = token_counts_for(path, max([settings.draft_vocab_size,
                                         *(s.draft_vocab_size for s in formats.values())]))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"

    def model_and_adapters():
        # on a thread that ends, so that the caller's thread holds no OpenMP team afterwards and may
        # decode at full speed from any thread (`cpu.on_a_thread_that_ends`)
        model = load_causal_lm(str(path), dtype=dtype, device=device, huge_pages=True).eval()
        return model, checkpoint_adapters(path, model, meta)

    model, adapters = on_a_thread_that_ends(model_and_adapters)
    if untold:  # said once the model is there: a path that holds none gets only that error
        warnings.warn(f"{path} has no {META_FILE} (not tuned by selfspec): decoding with copies from the "
                      f"context; pass exit_layer=E to draft with the early exit", stacklevel=2)
    local = Path(path).is_dir()
    tokenizer = (load_tokenizer(str(path)) if not local or (Path(path) / "tokenizer_config.json").is_file()
                 else None)
    generator = SelfSpecGenerator(model, tokenizer, settings, token_counts=counts, exit_adapters=adapters,
                                  format_settings=formats, static_passes=static_passes, backend=backend)
    generator.round_costs = read_round_costs(meta, torch.device(device).type)
    return generator


def read_round_costs(meta: dict, device_type: str):
    """The `RoundCosts` a sweep measured on this device type (selfspec.json's `round_costs`), or None."""
    from .decoding import RoundCosts

    entry = meta.get("round_costs", {}).get(device_type)
    return None if entry is None else RoundCosts.from_json(entry)


def _without_tied_copies(model, state_dict: dict) -> dict:
    """`state_dict` less each name under which `model` holds a parameter it holds under an earlier name
    too (a head tied to the embedding): a gathered state dict (FSDP's) has a copy under every name, which
    `save_pretrained` would write as a head of its own."""
    seen, tied = set(), set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            tied.add(name)
        seen.add(id(parameter))
    return {name: value for name, value in state_dict.items() if name not in tied}


def checkpoint_adapters(path: str | Path, model, meta: dict | None = None) -> dict:
    """{E: adapter} of the exit adapter (`ExitAdapter` or `ExitBlock`) a checkpoint holds, on
    `model`'s device and dtype (empty without one, or for a plain model directory): the draft at
    that E reads it, another E drafts through the plain exit."""
    if meta is None:
        meta = read_meta(path) if (Path(path) / META_FILE).is_file() else {}
    entry = meta.get("exit_adapter")
    if not entry:
        return {}
    if not (Path(path) / ADAPTER_FILE).is_file():
        raise CheckpointError(f"{path} names an exit adapter but {ADAPTER_FILE} is missing; "
                              f"re-save the checkpoint")
    weight = next(model.parameters())
    return {entry["exit_layer"]: load_exit_adapter(path, entry, model, device=weight.device,
                                                   dtype=weight.dtype)}
