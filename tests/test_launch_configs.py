"""The shipped accelerate launch configs, read by accelerate's own parser, and the launch checks."""

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from helpers import tiny_model

from selfspec import recipes
from selfspec.errors import UserError
from selfspec.training.launch import check_launch, check_wrap_classes
from selfspec.training.objective import SelfSpecObjective


def launch_config(name: str):
    return load_config_from_file(str(recipes.find(f"accelerate/{name}")))


def test_every_shipped_launch_config_parses_with_accelerates_own_reader():
    names = sorted(r.name for r in recipes.shipped() if r.name.startswith("accelerate/"))
    assert names == ["accelerate/ddp", "accelerate/fsdp", "accelerate/multinode", "accelerate/single",
                     "accelerate/zero2", "accelerate/zero3"]
    for name in names:
        cfg = load_config_from_file(str(recipes.find(name)))
        assert cfg.compute_environment.value == "LOCAL_MACHINE", name
        assert cfg.num_processes >= cfg.num_machines >= 1, name


def test_the_sharded_configs_ask_for_what_their_names_say():
    ddp, fsdp = launch_config("ddp"), launch_config("fsdp")
    assert ddp.distributed_type.value == "MULTI_GPU" and ddp.num_processes == 8
    assert fsdp.distributed_type.value == "FSDP"
    assert fsdp.fsdp_config["fsdp_version"] == 2
    assert fsdp.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"  # resume from the shards
    assert fsdp.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    # accelerate requires every class named to be in the model: no list, the model's own class
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp.fsdp_config
    for name, stage in (("zero2", 2), ("zero3", 3)):
        cfg = launch_config(name)
        assert cfg.distributed_type.value == "DEEPSPEED", name
        assert cfg.deepspeed_config["zero_stage"] == stage, name
        assert str(getattr(cfg.mixed_precision, "value", cfg.mixed_precision)) == "bf16", name
        # left to the recipe (optim.grad_accum, optim.grad_clip): a value here would win over it
        assert not {"gradient_accumulation_steps", "gradient_clipping"} & set(cfg.deepspeed_config), name
    # ZeRO-3's tuned checkpoint: DeepSpeed gathers full 16-bit weights for get_state_dict
    assert launch_config("zero3").deepspeed_config["zero3_save_16bit_model"] is True


def test_the_multinode_config_names_two_machines_and_a_static_rendezvous():
    cfg = launch_config("multinode")
    assert (cfg.num_machines, cfg.machine_rank, cfg.rdzv_backend) == (2, 0, "static")
    assert cfg.main_process_ip and cfg.main_process_port
    assert cfg.num_processes % cfg.num_machines == 0  # every machine the same number of GPUs


@pytest.mark.parametrize("env, has_gpu, gpus, message", [
    ({"ACCELERATE_USE_FSDP": "true"}, False, 0, r"asks for FSDP, which accelerate runs on GPUs only"),
    ({"LOCAL_WORLD_SIZE": "8"}, True, 2, r"starts 8 processes on this machine, which has 2 GPUs"),
])
def test_a_launch_this_machine_cannot_run_is_one_line(env, has_gpu, gpus, message):
    with pytest.raises(UserError, match=message):
        check_launch(has_gpu, gpus, env)


def test_deepspeed_without_the_extra_is_one_line(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"deepspeed is not installed; pip install 'selfspec\[deepspeed\]'"):
        check_launch(True, 8, {"ACCELERATE_USE_DEEPSPEED": "true"})


def test_a_launch_the_machine_can_run_passes():
    check_launch(False, 0, {"LOCAL_WORLD_SIZE": "2"})  # gloo DDP on CPUs
    check_launch(True, 8, {"ACCELERATE_USE_FSDP": "true", "LOCAL_WORLD_SIZE": "8"})


def test_an_fsdp_layer_class_the_model_lacks_is_one_line_and_its_own_is_the_default():
    model = tiny_model("llama", num_layers=2)
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_TRANSFORMER_CLS_TO_WRAP": "Qwen2DecoderLayer"}
    with pytest.raises(UserError, match=r"names Qwen2DecoderLayer, which this model does not have; use "
                                        r"LlamaDecoderLayer"):
        check_wrap_classes(model, env)
    check_wrap_classes(model, {**env, "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"})
    # what accelerate wraps when the config names no class: the objective passes on the model's own
    assert SelfSpecObjective(model)._no_split_modules == ["LlamaDecoderLayer"]
