"""The generated DeepSpeed config, by value, for each option."""

import json

import pytest

from fitone.config import TrainConfig
from fitone.ds_config import BUCKET_SIZE, build_ds_config
from fitone.errors import ConfigError
from fitone.run import resolve_planned


def ds_for(cfg: TrainConfig, *, micro_batch: int, world_size: int = 1, total_steps: int | None = None,
           on_gpu: bool = True) -> dict:
    """The DeepSpeed config of the tiny T5 with these settings, as planned for a GPU (or the CPU)."""
    cfg = cfg.replace(model="t5-tiny", from_scratch=True, device="auto" if on_gpu else "cpu")
    run = resolve_planned(cfg, world_size).with_batch(micro_batch)
    return build_ds_config(run if total_steps is None else run.with_steps(total_steps))


def test_default_is_the_blogs_zero2_offload_fp16_recipe():
    ds = ds_for(TrainConfig(lr=3e-5), micro_batch=20)
    assert ds["train_micro_batch_size_per_gpu"] == 20
    assert ds["gradient_accumulation_steps"] == 1 and ds["train_batch_size"] == 20
    zero = ds["zero_optimization"]
    assert zero["stage"] == 2
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == BUCKET_SIZE == 2e8
    assert zero["overlap_comm"] is True and zero["contiguous_gradients"] is True
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}
    assert "bf16" not in ds
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                           "weight_decay": 0.0}}
    assert "scheduler" not in ds
    assert ds["gradient_clipping"] == 1.0


def test_precisions():
    assert ds_for(TrainConfig(precision="bf16"), micro_batch=1)["bf16"] == {"enabled": True}
    fp32 = ds_for(TrainConfig(precision="fp32"), micro_batch=1)
    assert "fp16" not in fp32 and "bf16" not in fp32


def test_offload_none_and_cpu_machine():
    assert "offload_optimizer" not in ds_for(TrainConfig(offload="none"), micro_batch=1)["zero_optimization"]
    cpu = ds_for(TrainConfig(precision="fp32"), micro_batch=1, on_gpu=False)["zero_optimization"]
    assert cpu["offload_optimizer"]["pin_memory"] is False and cpu["overlap_comm"] is False


def test_accumulation_and_world_size():
    ds = ds_for(TrainConfig(global_batch=128), micro_batch=16, world_size=2)
    assert ds["gradient_accumulation_steps"] == 4 and ds["train_batch_size"] == 128
    ds = ds_for(TrainConfig(grad_accum=3), micro_batch=5)
    assert ds["gradient_accumulation_steps"] == 3 and ds["train_batch_size"] == 15


def test_schedules():
    warm = ds_for(TrainConfig(warmup_steps=10, lr=1e-3), micro_batch=1)["scheduler"]
    assert warm == {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                  "warmup_num_steps": 10, "warmup_type": "linear"}}
    lin = ds_for(TrainConfig(lr_schedule="linear", warmup_steps=10), micro_batch=1, total_steps=500)
    assert lin["scheduler"]["type"] == "WarmupDecayLR" and lin["scheduler"]["params"]["total_num_steps"] == 500
    cos = ds_for(TrainConfig(lr_schedule="cosine", warmup_steps=10), micro_batch=1, total_steps=500)
    assert cos["scheduler"] == {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 500, "warmup_min_ratio": 0.0, "warmup_num_steps": 10, "cos_min_ratio": 0.0,
        "warmup_type": "linear"}}


def test_the_cosine_schedule_warms_up_then_follows_half_a_cosine_to_zero():
    """DeepSpeed's WarmupCosineLR with the generated parameters, stepped as the engine steps it."""
    import math

    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    params = ds_for(TrainConfig(lr_schedule="cosine", warmup_steps=4, lr=1e-3), micro_batch=1,
                             total_steps=24)["scheduler"]["params"]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = WarmupCosineLR(opt, **params)
    lrs = []
    for _ in range(24):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # DeepSpeed's schedulers (the linear one too) give lr 0 for the first two steps, then warm up linearly
    assert lrs[:5] == pytest.approx([0.0, 0.0, 2.5e-4, 5e-4, 7.5e-4])
    expected = [1e-3 * (1 + math.cos(math.pi * (k + 1) / 20)) / 2 for k in range(19)]
    assert lrs[5:] == pytest.approx(expected, abs=1e-12)  # half a cosine over the 20 steps after the warm-up
    assert lrs[-1] < 1e-5


def test_user_file_merges_deeply(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 5e7}, "gradient_clipping": 0.5}))
    ds = ds_for(TrainConfig(ds_config=str(f)), micro_batch=2)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 5e7
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"  # untouched keys stay
    assert ds["gradient_clipping"] == 0.5


@pytest.mark.parametrize("content,fragment", [
    ("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), ('{"gradient_cliping": 1}', "gradient_clipping"),
    ('{"zero_optimization": {"overlap_comn": true}}', "overlap_comm"),
    ('{"zero_optimization": {"stage": 3}}', "stage 2"),
])
def test_user_file_errors(tmp_path, content, fragment):
    f = tmp_path / "ds.json"
    f.write_text(content)
    with pytest.raises(ConfigError, match=fragment):
        ds_for(TrainConfig(ds_config=str(f)), micro_batch=2)


# -- which optimizer step a run takes ----------------------------------------------------------------
def _mode(world_size: int = 1, on_gpu: bool = True, **options) -> str:
    cfg = TrainConfig(model="t5-tiny", from_scratch=True, device="auto" if on_gpu else "cpu", **options)
    return resolve_planned(cfg, world_size).mode.name


def test_the_pipelined_update_is_the_default_on_one_gpu_with_the_optimizer_on_the_cpu():
    assert _mode() == "pipelined"
    assert _mode(world_size=2) == "deepspeed"  # several ranks: opt-in until a GPU measurement exists
    assert _mode(on_gpu=False) == "deepspeed"  # nothing on a GPU to overlap the CPU Adam with
    assert _mode(offload="none") == "deepspeed"  # no CPU optimizer step to move
    assert _mode(pipelined_update=False) == "deepspeed"  # --no-pipelined-update
    assert _mode(delayed_update=True) == "delayed"
    assert _mode(pipelined_update=True, on_gpu=False) == "pipelined"  # asked for: the tests run it on the CPU
    assert _mode(pipelined_update="auto") == "pipelined"  # a recipe may spell the default out


def test_a_user_deepspeed_file_without_deepspeeds_cpu_adam_keeps_deepspeeds_step(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "none"}}}))
    assert _mode(ds_config=str(path)) == "deepspeed"
    # torch.optim's Adam (L2 decay) in place of DeepSpeedCPUAdam: the overlapped modes run the latter's AdamW
    path.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}}))
    assert _mode(ds_config=str(path)) == "deepspeed"
    for flag in ({"pipelined_update": True}, {"delayed_update": True}):
        with pytest.raises(ConfigError, match="DeepSpeedCPUAdam"):
            _mode(ds_config=str(path), **flag)


def test_asking_for_the_pipelined_update_under_several_ranks_takes_it_on_every_rank():
    assert _mode(world_size=2, pipelined_update=True) == "pipelined"
    assert _mode(world_size=4, pipelined_update=True, on_gpu=False) == "pipelined"  # the CPU tests' gloo ranks
    assert _mode(world_size=2, pipelined_update=False) == "deepspeed"
    # its one-GPU probe is the pipelined update too (a probe runs on one GPU whatever the launcher)
    cfg = TrainConfig(model="t5-tiny", from_scratch=True, pipelined_update=True)
    assert resolve_planned(cfg, 2).mode.on_one_gpu().name == "pipelined"


def test_pipelined_update_takes_true_false_or_auto():
    with pytest.raises(ConfigError, match="true, false or auto"):
        TrainConfig(model="t5-tiny", pipelined_update="sometimes")


def test_bf16_optimizer_states_are_deepspeeds_bf16_master_weights_and_states_in_the_pipelined_update():
    for states in ("bf16", "bf16-nearest"):
        ds = ds_for(TrainConfig(precision="bf16", optimizer_states=states), micro_batch=1)
        assert ds["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
        assert "fp16" not in ds
    # the one step that runs the 16-bit arithmetic, also where the pipelined update is not the default
    assert _mode(precision="bf16", optimizer_states="bf16", on_gpu=False) == "pipelined"
    with pytest.raises(ConfigError, match="runs in the pipelined update, on one GPU"):
        _mode(precision="bf16", optimizer_states="bf16", world_size=2)
    with pytest.raises(ConfigError, match="--optimizer-states must be one of fp32, bf16, bf16-nearest"):
        TrainConfig(model="t5-tiny", optimizer_states="fp8")
