"""The overlapped updates (fitone.zero2.overlap, fitone.zero2.delayed) on real DeepSpeed ZeRO-2 CPU-offload engines.

Tiny T5 on the CPU in fp32 (DeepSpeed refuses fp16 there). What cannot be shown here is the speed: the
point of the mode is a GPU busy while the CPU runs Adam; on a CPU both share the same cores.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import fitone
from conftest import cpu_config, fixed_batch, tiny_engine, weights
from fitone.engine import Engine
from fitone.models import build_model, load_config
from tolerance import (LINEAR_STEPS, adam_weight_drift, apart, bf16_loss_drift, bf16_weight_drift,
                       fp32_loss_drift)

LR = 1e-3  # tiny_engine's constant learning rate


def make_engine(delayed_after: int | None, precision: str = "fp32") -> Engine:
    return tiny_engine(precision, delayed_after=delayed_after)


def run(engine: Engine, steps: range, *, sync_each_step: bool = False,
        nan_at: int | None = None) -> tuple[list[dict], list[float]]:
    """Train on fixed batches; return the module's weights before each step's forward, and the losses.

    (With the pipelined update those weights are still being written when the forward starts: its
    modules wait for them inside the forward, so only the losses say what that forward saw.)
    """
    seen, losses = [], []
    for step in steps:
        seen.append(weights(engine))
        loss = engine.forward(fixed_batch(step))
        engine.backward(loss * float("nan") if step == nan_at else loss)
        engine.step()
        if sync_each_step:
            engine.sync_weights()
        losses.append(loss.item())
    return seen, losses


def run_checking_each_forward(engine: Engine, steps: range) -> tuple[list[float], list[int]]:
    """Train on fixed batches; return the losses, and the steps whose forward did not see the weights that
    had landed by the end of its backward (the pipelined update's chunks are all in by then, and the
    next update is not launched before `step`).

    The check runs the same forward again on those weights: the same operations on the same numbers give
    the same logits, bit for bit, so any difference is a chunk the first forward read before its update.
    """
    losses, stale = [], []
    for step in steps:
        batch = fixed_batch(step)
        out = engine.ds(**batch)
        engine.backward(out.loss)
        if not torch.equal(engine.module(**batch).logits, out.logits):
            stale.append(step)
        engine.step()
        losses.append(out.loss.item())
    return losses, stale


def equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def exported_equals_checkpoint(run_dir) -> bool:
    """Whether DIR/final/ (loaded with from_pretrained, no DeepSpeed) holds, tensor for tensor, the module
    weights of the run's last checkpoint, after the cast to the checkpoint's dtype."""
    from transformers import AutoModelForSeq2SeqLM

    from fitone import checkpoint

    saved = torch.load(checkpoint.latest(run_dir) / "mp_rank_00_model_states.pt", map_location="cpu",
                       weights_only=False)["module"]
    exported = AutoModelForSeq2SeqLM.from_pretrained(run_dir / "final").state_dict()
    return saved.keys() <= exported.keys() and all(torch.equal(exported[k].to(v.dtype), v) for k, v in saved.items())


def within_adam_drift(got: dict, expected: dict, steps: int) -> bool:
    """fp32 weights of a run updated by PyTorch's fused AdamW vs DeepSpeedCPUAdam's (tolerance.py)."""
    return all(float((got[k] - v).abs().max()) <= adam_weight_drift(v, steps, LR) for k, v in expected.items())


@pytest.mark.numeric
def test_the_delayed_update_applied_at_once_is_deepspeeds_update():
    """Same gradients in, same weights out: unscale/clip, AdamW on DeepSpeed's states, staging, upload, and
    the swapped gradient buffers. Only *when* the update lands differs in the real mode."""
    plain = make_engine(None)
    try:
        run(plain, range(1, 9))
        expected = weights(plain)
        norm = plain.optimizer._global_grad_norm
    finally:
        plain.close()
    delayed = make_engine(2)
    try:
        run(delayed, range(1, 9), sync_each_step=True)
        assert delayed.overlap.applied == 8 and delayed.overlap.spare is not None  # 6 delayed updates ran
        timing = delayed.overlap.last_timing  # the benchmark's split: the last update's wall-clock counters
        assert 0 < timing["adam_s"] <= timing["thread_s"] and timing["wait_s"] >= 0
        got = weights(delayed)
        assert float(norm) > 1.0  # the clip factor was part of it
    finally:
        delayed.close()
    assert within_adam_drift(got, expected, steps=6)  # the 6 delayed updates, the rest is DeepSpeed's own
    # and the 8 steps moved the weights: some by more than one Adam step (about lr each)
    start = weights_at_init()
    assert any(float((got[k] - start[k]).abs().max()) > LR for k in got)


def weights_at_init() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in build_model(load_config("t5-tiny", from_scratch=True)).named_parameters()}


@pytest.mark.numeric
def test_after_the_plain_steps_each_forward_sees_the_weights_one_update_old():
    engine = make_engine(2)
    try:
        seen, _ = run(engine, range(1, 7))
        engine.sync_weights()
        final = weights(engine)
        master = engine.optimizer.single_partition_of_fp32_groups[0].detach().clone()
    finally:
        engine.close()
    # steps 1 and 2 are plain: each forward sees the previous step's update
    assert not equal(seen[1], seen[0]) and not equal(seen[2], seen[1])
    # step 3's update is still running when step 4's forward starts: step 4 sees step 2's weights
    assert equal(seen[3], seen[2])
    # from then on one update lands per step (step 3's before step 5's forward, ...)
    assert not equal(seen[4], seen[3]) and not equal(seen[5], seen[4])
    # after sync the module holds the fp32 master weights (fp32 run: equal, not close)
    flat = torch.cat([final[k].flatten() for k in final])
    assert torch.equal(flat, master[: flat.numel()])


@pytest.mark.numeric
def test_an_overflowed_step_is_dropped_and_the_pending_update_still_lands():
    """A NaN loss at a delayed step (DeepSpeed checks gradients for inf/NaN in fp32 too): skipped, not
    applied; the earlier step's update, already running, lands as usual."""
    twin = make_engine(1)
    try:
        run(twin, range(1, 4))
        twin.sync_weights()
        expected = weights(twin)
    finally:
        twin.close()
    engine = make_engine(1)
    try:
        run(engine, range(1, 5), nan_at=4)
        assert engine.skipped_steps == 1 and not engine.last_step_applied
        engine.sync_weights()
        got = weights(engine)
    finally:
        engine.close()
    assert all(torch.isfinite(v).all() for v in got.values())
    assert equal(got, expected)


@pytest.mark.numeric
def test_train_with_the_delayed_update_learns_exports_and_resumes(tmp_path, capsys):
    common = dict(max_steps=24, lr=1e-3, lr_schedule="constant", warmup_steps=0, batch_size=8,
                  delayed_update=True, delayed_update_after=4)
    straight = fitone.train(cpu_config(**common, out=str(tmp_path / "straight"), save_every=12))
    said = capsys.readouterr()
    assert "it trains worse" in said.out + said.err and "prefer --pipelined-update" in said.out + said.err
    assert all(math.isfinite(x) for x in straight.losses) and straight.skipped_steps == 0
    assert sum(straight.losses[-6:]) < 0.6 * sum(straight.losses[:6])
    # the export is the synced weights, the last update included: those of the final checkpoint
    assert exported_equals_checkpoint(tmp_path / "straight")
    # stop at 12 (a checkpoint syncs the pending update), resume to 24: the same curve as straight through
    out = tmp_path / "run"
    fitone.train(cpu_config(**{**common, "max_steps": 12}, out=str(out), save_every=12))
    resumed = fitone.train(cpu_config(**common, out=str(out), resume=True, save_every=12))
    assert resumed.resumed_from == 12
    # the same operations on the restored numbers: fp32 rounding at most, from the resumed step on
    assert apart(resumed.losses, straight.losses[12:], fp32_loss_drift, first_differing_step=1) == []
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 25))


def test_the_delayed_update_needs_the_cpu_optimizer():
    from fitone.errors import ConfigError

    with pytest.raises(ConfigError, match="needs --offload cpu"):
        cpu_config(delayed_update=True, offload="none").validate()


# -- the pipelined update ---------------------------------------------------------------------------
def make_pipelined(chunk_elements: int, precision: str = "fp32", after: int = 1) -> Engine:
    """The engine's own pipelined update on its lean host layout, its Adam and uploads in smaller chunks."""
    from fitone.zero2.overlap import PipelinedUpdate

    engine = tiny_engine(precision, pipelined=True)
    engine.overlap.close()
    engine.overlap = PipelinedUpdate(engine.optimizer, engine.module, after=after, chunk_elements=chunk_elements,
                                     host=engine.host)
    return engine


@pytest.mark.numeric
@pytest.mark.parametrize("after", [1, 0], ids=["deepspeeds-first-step", "own-first-step"])
def test_the_pipelined_update_is_deepspeeds_update_while_the_next_forward_runs(after):
    """No staleness: with the update running in small chunks beside the next forward (each module waiting
    for the chunks that hold its weights), every forward sees the updated weights, and every step's loss
    and the final weights match DeepSpeed's own within the rounding of two fp32 Adam implementations, with
    DeepSpeed's arithmetic for the first step (`after` 1, the default) or not (0, the speculative update's)."""
    plain = make_engine(None)
    try:
        _, expected_losses = run(plain, range(1, 9))
        expected = weights(plain)
    finally:
        plain.close()
    engine = make_pipelined(chunk_elements=4096, after=after)
    try:
        assert len(engine.overlap.chunks[0]) > 20  # many chunks: the forward really overtakes the thread
        assert engine.overlap.last_timing is None
        got_losses, stale = run_checking_each_forward(engine, range(1, 9))
        seventh = engine.overlap.last_timing  # step 8 launched its update after landing step 7's
        engine.sync_weights()
        got = weights(engine)
        assert engine.overlap.applied == 8
        # the benchmark's split (scripts/bench_tools.py): each completed update's wall-clock counters
        last = engine.overlap.last_timing
        assert seventh is not None and last is not seventh
        for timing in (seventh, last):
            assert timing.keys() == {"adam_s", "thread_s", "wait_s"}
            assert 0 < timing["adam_s"] <= timing["thread_s"] and timing["wait_s"] >= 0
    finally:
        engine.close()
    assert stale == []  # every forward read its weights after their update (no pre-hooks: most do not)
    # steps 1 and 2 run on the same weights (with `after` 1 step 1 is DeepSpeed's arithmetic, run chunk by chunk on
    # the lean layout: the same bits as DeepSpeed's own step); from step 2 + after on, a forward sees weights from
    # updates by PyTorch's fused AdamW instead of DeepSpeedCPUAdam
    assert got_losses[:1 + after] == expected_losses[:1 + after]
    assert apart(got_losses, expected_losses, fp32_loss_drift, first_differing_step=2 + after) == []
    assert within_adam_drift(got, expected, steps=8 - after)  # steps 1 + after to 8 were fitone's arithmetic


def test_a_failed_pipelined_update_raises_in_the_forward_that_needs_it():
    """The thread's error must stop the next forward at the first chunk the update did not write, not let it
    run on stale weights until the step after. The failure is injected (a CPU Adam call that raises): a
    real one would be e.g. host memory running out mid-update."""
    engine = make_pipelined(chunk_elements=4096)
    try:
        run(engine, range(1, 3))  # step 1 is DeepSpeed's arithmetic; step 2 launched the first pipelined update
        engine.sync_weights()
        adam = engine.overlap._adam

        def failing(i, grad, scale, hyper, step, lo=0, hi=None):
            if lo >= 4 * 4096:  # the first chunks land; a later one fails
                raise RuntimeError("injected CPU Adam failure")
            adam(i, grad, scale, hyper, step, lo, hi)

        engine.overlap._adam = failing
        loss = engine.forward(fixed_batch(3))
        engine.backward(loss)
        engine.step()  # launches the update that fails
        with pytest.raises(RuntimeError, match="injected CPU Adam failure"):
            engine.forward(fixed_batch(4))
    finally:
        engine.close()  # raised once, where it happened: the teardown after it does not raise it again


@pytest.mark.numeric
def test_the_pipelined_update_trains_exports_and_resumes(tmp_path):
    common = dict(max_steps=16, lr=1e-3, lr_schedule="constant", warmup_steps=0, batch_size=8,
                  pipelined_update=True)
    plain = fitone.train(cpu_config(**{**common, "pipelined_update": False}))
    straight = fitone.train(cpu_config(**common, out=str(tmp_path / "straight"), save_every=8))
    # the same training: PyTorch's fused AdamW beside DeepSpeedCPUAdam, within fp32 rounding over the steps
    # where that bound holds for whole runs (tolerance.LINEAR_STEPS); step 2's update is the first pipelined
    n = LINEAR_STEPS
    assert apart(straight.losses[:n], plain.losses[:n], fp32_loss_drift, first_differing_step=3) == []
    # the export is the synced weights: those the last checkpoint holds (taken after the last update landed)
    assert exported_equals_checkpoint(tmp_path / "straight")
    out = tmp_path / "run"
    fitone.train(cpu_config(**{**common, "max_steps": 8}, out=str(out), save_every=8))
    resumed = fitone.train(cpu_config(**common, out=str(out), resume=True, save_every=8))
    # the same operations on the restored numbers: fp32 rounding at most, from the resumed step on
    assert apart(resumed.losses, straight.losses[8:], fp32_loss_drift, first_differing_step=1) == []
    assert (plain.update, straight.update, resumed.update) == ("deepspeed", "pipelined", "pipelined")
    # the checkpoint files are DeepSpeed's under either step: a run started on one resumes on the other
    other = tmp_path / "switched"
    fitone.train(cpu_config(**{**common, "max_steps": 8, "pipelined_update": False}, out=str(other), save_every=8))
    switched = fitone.train(cpu_config(**common, out=str(other), resume=True, save_every=8))
    assert switched.update == "pipelined" and switched.resumed_from == 8
    # DeepSpeed's steps up to 8, pipelined ones after: fp32 rounding from the resumed step on
    assert apart(switched.losses, plain.losses[8:], fp32_loss_drift, first_differing_step=1) == []


def test_by_default_a_run_on_one_gpu_takes_the_pipelined_update_and_says_so(monkeypatch, capsys):
    """On one GPU the default is the pipelined update. This CPU cannot be a GPU, so the step mode's decision
    is told it is one (faked: its on_gpu argument); the rest is real: the engine the run builds, what it says."""
    import importlib

    from fitone.zero2 import step_mode


    real = step_mode.decide
    monkeypatch.setattr(step_mode, "decide", lambda ds, **kw: real(ds, **{**kw, "on_gpu": True}))
    built = []  # the overlapped update each engine of a run really holds

    class Recorded(Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(type(self.overlap).__name__)

    monkeypatch.setattr(importlib.import_module("fitone.build"), "Engine", Recorded)
    common = dict(max_steps=6, lr=1e-3, lr_schedule="constant", warmup_steps=0, batch_size=8)
    default = fitone.train(cpu_config(**common, progress=False))
    said = capsys.readouterr()
    assert default.update == "pipelined" and "optimizer step: the pipelined update" in said.out + said.err
    plain = fitone.train(cpu_config(**common, progress=False, pipelined_update=False))
    said = capsys.readouterr()
    assert plain.update == "deepspeed" and "pipelined" not in said.out + said.err
    assert built == ["PipelinedUpdate", "NoneType"]
    assert apart(default.losses, plain.losses, fp32_loss_drift, first_differing_step=3) == []


def test_one_overlap_mode_at_a_time():
    from fitone.errors import ConfigError

    with pytest.raises(ConfigError, match="not both"):
        cpu_config(delayed_update=True, pipelined_update=True).validate()


@pytest.mark.numeric
def test_in_bf16_the_pipelined_update_follows_the_default_and_the_delayed_one_lags():
    """bf16 (DeepSpeed's CPU accelerator takes it; fp16 needs a GPU): 16-bit weights staged from fp32.

    Step by step on engines, with the update in small chunks so the forward overtakes it: each forward sees
    the updated weights, and losses and weights stay within bf16 rounding of DeepSpeed's step. Then whole
    runs: the pipelined run stays within that rounding, while the delayed one, whose forward sees weights
    one update old, leaves it at its first delayed step.
    """
    plain = make_engine(None, "bf16")
    try:
        _, expected_losses = run(plain, range(1, 11))
        expected = weights(plain)
    finally:
        plain.close()
    engine = make_pipelined(chunk_elements=4096, precision="bf16")
    try:
        got_losses, stale = run_checking_each_forward(engine, range(1, 11))
        engine.sync_weights()
        got = weights(engine)
    finally:
        engine.close()
    assert stale == []  # removing the forward pre-hooks makes most steps stale here
    # the first pipelined update (step 2's) is the first arithmetic that differs; step 3's forward sees it
    assert got_losses[:2] == expected_losses[:2]
    assert apart(got_losses, expected_losses, bf16_loss_drift, first_differing_step=3) == []
    assert all(float((got[k].float() - v.float()).abs().max()) <= bf16_weight_drift(v, steps=9)
               for k, v in expected.items())

    common = dict(max_steps=10, precision="bf16", lr=1e-3, lr_schedule="constant", warmup_steps=0)
    whole = fitone.train(cpu_config(**common))
    pipelined = fitone.train(cpu_config(**common, pipelined_update=True))
    delayed = fitone.train(cpu_config(**common, delayed_update=True, delayed_update_after=3))
    assert pipelined.losses[:2] == whole.losses[:2]
    assert apart(pipelined.losses, whole.losses, bf16_loss_drift, first_differing_step=3) == []
    assert delayed.losses[:4] == whole.losses[:4]  # 3 plain steps; the 4th forward is before any delay
    # step 5's forward sees step 3's weights, not step 4's: off by more than the rounding a correct step
    # may add (counted as if steps 3-5 had differed already)
    assert abs(delayed.losses[4] - whole.losses[4]) > bf16_loss_drift(whole.losses[4], steps=3)
    assert all(math.isfinite(x) for x in delayed.losses) and delayed.losses[-1] < delayed.losses[0]


@pytest.mark.numeric
def test_the_pipelined_update_on_a_causal_lm_with_tied_weights_and_accumulation(tiny_gpt_dir, text_jsonl,
                                                                                tmp_path):
    """GPT-2's lm_head shares the embedding's weight (a module whose weight sits at the start of the flat
    buffer though it runs last), and with 2 micro-batches per step the update runs beside two forwards
    and the first backward must wait for it: the same losses as DeepSpeed's own step, and the held-out
    quality of the same model."""
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join(line + "\n" for line in text_jsonl.read_text().splitlines()[-16:]))
    common = dict(model=str(tiny_gpt_dir), from_scratch=False, data=str(text_jsonl), seq_len=64, batch_size=4,
                  grad_accum=2, max_steps=LINEAR_STEPS, lr=1e-3, lr_schedule="constant", warmup_steps=0,
                  eval_data=str(held_out), eval_examples=16)
    plain = fitone.train(cpu_config(**common))
    pipelined = fitone.train(cpu_config(**common, pipelined_update=True))
    assert pipelined.grad_accum == 2
    # fp32 rounding of two Adam implementations from step 3 on (step 2's update is the first pipelined)
    assert apart(pipelined.losses, plain.losses, fp32_loss_drift, first_differing_step=3) == []
    assert pipelined.losses[-1] < pipelined.losses[0]
    eval_loss = plain.quality["eval_loss"]
    assert abs(pipelined.quality["eval_loss"] - eval_loss) <= fp32_loss_drift(eval_loss, steps=LINEAR_STEPS - 1)
