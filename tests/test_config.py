"""The config schema: YAML loading, a.b=value overrides, and one-line errors that say how to fix them."""


import pytest

from selfspec import recipes
from selfspec.config import (
    ArchConfig,
    ConfigError,
    DataConfig,
    EarlyExitConfig,
    LayerDropoutConfig,
    LoraSettings,
    OptimConfig,
    RunConfig,
    load_config,
    to_dict,
)

CONFIGS = sorted(recipes.RECIPE_DIR.glob("*.yaml"))  # the shipped training recipes


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_without_a_file():
    cfg = load_config(None)
    assert isinstance(cfg, RunConfig)
    assert cfg.layer_dropout.p_max == 0.0 and cfg.optim.max_steps == 1000


def test_yaml_values_and_overrides(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 1e-3\n  max_steps: 10\nearly_exit:\n  layers: [2, 4]\n")
    cfg = load_config(path, ["optim.max_steps=20", "early_exit.layers=2:8:2", "layer_dropout.p_max=0.2",
                             "log_with=[jsonl, tensorboard]", "exit_layer=null"])
    assert cfg.optim.lr == 1e-3 and cfg.optim.max_steps == 20
    assert cfg.early_exit.layers == "2:8:2"
    assert load_config(None, ["early_exit.layers=6"]).early_exit.layers == 6
    assert cfg.layer_dropout.p_max == 0.2
    assert cfg.log_with == ["jsonl", "tensorboard"]
    assert cfg.exit_layer is None


def test_int_is_accepted_for_float_fields_but_not_the_reverse(tmp_path):
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0
    with pytest.raises(ConfigError, match=r"optim.max_steps = 1.5 is not allowed; expected an integer"):
        load_config(None, ["optim.max_steps=1.5"])


def test_unknown_key_names_the_closest_valid_key(tmp_path):
    # No key is close enough to 'learning_rat': the message lists the section's keys instead.
    with pytest.raises(ConfigError,
                       match=r"unknown config key 'optim.learning_rat'; valid keys: lr, weight_decay, "):
        load_config(None, ["optim.learning_rat=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lrr'; did you mean 'optim.lr'\?"):
        load_config(None, ["optim.lrr=1"])
    with pytest.raises(ConfigError,
                       match=r"unknown config key 'layer_dropout.pmax'; did you mean 'layer_dropout.p_max'"):
        load_config(write(tmp_path, "layer_dropout:\n  pmax: 0.2\n"))


@pytest.mark.parametrize("override, message", [
    ("layer_dropout.p_max=1.0", r"layer_dropout.p_max = 1.0 is not allowed; it must be in \[0, 1\)"),
    ("layer_dropout.depth_curve=cubic",
     r"layer_dropout.depth_curve = 'cubic' is not allowed; choose one of 'uniform', 'linear', 'exp'"),
    ("early_exit.kind=mse", r"early_exit.kind = 'mse' is not allowed; choose one of 'kl', 'ce', 'both'"),
    ("optim.batch_size=0", r"optim.batch_size = 0 is not allowed; it must be >= 1"),
    ("log_with=[jsonl, mlflow]",
     r"log_with = \['mlflow'\] is not allowed; choose from jsonl, tensorboard, wandb"),
    ("model.arch.num_heads=3",
     r"model.arch.hidden_size = 256 is not allowed; it must be a multiple of num_heads"),
    ("model.arch.num_kv_heads=0", r"model.arch.num_kv_heads = 0 is not allowed; it must be >= 1"),
    ("early_exit.token_fraction=0",
     r"early_exit.token_fraction = 0.0 is not allowed; it must be in \(0, 1\]"),
    ("cpu_threads=0", r"cpu_threads = 0 is not allowed; it must be >= 1, or null for all cores"),
    ("optim=3", r"optim must be a section"),
    ("optim.lr", r"override 'optim.lr' must look like section.field=value"),
])
def test_bad_values_name_field_value_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("build, message", [
    (lambda: OptimConfig(lr=-1), r"^lr = -1 is not allowed; it must be > 0$"),
    (lambda: EarlyExitConfig(kind="mse"), r"^kind = 'mse' is not allowed; choose one of 'kl', 'ce', 'both'"),
    (lambda: LayerDropoutConfig(p_max=1.0), r"^p_max = 1.0 is not allowed; it must be in \[0, 1\)$"),
    (lambda: EarlyExitConfig(draft_vocab_size=0), r"^draft_vocab_size = 0 is not allowed; it must be >= 1"),
    (lambda: DataConfig(block_size=1), r"^block_size = 1 is not allowed; it must be >= 2$"),
    (lambda: DataConfig(block_size=256, short_block_size=100),
     r"^short_block_size = 100 is not allowed; it must be >= 2 and divide block_size \(256\), or be at"),
    (lambda: DataConfig(short_fraction=1.5),
     r"^short_fraction = 1.5 is not allowed; it must be in \[0, 1\]$"),
    (lambda: RunConfig(trainable="adapter", data=DataConfig(block_size=512, short_block_size=256)),
     r"^data.short_block_size = 256 is not allowed; cached features were computed over whole blocks"),
    (lambda: ArchConfig(hidden_size=30, num_heads=8),
     r"^hidden_size = 30 is not allowed; it must be a multiple"),
    (lambda: LoraSettings(target_modules=[]),
     r"^target_modules = \[\] is not allowed; name at least one module$"),
    (lambda: RunConfig(trainable="adapter", layer_dropout=LayerDropoutConfig(p_max=0.2)),
     r"^layer_dropout.p_max = 0.2 is not allowed; trainable: adapter trains on the frozen model"),
    (lambda: RunConfig(choose_exit=True),
     r"^choose_exit = True is not allowed; it picks among the candidate exits"),
])
def test_a_section_built_in_python_checks_its_fields(build, message):
    """Each section checks its own ranges in __post_init__: the field is named as the section knows
    it, and a config file names it from the top (test_bad_values_name_field_value_and_what_is_allowed)."""
    with pytest.raises(ConfigError, match=message):
        build()


def test_a_valid_section_built_in_python_is_accepted():
    cfg = RunConfig(optim=OptimConfig(lr=1e-3), early_exit=EarlyExitConfig(layers="2:4"), choose_exit=True)
    assert to_dict(cfg) == to_dict(load_config(None, ["optim.lr=1e-3", "early_exit.layers=2:4",
                                                      "choose_exit=true"]))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="is neither a file nor a shipped recipe"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "optim: [unclosed\n"))
    with pytest.raises(ConfigError, match="mapping of fields at the top level"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_errors_are_one_line():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["early_exit.kind=mse"])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert to_dict(cfg)["optim"]["max_steps"] >= 1


def test_a_config_starts_from_its_base_section_by_section(tmp_path):
    (tmp_path / "common.yaml").write_text("optim:\n  lr: 1.0e-4\n  max_steps: 50\nseed: 3\n")
    child = write(tmp_path, "base: common.yaml\noptim:\n  lr: 5.0e-4\n")
    cfg = load_config(child, ["optim.batch_size=2"])
    assert (cfg.optim.lr, cfg.optim.max_steps, cfg.optim.batch_size, cfg.seed) == (5e-4, 50, 2, 3)


def test_base_errors_name_the_file(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="is its own base"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError,
                       match=r"config file '.*missing.yaml' \(the base of '.*c.yaml'\) does not exist"):
        load_config(write(tmp_path, "base: missing.yaml\n", name="c.yaml"))


def test_the_real_model_recipes_apply_layer_dropout_and_candidate_exits():
    from selfspec.config import parse_layers

    for name, layers in (("llama3.2-1b_full", 16), ("tinyllama-1.1b_full", 22), ("qwen2.5-0.5b_lora", 24),
                         ("qwen2.5-1.5b_lora", 28), ("smollm2-135m_chat", 30), ("smollm2-135m_cpu", 30)):
        cfg = load_config(name)
        candidates = parse_layers(cfg.early_exit.layers, layers)
        assert len(candidates) >= 4 and layers // 3 in candidates and cfg.choose_exit, name
        assert 0.15 <= cfg.layer_dropout.p_max <= 0.25 and cfg.layer_dropout.depth_curve == "exp", name
        ee = cfg.early_exit
        assert (ee.teacher, ee.token_fraction, cfg.trainable) == ("frozen", 1.0, "all")
        if name.startswith(("llama", "tinyllama", "qwen")):
            assert cfg.lora.enabled == name.endswith("lora") and cfg.output_dir == f"runs/{name}"


def test_the_adapter_recipes_train_an_exit_block_on_cached_features():
    """The CPU adapter recipe and its GPU counterpart keep the shape measured best on SmolLM2: a copy of
    the last block, the frozen model's next token as the target, features computed once."""
    for name, layers in (("smollm2-135m_adapter", 30), ("qwen2.5-1.5b-instruct_adapter", 28)):
        cfg = load_config(name)
        assert (cfg.trainable, cfg.adapter_kind, cfg.cache_features) == ("adapter", "block", True), name
        assert cfg.adapter_init_layer == layers - 1 and cfg.layer_dropout.p_max == 0.0, name
        ee = cfg.early_exit
        assert (ee.kind, ee.teacher, cfg.data.source) == ("argmax", "self", "sharegpt"), name
        assert int(cfg.early_exit.layers) == cfg.exit_layer <= layers // 3, name
