"""`selfspec export MODEL --draft OUT`: a tuned checkpoint's early exit as a standalone draft model.

Engines that serve with a separate draft model (Hugging Face's `generate(assistant_model=...)`,
llama.cpp's `--model-draft`, vLLM's `draft_model`) have no early-exit drafting. A selfspec exit is such
a draft: the first E blocks, the final norm and the LM head, plus, under the exit-block recipes, the
trained exit block(s) as further ordinary blocks of the same family. Written as a plain Hugging Face
checkpoint of the target's own architecture and tokenizer (the tokenizer's files copied byte for byte),
it loads with `AutoModelForCausalLM` and nothing of selfspec, and its logits are the exit's.

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
from .files import atomic_directory
from .model.exit_adapter import load_exit_adapter
from .model.loading import load_causal_lm
from .model.view import DecoderView

# the files of a checkpoint that make its tokenizer (Hugging Face's names), copied byte for byte
_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                    "*.model", "chat_template*")


def export_draft(model_dir: str | Path, out: str | Path, exit_layer: int | None = None,
                 force: bool = False) -> Path:
    """Write the exit of `model_dir` (a tuned checkpoint; E from its selfspec.json unless `exit_layer`)
    into `out` as a standalone Hugging Face model of the same family; returns `out`.

    The draft holds blocks [0, E) and then the checkpoint's exit block(s), if any, the final norm and
    the head, at the checkpoint's dtype. Refused with a UserError: an MLP exit adapter, E outside the
    model, an `out` that exists (unless `force`)."""
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
    with atomic_directory(out) as staging:
        draft.save_pretrained(staging, safe_serialization=True)
        tokenizer = {f for pattern in _TOKENIZER_FILES for f in model_dir.glob(pattern) if f.is_file()}
        for source in sorted(tokenizer):
            shutil.copyfile(source, staging / source.name)
    return out


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
    return f"{out}: a {config['model_type']} draft of {layers} blocks, {weights / 1e6:.1f}M parameters"


__all__ = ["describe", "export_draft"]
