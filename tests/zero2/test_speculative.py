"""The speculative CPU Adam (fitone.zero2.speculative) on real DeepSpeed ZeRO-2 CPU-offload engines: where its
speculation is kept, every step's loss and the final fp32 master weights and Adam moments are the pipelined
update's, bit for bit; where it is redone (clipping, a new loss scale) or undone (an overflow, a step that never
comes), AdamW is inverted in place, so from that step on the run is the pipelined update's within the fp32
rounding bounds the pipelined update itself is held to against DeepSpeed's step (tests/tolerance.py).

Tiny T5 on the CPU, the update in 4096-element chunks so the model has many. What cannot be shown here is the
speed: on a GPU the speculation runs while the GPU computes the backward; here both share the same cores.
"""

from __future__ import annotations

import pytest
import torch

from conftest import cpu_config, drain, fixed_batch, tiny_engine
from fitone.engine import Engine
from fitone.errors import ConfigError
from fitone.zero2.speculative import ChunkTracker, next_ready, undo_adamw
from tolerance import EPS, adam_weight_drift, apart, bf16_loss_drift, bf16_weight_drift, fp32_loss_drift

CHUNK = 4096
LR = 1e-3  # tiny_engine's
CLIP_AT = 1.0  # `clip_at`'s max norm: the tiny T5's is ~4 there, so its gradients are scaled by ~0.25


def make_engine(precision: str, *, speculative: bool, grad_accum: int = 1, clip: float = 1e6, after: int = 1,
                speculate_first: bool = False) -> Engine:
    """The engine's pipelined update in CHUNK-element chunks; `clip`: the max gradient norm (large: clipping
    never fires, so speculation is kept); `after`: DeepSpeed's own steps first (the engine's speculative update
    has none; 1 here keeps most tests' first step unspeculated, on DeepSpeed's arithmetic); `speculate_first`:
    the clip streak starts empty, so the first step is speculated too (a run's starts full: CLIP_STREAK)."""
    from fitone.zero2.overlap import PipelinedUpdate

    engine = tiny_engine(precision, pipelined=True, grad_accum=grad_accum)
    engine.overlap.close()
    engine.overlap = PipelinedUpdate(engine.optimizer, engine.module, after=after, chunk_elements=CHUNK,
                                     host=engine.host, speculative=speculative)
    engine.optimizer.clip_grad = clip
    if speculate_first and speculative:
        engine.overlap.speculation.clip_streak = 0
    return engine


def train(engine: Engine, steps: int, grad_accum: int = 1, inf_at: int | None = None, clip_at: int | None = None,
          rescale_at: int | None = None, drained: bool = True) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of each micro-batch, and the fp32 master and moments at the end. `inf_at`: that step's gradients
    hold an inf (an overflow, as tests/zero2/test_overflow.py makes one); `clip_at`: that step clips;
    `rescale_at`: the loss scale becomes 2 between that step's backward and its update (as a dynamic scaler
    moves it; fp16, which has one, needs a GPU), and stays 2; `drained`: each step comes once every chunk's
    speculation has run, so what is speculated does not depend on the machine's speed."""
    losses = []
    param = next(p for n, p in engine.module.named_parameters() if "layer.0.SelfAttention.q" in n)
    opt = engine.optimizer
    for step in range(1, steps + 1):
        handle = param.register_hook(lambda g: torch.full_like(g, float("inf"))) if step == inf_at else None
        opt.clip_grad, clip = (CLIP_AT, opt.clip_grad) if step == clip_at else (opt.clip_grad, opt.clip_grad)
        for micro in range(grad_accum):
            loss = engine.forward(fixed_batch(step * grad_accum + micro))
            engine.backward(loss)
            if step == rescale_at and micro == grad_accum - 1:
                opt.loss_scale = 2.0
            if drained:
                drain(engine)
            engine.step()
            losses.append(loss.item())
        opt.clip_grad = clip
        if handle is not None:
            handle.remove()
    return losses, states(engine)


def states(engine: Engine) -> dict[str, torch.Tensor]:
    """The fp32 master and moments, once the pending update has landed."""
    engine.sync_weights()
    opt = engine.optimizer
    return {f"{k}{i}": (m.data if k == "master" else opt.optimizer.state[m][k]).clone()
            for i, m in enumerate(opt.single_partition_of_fp32_groups) for k in ("master", "exp_avg", "exp_avg_sq")}


def both(precision: str, steps: int, grad_accum: int = 1, after: int = 1, speculate_first: bool = False,
         **train_kwargs) -> tuple[tuple, tuple, dict]:
    """The same training without and with speculation; the counters of the latter."""
    results, counts = [], {}
    for speculative in (False, True):
        engine = make_engine(precision, speculative=speculative, grad_accum=grad_accum, after=after,
                             speculate_first=speculate_first)
        try:
            results.append(train(engine, steps, grad_accum, **train_kwargs))
            if speculative:
                counts = {**engine.overlap.speculation.totals, "last_timing": dict(engine.overlap.last_timing)}
        finally:
            engine.close()
    return results[0], results[1], counts


def identical(plain: tuple, speculated: tuple) -> bool:
    (losses_a, state_a), (losses_b, state_b) = plain, speculated
    return losses_a == losses_b and all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def within_rounding(plain: tuple, speculated: tuple, precision: str, *, undone_at: int, steps: int,
                    grad_accum: int = 1) -> bool:
    """The runs' losses (one a micro-batch) and final master weights no further apart than two implementations of
    the pipelined update's arithmetic may drift from step `undone_at` (the first whose arithmetic differs) to
    `steps`."""
    (losses_a, state_a), (losses_b, state_b) = plain, speculated
    first = undone_at * grad_accum  # the undone step's own micro-batches came before its update
    if losses_a[:first] != losses_b[:first]:
        return False
    drifting = steps - undone_at + 1
    loss_drift = bf16_loss_drift if precision == "bf16" else fp32_loss_drift
    drifted = apart(losses_b, losses_a, lambda w, k: loss_drift(w, -(-k // grad_accum)),  # k micro-batches: steps
                    first_differing_step=first + 1)
    if precision == "bf16":
        return drifted == [] and all(float((state_b[k].bfloat16().float() - v.bfloat16().float()).abs().max())
                                     <= bf16_weight_drift(v, drifting) for k, v in state_a.items()
                                     if k.startswith("master"))
    return drifted == [] and all(float((state_b[k] - v).abs().max()) <= adam_weight_drift(v, drifting, LR)
                                 for k, v in state_a.items() if k.startswith("master"))


@pytest.mark.numeric
@pytest.mark.parametrize("precision, grad_accum", [("fp32", 1), ("bf16", 1), ("fp32", 3), ("bf16", 3)])
def test_speculation_kept_gives_the_pipelined_update_bit_for_bit(precision, grad_accum):
    plain, speculated, counts = both(precision, steps=5, grad_accum=grad_accum)
    assert identical(plain, speculated)
    # steps 2-5 are pipelined, and every chunk of them was speculated and kept (no chunk is left out)
    assert counts["speculated_chunks"] >= 4 * 20 and counts["rolled_back_chunks"] == 0
    assert counts["speculative_adam_s"] > 0 and counts["undo_s"] == 0
    last = counts["last_timing"]
    assert last["speculated_chunks"] > 20 and last["rolled_back_chunks"] == 0 and last["speculative_adam_s"] > 0


@pytest.mark.numeric
def test_chunks_not_started_at_the_step_are_left_to_the_update_and_the_result_is_the_same():
    """A speculation slower than the backward (on a GPU, a model whose CPU Adam outlasts its backward): at the
    step the chunks not yet started are the update's, run beside the next forward in its order. Here step 3's
    speculation is held behind a job in the update's thread until its step has been taken, so all its chunks
    are left to the update; the other steps are drained and kept: still the pipelined update's bits."""
    import threading

    plain = make_engine("fp32", speculative=False)
    try:
        want = train(plain, 4)
    finally:
        plain.close()
    engine = make_engine("fp32", speculative=True)
    try:
        losses, left = [], {}
        for step in range(1, 5):  # train()'s batches
            gate = threading.Event()
            if step == 3:
                engine.overlap._pool.submit(gate.wait, 60)  # ahead of step 3's speculation in the one thread
            loss = engine.forward(fixed_batch(step))
            engine.backward(loss)
            if step != 3:
                drain(engine)
            engine.step()  # step 3: no speculative job has started, all are cancelled and left to the update
            gate.set()
            left = dict(engine.overlap.speculation.this_step) if step == 3 else left
            losses.append(loss.item())
        got = (losses, states(engine))
    finally:
        engine.close()
    assert identical(want, got)
    assert left["unstarted_chunks"] > 20 and left["speculated_chunks"] == 0 and left["rolled_back_chunks"] == 0


def test_the_undo_inverts_one_adamw_step_to_fp32_rounding():
    """undo_adamw after fitone.zero2.adam32's step (AdamW and Adam's L2 mode, fp32 and bf16 gradients, a loss
    scale): the old states back to an ulp of the new ones (the most an in-place inversion can keep)."""
    from fitone.zero2 import adam32

    torch.manual_seed(0)
    n = 1 << 14
    for grad_dtype in (torch.float32, torch.bfloat16):
        for adam_w_mode, step in ((True, 1), (True, 7), (False, 7)):
            old = (torch.randn(n), torch.randn(n) * 1e-3, torch.rand(n) * 1e-6)
            grad = (torch.randn(n) * 1e-3).to(grad_dtype)
            hyper = dict(step=step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, grad_scale=4.0,
                         adam_w_mode=adam_w_mode)
            new = [t.clone() for t in old]
            adam32.step(*new, grad.clone(), **hyper)
            stepped = [t.clone() for t in new]
            undo_adamw(*new, grad, **hyper)
            for was, now, after in zip(old, new, stepped):
                assert float((now - was).abs().max()) <= 2 * EPS["fp32"] * float(after.abs().max())
                assert not torch.equal(after, was)  # the step moved them


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adam_w_mode, weight_decay", [(True, 0.01), (False, 0.01), (True, 0.0)])
def test_the_one_pass_redo_is_the_undo_then_the_step(grad_dtype, adam_w_mode, weight_decay):
    """fitone.zero2.adam32.redo_adamw (a step taken at one scale, redone at another) against undo_adamw then
    adam32's step at the new scale: the same states to the undo's bound, on a size with a scalar tail."""
    from fitone.zero2 import adam32

    if not adam32.available():
        pytest.skip("fitone.zero2.adam32 does not run under this CPU's PyTorch capability")
    torch.manual_seed(1)
    n = 3 * 4096 + 21
    hyper = dict(step=5, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, adam_w_mode=adam_w_mode)
    start = (torch.randn(n), torch.randn(n) * 1e-3, torch.rand(n) * 1e-6)
    grad = (torch.randn(n) * 1e-3 * 1024).to(grad_dtype)
    for old, new in ((1024.0, 4096.0), (None, 2.5)):
        speculated = [t.clone() for t in start]
        adam32.adamw(*speculated, grad, grad_scale=old, **hyper)
        redone = [t.clone() for t in speculated]
        adam32.redo_adamw(*redone, grad, grad_scale=new, old_grad_scale=old, **hyper)
        want = [t.clone() for t in speculated]
        undo_adamw(*want, grad, grad_scale=old, **hyper)
        adam32.adamw(*want, grad, grad_scale=new, **hyper)
        for ours, theirs, between in zip(redone, want, speculated):
            assert float((ours - theirs).abs().max()) <= 2 * EPS["fp32"] * float(between.abs().max())
        assert not torch.equal(redone[0], speculated[0])  # the scale moved the step


@pytest.mark.numeric
@pytest.mark.parametrize("precision, grad_accum", [("fp32", 1), ("bf16", 1), ("bf16", 3)])
@pytest.mark.parametrize("fused", [True, False], ids=["redo-fused", "undo-then-adam"])
def test_a_clipped_step_redoes_its_speculation_in_the_update_and_the_next_step_speculates(
        precision, grad_accum, fused, monkeypatch):
    """Step 3 clips: its speculation (at the loss scale) is redone at the clipped scale in the update's thread, by
    fitone.zero2.adam32's one-pass redo or, where that op does not run, undone and stepped again; steps 4 and 5
    speculate and keep theirs."""
    from fitone.zero2 import adam32

    if fused and not adam32.available():
        pytest.skip("fitone.zero2.adam32 does not run under this CPU's PyTorch capability")
    monkeypatch.setattr(adam32, "ENABLED", fused)
    plain, speculated, counts = both(precision, steps=5, grad_accum=grad_accum, clip_at=3)
    assert within_rounding(plain, speculated, precision, undone_at=3, steps=5, grad_accum=grad_accum)
    assert counts["redone_chunks"] > 20 and counts["rolled_back_chunks"] == 0  # step 3's chunks, none undone
    assert counts["undo_s"] > 0 if not fused else counts["undo_s"] == 0
    assert counts["speculated_chunks"] >= 4 * 20  # steps 2-5, step 4 (after the clipped one) too
    assert counts["last_timing"]["speculated_chunks"] > 20 and counts["last_timing"]["redone_chunks"] == 0


@pytest.mark.numeric
def test_clipping_from_the_start_or_persisting_stops_the_speculation_until_a_step_does_not_clip():
    """Clipping (the tiny T5's norm is ~4, the max 1) on every step but 2, 8 and 9. The run starts with the streak
    full, so step 1 is not speculated, and its clip keeps step 2 unspeculated; step 2 does not clip, so steps 3-5
    speculate, clip and are redone; CLIP_STREAK clipped steps in a row stop it again (steps 6-8); step 8 does not
    clip, so step 9 speculates and keeps it. `after` 0, as the engine builds it: DeepSpeed's first step reads the
    clip in the update's thread, which may run after step 2 has changed it."""
    from fitone.zero2.speculative import CLIP_STREAK

    assert CLIP_STREAK == 3  # the step numbers below
    runs, counts = [], {}
    for speculative in (False, True):
        engine = make_engine("fp32", speculative=speculative, clip=CLIP_AT, after=0)
        try:
            if speculative:
                assert engine.overlap.speculation.clip_streak == CLIP_STREAK
            losses = []
            for step in range(1, 10):
                engine.optimizer.clip_grad = 1e6 if step in (2, 8, 9) else CLIP_AT
                loss = engine.forward(fixed_batch(step))
                engine.backward(loss)
                drain(engine)
                engine.step()
                losses.append(loss.item())
                if speculative and step == 2:
                    assert engine.overlap.speculation.totals["speculated_chunks"] == 0  # steps 1 and 2
            runs.append((losses, states(engine)))
            if speculative:
                counts = {**engine.overlap.speculation.totals, "last": dict(engine.overlap.speculation.this_step)}
        finally:
            engine.close()
    assert within_rounding(runs[0], runs[1], "fp32", undone_at=3, steps=9)
    assert counts["steps_clipping_persisted"] == 5  # steps 1 and 2 (the streak starts full), 6, 7 and 8
    assert counts["redone_chunks"] >= 3 * 20 and counts["rolled_back_chunks"] == 0  # steps 3-5
    assert counts["last"]["speculated_chunks"] > 20 and counts["last"]["redone_chunks"] == 0  # step 9 kept


@pytest.mark.numeric
def test_an_overflowed_step_undoes_its_speculation_and_the_next_step_speculates_again():
    plain, speculated, counts = both("bf16", steps=5, inf_at=3)
    assert within_rounding(plain, speculated, "bf16", undone_at=3, steps=5)
    assert all(torch.isfinite(v).all() for v in speculated[1].values())
    assert counts["nonfinite_chunks"] > 0  # the chunks holding the inf were never speculated
    assert counts["rolled_back_chunks"] > 20
    assert counts["speculated_chunks"] - counts["rolled_back_chunks"] > 2 * 20  # steps 2, 4 and 5 kept


@pytest.mark.numeric
def test_a_loss_scale_changed_at_the_step_redoes_its_speculation():
    plain, speculated, counts = both("fp32", steps=5, rescale_at=3)
    assert within_rounding(plain, speculated, "fp32", undone_at=3, steps=5)
    assert counts["redone_chunks"] > 20 and counts["rolled_back_chunks"] == 0  # step 3's: at scale 1, stepped at 2
    assert counts["speculated_chunks"] - counts["redone_chunks"] > 2 * 20  # steps 2, 4, 5 (at 2) kept


@pytest.mark.numeric
@pytest.mark.parametrize("precision, grad_accum", [("fp32", 1), ("bf16", 3)])
def test_without_deepspeeds_first_step_a_speculated_first_step_is_kept(precision, grad_accum):
    """`after` 0 (the engine's speculative update) and the streak empty: step 1 runs the pipelined update's own
    arithmetic on zero states made at the first backward, and its speculation is kept bit for bit like every
    later step's."""
    plain, speculated, counts = both(precision, steps=4, grad_accum=grad_accum, after=0, speculate_first=True)
    assert identical(plain, speculated)
    assert counts["speculated_chunks"] >= 4 * 20 and counts["rolled_back_chunks"] == 0  # steps 1-4


@pytest.mark.numeric
def test_an_overflowed_first_step_undoes_its_speculation_on_the_zero_states():
    """`after` 0, and step 1 overflows (an fp16 run's loss scale settling): its finite chunks' speculation is
    undone, leaving the made states zero to the undo's rounding, and the run is the pipelined update's."""
    plain, speculated, counts = both("bf16", steps=4, inf_at=1, after=0, speculate_first=True)
    assert within_rounding(plain, speculated, "bf16", undone_at=1, steps=4)
    assert counts["nonfinite_chunks"] > 0 and counts["rolled_back_chunks"] > 20
    assert counts["speculated_chunks"] - counts["rolled_back_chunks"] >= 3 * 20  # steps 2-4 kept


def test_the_engines_speculative_update_speculates_from_the_step_after_one_that_did_not_clip():
    """The engine's (tiny_engine's clip of 1.0 fires on the tiny T5): step 1 is fitone's arithmetic (`after` 0), not
    speculated, and clips, so step 2 is not speculated either; step 2 does not clip, so step 3 is."""
    engine = tiny_engine("fp32", pipelined=True, speculative=True)
    try:
        assert engine.overlap.after == 0
        speculated = []
        for step in (1, 2, 3):
            if step == 2:
                engine.optimizer.clip_grad = 1e6
            engine.backward(engine.forward(fixed_batch(step)))
            drain(engine)
            engine.step()
            engine.sync_weights()
            speculated.append(engine.overlap.speculation.totals["speculated_chunks"])
        assert speculated[:2] == [0, 0] and speculated[2] > 0
        assert engine.overlap.speculation.totals["rolled_back_chunks"] == 0
        assert engine.optimizer.optimizer.state[engine.optimizer.single_partition_of_fp32_groups[0]]["step"] == 3
    finally:
        engine.close()


def test_no_speculation_in_deepspeeds_first_steps():
    engine = make_engine("fp32", speculative=True)
    try:
        engine.backward(engine.forward(fixed_batch(1)))
        engine.step()  # step 1: DeepSpeed's arithmetic (in the update's thread); nothing speculated
        assert engine.overlap.pending is not None  # the first step does not run before `step` returns either
        engine.sync_weights()
        assert engine.overlap.speculation.totals["speculated_chunks"] == 0
    finally:
        engine.close()


def _master_and_moments(engine: Engine) -> tuple[torch.Tensor, ...]:
    opt = engine.optimizer
    master = opt.single_partition_of_fp32_groups[0]
    return master.data, opt.optimizer.state[master]["exp_avg"], opt.optimizer.state[master]["exp_avg_sq"]


def _undone(now: tuple[torch.Tensor, ...], before: tuple[torch.Tensor, ...]) -> bool:
    """The states as they were, to an ulp of the speculated ones (undo_adamw's bound), and not equal to them."""
    return all(float((a - b).abs().max()) <= 2 * EPS["fp32"] * float(b.abs().max()) for a, b in zip(now, before))


def test_a_backward_whose_step_never_comes_is_undone_before_anything_reads_the_states():
    """A checkpoint, an export or the end between a boundary backward and its step (each syncs the update
    first) sees the states as they were, not the speculation."""
    engine = make_engine("fp32", speculative=True)
    try:
        train(engine, 2)
        before = tuple(t.clone() for t in _master_and_moments(engine))
        engine.backward(engine.forward(fixed_batch(9)))  # speculates; no step follows
        drain(engine)
        assert not torch.equal(before[0], _master_and_moments(engine)[0])
        engine.sync_weights()
        assert _undone(_master_and_moments(engine), before)
        assert engine.overlap.speculation.totals["rolled_back_chunks"] > 20
    finally:
        engine.close()


def test_a_failed_speculation_is_undone_and_raised_at_the_step():
    """An error in the thread's speculative Adam (injected before the kernel writes; a real one would be e.g.
    host memory running out) undoes every chunk speculated before it and raises where the step is decided."""
    engine = make_engine("fp32", speculative=True)
    try:
        train(engine, 2)
        before = tuple(t.clone() for t in _master_and_moments(engine))
        adam = engine.overlap._adam

        def failing(i, grad, scale, hyper, step, lo=0, hi=None):
            if lo >= 4 * CHUNK:
                raise RuntimeError("injected speculative Adam failure")
            adam(i, grad, scale, hyper, step, lo, hi)

        engine.overlap._adam = failing
        engine.backward(engine.forward(fixed_batch(9)))
        drain(engine)
        with pytest.raises(RuntimeError, match="injected speculative Adam failure"):
            engine.step()
        assert _undone(_master_and_moments(engine), before)
        assert engine.overlap.speculation.totals["rolled_back_chunks"] > 0
    finally:
        engine.overlap._adam = adam
        engine.close()


def test_a_chunk_is_speculated_only_once_every_parameter_overlapping_it_is_on_the_host():
    # one group in chunks [0, 10) [10, 20) [20, 25); parameters a [0, 4), b [4, 15), c [15, 25)
    tracker = ChunkTracker([[10, 20, 25]], {"a": (0, 0, 4), "b": (0, 4, 15), "c": (0, 15, 25)})
    assert tracker.copied("c") == [(0, 2)]  # chunk 2 is c's alone; chunk 1 still needs b
    assert tracker.copied("b") == [(0, 1)]  # chunk 0 still needs a
    assert tracker.copied("a") == [(0, 0)]
    assert tracker.members((0, 1)) == ["b", "c"] and tracker.bounds(0, 1) == (10, 20)
    assert tracker.copied("a") is None  # a second copy in one backward: the caller keeps nothing
    tracker.reset()
    assert tracker.copied("b") == []
    # a chunk of padding only (no parameter) never completes
    assert ChunkTracker([[4, 8]], {"a": (0, 0, 4)}).copied("a") == [(0, 0)]


@pytest.mark.parametrize("overrides, says", [
    (dict(offload="none"), "needs --offload cpu"),
    (dict(delayed_update=True), "not the delayed update"),
    (dict(optimizer_states="bf16", precision="bf16"), "--optimizer-states fp32"),
    (dict(pipelined_update=False), "runs in the pipelined update"),
])
def test_speculation_is_refused_where_it_cannot_run(overrides, says):
    with pytest.raises(ConfigError, match=says) as raised:
        cpu_config(speculative_update=True, **overrides).validate()
    assert "\n" not in str(raised.value)


def test_speculation_is_refused_on_several_ranks_and_without_the_pipelined_update():
    from fitone.zero2 import step_mode

    ds = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    for kwargs, says in ((dict(world_size=2, on_gpu=True), "one GPU"), (dict(world_size=1, on_gpu=False),
                                                                         "give --pipelined-update")):
        with pytest.raises(ConfigError, match=says) as raised:
            step_mode.decide(ds, delayed_update=False, delayed_update_after=0, pipelined_update=None,
                             speculative_update=True, **kwargs)
        assert "\n" not in str(raised.value)
    mode = step_mode.decide(ds, delayed_update=False, delayed_update_after=0, pipelined_update=None,
                            speculative_update=True, world_size=1, on_gpu=True)
    assert mode.engine_options()["speculative"] is True


@pytest.mark.numeric
def test_a_run_with_the_flag_trains_as_the_pipelined_update():
    """fitone.train end to end (the flag through TrainConfig, the step mode and the Engine), the run's clipping
    at 1.0 left as it is, 2 micro-batches a step: the pipelined update's losses, bit for bit up to the first
    step whose speculation is undone, within fp32 rounding's drift after it."""
    import fitone

    common = dict(max_steps=6, lr=1e-3, lr_schedule="constant", warmup_steps=0, batch_size=8, grad_accum=2,
                  pipelined_update=True)
    plain = fitone.train(cpu_config(**common))
    speculated = fitone.train(cpu_config(**common, speculative_update=True))
    assert speculated.update == "pipelined"
    assert apart(speculated.losses, plain.losses, fp32_loss_drift, first_differing_step=2) == []


def test_the_plan_counts_the_undo_scratch_and_no_copy_of_the_states():
    from fitone.plan import plan
    from fitone.zero2.layout import CHUNK_ELEMENTS
    from fitone.zero2.speculative import UNDO_SCRATCH_BYTES

    t5_3b = dict(model="t5-3b", from_scratch=True, src_len=128, tgt_len=128, precision="fp16", gpu_mem="24GiB",
                 host_mem="256GiB")
    without, with_it = plan(**t5_3b), plan(**t5_3b, speculative_update=True)
    scratch = next(c.bytes for c in with_it.host if c.name == "speculation undo scratch")
    assert scratch == UNDO_SCRATCH_BYTES * CHUNK_ELEMENTS and with_it.host_total == without.host_total + scratch
    assert "speculation undo scratch" not in {c.name for c in without.host}


@pytest.mark.parametrize("spare, inside", [(1, 2), (8, 1)])
def test_the_speculative_adam_leaves_spare_cores_to_the_backward_and_gives_them_back(monkeypatch, spare, inside):
    """Its OpenMP team is the update's less SPARE_CORES (at least one thread), and the update thread's own
    setting is restored after each chunk. The update's team is fixed at 3 here, whatever this CPU has."""
    from fitone.zero2 import speculative

    monkeypatch.setattr(speculative, "SPARE_CORES", spare)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        engine = make_engine("fp32", speculative=True)
        seen: list[int] = []
        spec = engine.overlap.speculation
        original = spec._speculate_one
        monkeypatch.setattr(spec, "_speculate_one", lambda: (seen.append(torch.get_num_threads()), original()))
        try:
            train(engine, 3)
            assert seen and set(seen) == {inside}, seen
            assert spec.totals["speculated_chunks"] > 0  # the chunks really ran under that team
            assert engine.overlap._pool.submit(torch.get_num_threads).result() == 3  # given back
            assert torch.get_num_threads() == 3  # the caller's thread was never touched
        finally:
            engine.close()
    finally:
        torch.set_num_threads(before)


class _Copy:
    """Stands in for a CUDA event of one gradient copy (the CPU has none): landed or not."""

    def __init__(self, landed: bool):
        self.landed = landed

    def query(self) -> bool:
        return self.landed


def test_the_next_chunk_is_the_lowest_landed_else_the_first_given():
    """A compute-bound backward on a GPU queues every copy before most land: the chunks come in the backward's
    order (last layers first), and the lowest waiting one lands last."""
    def chunk(c: int, *landed: bool) -> tuple:
        return (0, c, 0, 1, [_Copy(x) for x in landed], [])

    backward_order = [chunk(9, True), chunk(7, True, True), chunk(5, True, False), chunk(3, False)]
    assert next_ready(backward_order) == 1  # chunk 7: the lowest whose copies have all landed
    assert next_ready([chunk(5, False), chunk(3, False), chunk(1, False)]) == 0  # none landed: the first given
    assert next_ready([chunk(4), chunk(2), (1, 0, 0, 1, [], [])]) == 1  # CPU (no events): the lowest, group first
