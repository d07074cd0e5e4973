"""The shipped recipes and the user cache: `--config` takes a name from any directory or a file, and
`selfspec recipes` lists what ships."""

from __future__ import annotations

from pathlib import Path

import pytest

from selfspec import recipes
from selfspec.cli import main
from selfspec.config import load_config, to_dict
from selfspec.files import cache_dir
from selfspec.training.loop import _trains_alike


def test_every_shipped_recipe_has_a_one_line_purpose_and_is_listed(capsys):
    shipped = recipes.shipped()
    names = {r.name for r in shipped}
    assert {"demo_finetune", "embedded_base", "smollm2-135m_chat", "accelerate/ddp"} <= names
    assert all(r.purpose and len(r.purpose) < 100 and "\n" not in r.purpose for r in shipped)
    assert main(["recipes"]) == 0
    listed = capsys.readouterr().out
    assert all(r.name in listed and r.purpose in listed for r in shipped)


def test_a_name_finds_the_shipped_file_from_any_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert recipes.find("demo_finetune") == recipes.find("demo_finetune.yaml") == \
        recipes.RECIPE_DIR / "demo_finetune.yaml"
    assert load_config("demo_finetune").output_dir == "runs/demo"  # outputs under ./runs
    assert main(["recipes", "--path", "accelerate/fsdp"]) == 0
    assert capsys.readouterr().out.strip() == str(recipes.RECIPE_DIR / "accelerate" / "fsdp.yaml")
    assert main(["recipes", "--path", "demo_finetun"]) == 2
    assert "did you mean demo_finetune?" in capsys.readouterr().err


def test_a_file_of_the_users_own_wins_and_keeps_its_base_beside_it(tmp_path, monkeypatch):
    """A copy of a shipped recipe (`selfspec recipes --path NAME`) edited in the user's directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo_finetune.yaml").write_text("base: common.yaml\noptim:\n  lr: 5.0e-4\n")
    (tmp_path / "common.yaml").write_text("optim:\n  max_steps: 7\n")
    cfg = load_config("demo_finetune.yaml")
    assert (cfg.optim.lr, cfg.optim.max_steps) == (5e-4, 7)


def test_the_cache_is_the_users_and_an_environment_variable_moves_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SELFSPEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "selfspec"
    monkeypatch.setenv("SELFSPEC_CACHE_DIR", str(tmp_path / "mine"))
    assert load_config(None).data.cache_path == tmp_path / "mine"
    assert load_config(None, [f"data.cache_dir={tmp_path}/run"]).data.cache_path == tmp_path / "run"
    assert to_dict(load_config(None))["data"]["cache_dir"] is None  # selfspec.json holds no machine path


def test_a_trained_run_is_reused_wherever_the_cache_lives():
    a = to_dict(load_config("demo_finetune"))
    moved = to_dict(load_config("demo_finetune", ["data.cache_dir=/elsewhere"]))
    assert _trains_alike(a, moved)
    assert not _trains_alike(a, to_dict(load_config("demo_finetune", ["optim.max_steps=3"])))


def test_a_run_stored_before_a_config_field_existed_is_reused_at_that_fields_default():
    current = to_dict(load_config("embedded_base"))
    stored = {**current, "data": {k: v for k, v in current["data"].items()
                                  if k not in ("short_block_size", "short_fraction")}}
    assert _trains_alike(stored, current)  # the field's default is what that run trained with
    mixed = to_dict(load_config("embedded_base", ["data.block_size=512", "data.short_block_size=256"]))
    assert not _trains_alike(stored, mixed)
    assert not _trains_alike({**stored, "seed": 1}, current)
    # a nested section filled alike; a section stored as None, or no config at all, is not the current one
    arch = {k: v for k, v in current["model"]["arch"].items() if k != "tie_word_embeddings"}
    assert _trains_alike({**stored, "model": {**current["model"], "arch": arch}}, current)
    assert not _trains_alike({**stored, "data": None}, current)
    assert not _trains_alike({}, current)


def test_a_recipe_of_mixed_lengths_overridden_to_short_blocks_cuts_none():
    # a quick run of the demo's recipe on short blocks needs no second override
    cfg = load_config("demo_finetune", ["data.block_size=32"])
    assert cfg.data.short_block_size == 256 and cfg.data.cut_length is None
    assert load_config("demo_finetune").data.cut_length == 256
    assert load_config("demo_finetune", ["data.short_fraction=0"]).data.cut_length is None


@pytest.mark.parametrize("command", ["train", "pretrain"])
def test_the_training_commands_take_a_recipe_overrides_and_an_output_dir(command, tmp_path, monkeypatch):
    """What the commands hand the loop: the recipe, then the overrides, then --output-dir."""
    from selfspec.training import runs as commands

    class Handed(Exception):
        pass

    seen = {}

    def loop(cfg, **kwargs):
        seen["cfg"] = cfg
        raise Handed

    monkeypatch.setattr(commands, "train", loop)
    monkeypatch.setattr(commands, "train_or_reuse", loop)
    with pytest.raises(Handed):
        main([command, "--config", "embedded_base", "optim.max_steps=3", "--output-dir", str(tmp_path / "o"),
              "seed=4"])
    cfg = seen["cfg"]
    assert (cfg.optim.max_steps, cfg.seed, cfg.output_dir) == (3, 4, str(tmp_path / "o"))


def test_the_demo_sweeps_the_exits_its_recipe_trains():
    """The demo's fine-tune trains exits at candidate layers; its sweep then tries each of them (or,
    with offsets, those around `exit_layer` only: the SmolLM2 demo's smaller grid)."""
    from selfspec.demo import sweep_exit_layers

    cfg = load_config("demo_finetune")
    assert sweep_exit_layers(cfg, 12) == [3, 4, 6]
    assert sweep_exit_layers(load_config("demo_finetune", ["early_exit.layers=2:5"]), 12) == [2, 3, 4, 6]
    assert sweep_exit_layers(load_config("demo_finetune", ["early_exit.layers=4"]), 12) == [4, 6]  # one int
    assert sweep_exit_layers(cfg, 12, offsets=(0,)) == [6]
    assert sweep_exit_layers(cfg, 12, offsets=(-3, 0, 7)) == [3, 6]  # past the last block: left out


REPO = Path(__file__).resolve().parents[1]
ENTRY_SCRIPTS = sorted(p for folder in ("train", "data", "eval") for p in (REPO / folder).glob("*.py"))


def test_the_package_list_is_every_package_on_disk_and_the_configs_ship_inside_it():
    """pyproject.toml names its packages (the top-level configs/ folder installs as `selfspec.configs`,
    which a package search would not find): a new subpackage left off the list would be missing from
    the wheel."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(REPO).parts)
               for p in (REPO / "selfspec").rglob("__init__.py")}
    assert set(project["packages"]) == on_disk | {"selfspec.configs"}
    assert project["package-dir"] == {"selfspec.configs": "configs"}
    assert recipes.RECIPE_DIR.resolve() == (REPO / "configs").resolve()  # this checkout's, installed editable
    configs = REPO / "configs"
    assert {r.name for r in recipes.shipped()} == {
        p.relative_to(configs).with_suffix("").as_posix() for p in configs.rglob("*.yaml")}


def test_a_checkout_takes_a_configs_path_and_its_entry_scripts_run(monkeypatch, capsys):
    """From the checkout's root: `--config configs/NAME.yaml`, and every script of train/, data/ and
    eval/ answers --help (each a few lines over the package's command)."""
    import runpy

    monkeypatch.chdir(REPO)
    assert load_config("configs/demo_finetune.yaml") == load_config("demo_finetune")
    assert {p.parent.name for p in ENTRY_SCRIPTS} == {"train", "data", "eval"}
    assert len(ENTRY_SCRIPTS) >= 10
    for script in ENTRY_SCRIPTS:
        monkeypatch.setattr("sys.argv", [str(script), "--help"])
        with pytest.raises(SystemExit) as stop:
            runpy.run_path(str(script), run_name="__main__")
        assert stop.value.code in (0, None), script
        assert "usage:" in capsys.readouterr().out, script
