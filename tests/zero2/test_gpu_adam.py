"""--gpu-adam-share on the CPU: which chunks the GPU takes, where the flag is refused or has nothing to share with,
and what the plan counts for it. The kernel's bits and the engine on a GPU are the GPU lane's
(tests/gpu/test_gpu_adam_gpu.py): a CPU has no CUDA stream to run them on."""

from __future__ import annotations

import math

import pytest
from conftest import cpu_config, tiny_engine

from fitone.errors import ConfigError
from fitone.zero2 import gpu_adam, step_mode

DS = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}


@pytest.mark.parametrize("share", [0.25, 1 / 3, 0.5, 0.7])
def test_the_gpus_chunks_are_the_share_evenly_spread(share):
    chunks = 232  # llama-7b's in one update
    picked = [j for j in range(chunks) if gpu_adam.chosen(j, share)]
    assert len(picked) == math.floor(chunks * share)
    gaps = [b - a for a, b in zip([-1] + picked, picked)]
    assert max(gaps) <= math.ceil(1 / share) and min(gaps) >= math.floor(1 / share)


@pytest.mark.parametrize("overrides, says", [
    (dict(gpu_adam_share=1.0), "up to but not including 1"),
    (dict(gpu_adam_share=-0.1), "up to but not including 1"),
    (dict(gpu_adam_share=0.3, offload="none"), "needs --offload cpu"),
    (dict(gpu_adam_share=0.3, pipelined_update=False), "without --delayed-update or --no-pipelined-update"),
    (dict(gpu_adam_share=0.3, delayed_update=True), "without --delayed-update"),
    (dict(gpu_adam_share=0.3, optimizer_states="bf16", precision="bf16"), "--optimizer-states fp32"),
])
def test_the_share_is_refused_in_one_line_where_it_cannot_run(overrides, says):
    with pytest.raises(ConfigError, match=says) as raised:
        cpu_config(**overrides).validate()
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("on_gpu, world_size, want", [(True, 1, 0.3), (False, 1, 0.0), (True, 2, 0.0)])
def test_the_share_reaches_the_engine_on_one_gpu_only(on_gpu, world_size, want):
    """A recipe's share is for its GPU runs: a CPU run and a launcher's ranks keep every chunk on the CPU."""
    mode = step_mode.decide(DS, delayed_update=False, delayed_update_after=0, pipelined_update=None,
                            world_size=world_size, on_gpu=on_gpu, gpu_adam_share=0.3)
    assert mode.engine_options()["gpu_share"] == want


def test_a_pipelined_update_without_a_gpu_says_so_and_steps_every_chunk_on_the_cpu(capsys):
    import torch

    from fitone.zero2 import overlap

    engine = tiny_engine(pipelined=True)
    try:
        engine.overlap.close()
        engine.overlap = overlap.PipelinedUpdate(engine.optimizer, engine.module, after=1, host=engine.host,
                                                 gpu_share=0.5)
        assert engine.overlap.gpu_share is None
        assert "--gpu-adam-share runs on one GPU's lean layout" in capsys.readouterr().out
        before = [p.detach().clone() for p in engine.optimizer.single_partition_of_fp32_groups]
        from conftest import fixed_batch

        for step in (1, 2):
            engine.backward(engine.forward(fixed_batch(step)))
            engine.step()
        engine.sync_weights()
        after = engine.optimizer.single_partition_of_fp32_groups
        assert all(not torch.equal(a, b) for a, b in zip(before, after))  # it trained
        assert "gpu_chunks" not in (engine.overlap.last_timing or {})
    finally:
        engine.close()


def test_the_plan_counts_the_shares_gpu_buffers_and_nothing_on_the_host():
    from fitone.plan import plan

    t5_3b = dict(model="t5-3b", from_scratch=True, src_len=128, tgt_len=128, precision="fp16", gpu_mem="24GiB",
                 host_mem="256GiB")
    without, with_it = plan(**t5_3b), plan(**t5_3b, gpu_adam_share=0.3)
    share = next(c.bytes for c in with_it.gpu if c.name == "GPU Adam share")
    assert share == gpu_adam.gpu_bytes() == gpu_adam.SETS * gpu_adam.PIECE_ELEMENTS * 14
    assert with_it.host_total == without.host_total
    assert "GPU Adam share" not in {c.name for c in without.gpu}
