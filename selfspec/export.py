"""`selfspec export MODEL --draft OUT`: a tuned checkpoint's early exit as a standalone draft model.

Engines that serve with a separate draft model (Hugging Face's `generate(assistant_model=...)`,
llama.cpp's `--model-draft`, vLLM's `draft_model`) have no early-exit drafting. A selfspec exit is such
a draft: the first E blocks, the final norm and the LM head, plus, under the exit-block recipes, the
trained exit block(s) as further ordinary blocks of the same family. Written as a plain Hugging Face
checkpoint of the target's own architecture and tokenizer (the tokenizer's files copied byte for byte),
it loads with `AutoModelForCausalLM` and nothing of selfspec, and its logits are the exit's.

With `gguf`, the draft (and with `gguf_target` the whole tuned model too) is also written as GGUF for
llama.cpp (`export_gguf.py`): `draft-<type>.gguf` and `target-<type>.gguf` in the same directory,
written by the same code so llama.cpp finds their vocabularies compatible for drafting.

`export.json` beside them says what the export is and what to expect of it in such an engine
(`separate_draft_estimate`): there the draft keeps its own KV cache and the target verifies with all
N blocks, so a draft step costs c = (E blocks + the exit blocks + the head) / (N blocks + the head) of
a target step, in weights read, and a round of k drafts E(k, α) / (1 + k·c) of plain decoding's time,
α the checkpoint's held-out agreement at E.

What cannot be written so is refused with the reason: an MLP exit adapter (`adapter.kind: mlp`) is no
block of the family. A trimmed draft head (V') is left out: the export drafts over the whole head, which
the exit's losses also trained (a full-vocabulary head whose other rows never win would need a bias of
-inf the family's heads do not have).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .checkpoint import META_FILE, read_meta
from .errors import UserError
from .export_gguf import check_gguf_exportable, gguf_file_name, write_gguf
from .files import atomic_directory, write_json_atomic
from .metrics import optimal_num_speculations, speedup_simple
from .model.exit_adapter import load_exit_adapter
from .model.loading import load_causal_lm
from .model.view import DecoderView

# the files of a checkpoint that make its tokenizer (Hugging Face's names), copied byte for byte
_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                    "*.model", "chat_template*")
EXPORT_FILE = "export.json"  # what the export is and what to expect of it (`separate_draft_estimate`)


def export_draft(model_dir: str | Path, out: str | Path, exit_layer: int | None = None,
                 force: bool = False, gguf: bool = False, gguf_type: str = "f32",
                 gguf_target: bool = False) -> Path:
    """Write the exit of `model_dir` (a tuned checkpoint; E from its selfspec.json unless `exit_layer`)
    into `out` as a standalone Hugging Face model of the same family; returns `out`.

    The draft holds blocks [0, E) and then the checkpoint's exit block(s), if any, the final norm and
    the head, at the checkpoint's dtype. With `gguf` it is also written as `out/draft-<gguf_type>.gguf`
    for llama.cpp, and with `gguf_target` (which implies `gguf`) the whole model as
    `out/target-<gguf_type>.gguf`. Refused with a UserError: an MLP exit adapter, E outside the model,
    an `out` that exists (unless `force`), a model or tokenizer llama.cpp's GGUF cannot carry."""
    model_dir, out = Path(model_dir), Path(out)
    meta = _meta(model_dir)
    exit_layer = exit_layer or meta.get("exit_layer")
    if out.exists() and not force:
        raise UserError(f"{out} exists: pass --force to replace it")
    model = load_causal_lm(str(model_dir), dtype="auto")
    view = DecoderView(model)
    if not isinstance(exit_layer, int) or not 1 <= exit_layer <= view.num_layers:
        raise UserError(f"exit layer must be an int in 1..{view.num_layers} (the blocks the draft runs), got "
                        f"{exit_layer!r}: pass --exit-layer E")
    blocks, init_layers = _exit_blocks(model_dir, meta, model, exit_layer)
    draft = _draft_model(model, view, exit_layer, blocks, init_layers)
    gguf = gguf or gguf_target
    if gguf:  # refuse before writing anything
        check_gguf_exportable(draft, model_dir, gguf_type)
    with atomic_directory(out) as staging:
        draft.save_pretrained(staging, safe_serialization=True)
        tokenizer = {f for pattern in _TOKENIZER_FILES for f in model_dir.glob(pattern) if f.is_file()}
        for source in sorted(tokenizer):
            shutil.copyfile(source, staging / source.name)
        if gguf:
            name = f"{model_dir.name} exit {exit_layer}" + (f" + {len(blocks)} exit block" if blocks else "")
            write_gguf(draft, model_dir, staging / gguf_file_name("draft", gguf_type), gguf_type, name=name)
        if gguf_target:
            write_gguf(model, model_dir, staging / gguf_file_name("target", gguf_type), gguf_type,
                       name=model_dir.name)
        estimate = separate_draft_estimate(meta, view, exit_layer, blocks)
        write_json_atomic(staging / EXPORT_FILE, {"source": str(model_dir), "exit_layer": exit_layer,
                                                  "exit_blocks": len(blocks), "num_layers": view.num_layers,
                                                  "gguf": sorted(f.name for f in staging.glob("*.gguf")),
                                                  "separate_draft": estimate})
    return out


def separate_draft_estimate(meta: dict, view: DecoderView, exit_layer: int, blocks: list) -> dict:
    """What an engine that drafts with a separate model (llama.cpp's --model-draft, Hugging Face's
    assistant_model, vLLM's draft_model) should get from this exit: {draft_cost, acceptance,
    num_speculations, predicted_speedup}; acceptance and after it None without a held-out agreement
    at E in the checkpoint's metrics.

    No KV reuse there: a draft step reads E blocks, the exit blocks and the whole head, the
    verification all N blocks and the head (one plain step at batch 1, bound by the weights read).
    So c is the weights' ratio and a round of k drafts yields E(k, α) tokens for 1 + k·c plain steps
    (`metrics.speedup_simple`), k the best in 1..8. An upper bound: it leaves out the draft's own
    passes over the accepted tokens and each engine's per-round overhead."""
    def size(module) -> int:
        return sum(p.numel() for p in module.parameters())

    head = view.lm_head.weight.numel()
    full = sum(size(block) for block in view.layers) + head
    cost = (sum(size(view.layers[i]) for i in range(exit_layer)) + sum(size(b) for b in blocks) + head) / full
    alpha = (meta.get("metrics") or {}).get(f"val/top1_agreement@{exit_layer}")
    estimate = {"draft_cost": cost, "acceptance": None, "num_speculations": None, "predicted_speedup": None}
    if alpha is not None:
        k, speedup = optimal_num_speculations(float(alpha), cost, 8, speedup_simple)
        estimate.update(acceptance=float(alpha), num_speculations=k, predicted_speedup=speedup)
    return estimate


def _meta(model_dir: Path) -> dict:
    """The checkpoint's selfspec.json; {} for a plain Hugging Face model (E must come from the caller).
    A selfspec.json that does not read is an error, never a reason to drop its exit block."""
    if (model_dir / META_FILE).is_file():
        return read_meta(model_dir)
    if not (model_dir / "config.json").is_file():
        raise UserError(f"no model at {model_dir} (no config.json there)")
    return {}


def _exit_blocks(model_dir: Path, meta: dict, model, exit_layer: int) -> tuple[list, list[int]]:
    """The exit block's layers trained for `exit_layer` (copies of the family's blocks) and the model
    blocks each was copied from; ([], []) without one."""
    shape = meta.get("exit_adapter")
    if not shape or shape.get("exit_layer") != exit_layer:
        return [], []
    if shape.get("kind", "mlp") != "block":
        raise UserError("this checkpoint's exit adapter is an MLP (adapter.kind: mlp), which is no block of "
                        "the model's family, so no other engine can run it: train an exit block "
                        "(adapter.kind: block) to export the exit, or pass another --exit-layer")
    adapter = load_exit_adapter(model_dir, shape, model, dtype=model.dtype)
    return list(adapter.layers), list(adapter.init_layers)


def _draft_model(model, view: DecoderView, exit_layer: int, blocks: list, init_layers: list[int]):
    """A model of `model`'s class whose blocks are `model`'s first E and then `blocks`."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    layers = exit_layer + len(blocks)
    attribute = "n_layer" if hasattr(config, "n_layer") else "num_hidden_layers"
    setattr(config, attribute, layers)
    if getattr(config, "layer_types", None) is not None:  # each block keeps its own attention kind
        kinds = list(model.config.layer_types)
        config.layer_types = kinds[:exit_layer] + [kinds[i] for i in init_layers]
    if hasattr(config, "max_window_layers"):
        config.max_window_layers = min(config.max_window_layers, layers)
    draft = type(model)(config).to(model.dtype).eval()
    prefix = _layers_prefix(model, view)
    state = {}
    for name, tensor in model.state_dict().items():
        if not name.startswith(prefix):
            state[name] = tensor
        elif int(name[len(prefix):].split(".", 1)[0]) < exit_layer:
            state[name] = tensor
    for index, block in enumerate(blocks):
        for name, tensor in block.state_dict().items():
            state[f"{prefix}{exit_layer + index}.{name}"] = tensor
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [m for m in missing if not _tied(draft, m)]
    if missing or unexpected:  # a family whose layout this does not know: better no file than a wrong one
        raise UserError(f"cannot export this {model.config.model_type} model's exit: weights missing "
                        f"{missing[:3]}, unexpected {unexpected[:3]}")
    return draft


def _layers_prefix(model, view: DecoderView) -> str:
    """The state-dict prefix of the blocks, e.g. "model.layers." or "transformer.h."."""
    for name, module in model.named_modules():
        if module is view.layers:
            return f"{name}."
    raise UserError(f"cannot find the blocks of this {model.config.model_type} model")


def _tied(model, name: str) -> bool:
    """Whether `name` is a weight tied to another (the head to the embedding), loaded through it."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return name in tied


def describe(out: str | Path) -> str:
    """One line on an exported draft: its family, blocks and parameters."""
    from safetensors import safe_open
    config = json.loads((Path(out) / "config.json").read_text())
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    weights = 0
    for file in sorted(Path(out).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            weights += sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    line = f"{out}: a {config['model_type']} draft of {layers} blocks, {weights / 1e6:.1f}M parameters"
    info = Path(out) / EXPORT_FILE
    estimate = json.loads(info.read_text()).get("separate_draft") if info.is_file() else None
    if estimate:
        line += f"; in an engine with a separate draft a draft step costs c = {estimate['draft_cost']:.2f}"
        if estimate["acceptance"] is None:
            line += " of a target step (no held-out α in the checkpoint: selfspec doctor on it measures one)"
        elif estimate["num_speculations"]:
            line += (f", so at its held-out α = {estimate['acceptance']:.2f} expect up to "
                     f"{estimate['predicted_speedup']:.2f}x at k = {estimate['num_speculations']}")
        else:
            line += f", too much at its held-out α = {estimate['acceptance']:.2f}: no k beats plain decoding"
    return line


__all__ = ["EXPORT_FILE", "describe", "export_draft", "separate_draft_estimate"]
