"""--optimizer-states bf16 / bf16-nearest / bf16-kahan on real DeepSpeed ZeRO-2 CPU-offload engines (bf16 training).

DeepSpeed's bf16 master weights and optimizer states on the lean layout, stepped by the pipelined update's
fused 16-bit step (fitone.zero2.low_precision, whose arithmetic tests/zero2/test_low_precision.py checks).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import fitone
import user_models
from conftest import cpu_config, fixed_batch, run_main, tiny_engine, weights
from fitone.errors import ConfigError, RunDirError

STEPS = 12


def _train(engine, steps: int = STEPS, accum: int = 1) -> list[float]:
    losses = []
    for step in range(steps):
        for micro in range(accum):
            loss = engine.forward(fixed_batch((step * accum + micro) % 4))  # four batches, learnable
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    engine.sync_weights()
    return losses


@pytest.mark.parametrize("states", ["bf16", "bf16-nearest"])
def test_bf16_states_train_with_accumulation_on_8_bytes_per_parameter(states):
    engine = tiny_engine("bf16", grad_accum=2, states=states)
    try:
        n = sum(p.numel() for p in engine.module.parameters())
        losses = _train(engine, accum=2)
        assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.8 * losses[0]
        # bf16 master, bf16 gradients (DeepSpeed's own buffer), two bf16 moments: 8 B/param, and no fp32 slice
        # (the fused 16-bit step reads the bf16 gradients as they are)
        held = engine.host.host_bytes()
        assert held == {"bf16 master": 2 * n, "gradients": 2 * n, "Adam moments": 4 * n, "fp32 upcast": 0}
        master = engine.optimizer.single_partition_of_fp32_groups[0]
        state = engine.optimizer.optimizer.state[master]
        assert (master.dtype, state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == (torch.bfloat16,) * 3
        # the model's weights are the master's, as they are (bf16 both)
        assert torch.equal(engine.optimizer.bit16_groups_flat[0][:master.numel()], master.data)
    finally:
        engine.close()


def test_kahan_states_train_with_accumulation_on_10_bytes_per_parameter():
    """bf16-kahan: the 8 B/param of the other bf16 states and a bf16 compensation buffer in the optimizer's
    state (2 B/param), which the steps fill with what rounding the master weights lost."""
    engine = tiny_engine("bf16", grad_accum=2, states="bf16-kahan")
    try:
        n = sum(p.numel() for p in engine.module.parameters())
        assert engine.host.host_bytes()["compensation"] == 2 * n  # made with the engine, before any step
        losses = _train(engine, accum=2)
        assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.8 * losses[0]
        assert engine.host.host_bytes() == {"bf16 master": 2 * n, "gradients": 2 * n, "Adam moments": 4 * n,
                                            "fp32 upcast": 0, "compensation": 2 * n}
        master = engine.optimizer.single_partition_of_fp32_groups[0]
        compensation = engine.optimizer.optimizer.state[master]["compensation"]
        assert compensation.dtype == torch.bfloat16 and compensation.count_nonzero() > n // 2
        # below half a bf16 spacing of its weight (2**-8 of it, 8 significant bits), where the weight is not 0
        big = master.data != 0
        assert torch.all(compensation[big].double().abs() <= master.data[big].double().abs() * 2.0**-8)
        assert torch.equal(engine.optimizer.bit16_groups_flat[0][:master.numel()], master.data)
    finally:
        engine.close()


def test_the_plan_counts_10_bytes_a_parameter_for_kahan_states():
    from fitone import checkpoint
    from fitone.plan import plan

    t5_3b = dict(model="t5-3b", from_scratch=True, src_len=128, tgt_len=128, precision="bf16", gpu_mem="24GiB",
                 host_mem="256GiB")
    nearest, kahan = (plan(**t5_3b, optimizer_states=states) for states in ("bf16-nearest", "bf16-kahan"))
    n = kahan.n_params
    assert next(c.bytes for c in kahan.host if c.name == "compensation") == 2 * n
    assert kahan.host_total - nearest.host_total == 2 * n and not any(c.name == "compensation" for c in nearest.host)
    assert kahan.checkpoint_bytes == checkpoint.checkpoint_bytes(n, "bf16", "bf16-kahan") == 10 * n + 4 * 2**20


def test_a_kahan_run_says_what_it_keeps_in_one_line():
    from fitone.run import resolve_planned
    from fitone.train_setup import step_mode_notes

    notes = step_mode_notes(resolve_planned(cpu_config(precision="bf16", optimizer_states="bf16-kahan"), 1))
    assert len(notes) == 1 and "--optimizer-states bf16-kahan" in notes[0]
    assert "10 B/param on the host" in notes[0]
    assert "rounded to the nearest, what that loses kept in a bf16 compensation buffer" in notes[0]
    plain = step_mode_notes(resolve_planned(cpu_config(precision="bf16", optimizer_states="bf16"), 1))
    assert "8 B/param on the host" in plain[0] and "rounded stochastically" in plain[0]


def test_chunked_bf16_states_are_the_same_bits_as_one_slice():
    """The stochastic bits are keyed by element index, not by where a chunk or slice starts: chunks of 1,024
    widened 256 at a time give the one-slice update, bit for bit."""
    runs = []
    for chunk in (None, 1024):
        engine = tiny_engine("bf16", states="bf16", chunk=chunk, rounding_seed=3)
        try:
            _train(engine, steps=4)
            runs.append(weights(engine))
        finally:
            engine.close()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_stochastic_rounding_depends_on_its_seed_and_differs_from_nearest():
    runs = {}
    for states, seed in (("bf16", 0), ("bf16", 0), ("bf16", 1), ("bf16-nearest", 0)):
        engine = tiny_engine("bf16", states=states, rounding_seed=seed)
        try:
            _train(engine, steps=3)
            runs.setdefault((states, seed), []).append(weights(engine))
        finally:
            engine.close()
    first, again = runs[("bf16", 0)]
    assert all(torch.equal(first[k], again[k]) for k in first)  # reproducible
    for other in (runs[("bf16", 1)][0], runs[("bf16-nearest", 0)][0]):
        assert any(not torch.equal(first[k], other[k]) for k in first)


@pytest.mark.parametrize("states", ["bf16", "bf16-kahan"])
def test_a_bf16_states_run_trains_saves_resumes_bit_exactly_and_exports(states, tmp_path):
    """bf16-kahan's checkpoint carries its compensation: without it the resumed steps would start from the
    rounded weights alone and differ."""
    from transformers import AutoModelForSeq2SeqLM

    common = dict(precision="bf16", optimizer_states=states, max_steps=10, lr=1e-3, lr_schedule="constant",
                  warmup_steps=0, batch_size=8, grad_accum=2)
    straight = fitone.train(cpu_config(**common, out=str(tmp_path / "straight"), save_every=5))
    assert straight.update == "pipelined" and straight.losses[-1] < straight.losses[0]
    out = tmp_path / "run"
    fitone.train(cpu_config(**{**common, "max_steps": 5}, out=str(out), save_every=5))
    resumed = fitone.train(cpu_config(**common, out=str(out), resume=True, save_every=5))
    assert resumed.resumed_from == 5 and resumed.losses == straight.losses[5:]  # bit for bit
    a = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "straight" / "final").state_dict()
    b = AutoModelForSeq2SeqLM.from_pretrained(out / "final").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("first, second, resumed, refused, cli_states, cli_refused", [
    ("fp32", "bf16", "bf16", "holds fp32 optimizer states and this run keeps bf16 ones: resume with "
     "--optimizer-states fp32", "fp32", "holds bf16 optimizer states and this run keeps fp32 ones"),
    # bf16 and bf16-nearest hold the same buffers and resume each other; bf16-kahan holds one more
    ("bf16-kahan", "bf16-nearest", "bf16", "holds bf16-kahan optimizer states and this run keeps bf16 ones: "
     "resume with --optimizer-states bf16-kahan", "bf16-kahan", "holds bf16 optimizer states and this run keeps "
     "bf16-kahan ones: resume with --optimizer-states bf16 (or bf16-nearest)"),
])
def test_a_checkpoint_of_the_other_mode_is_refused_in_one_line(first, second, resumed, refused, cli_states,
                                                               cli_refused, tmp_path):
    """`first`'s checkpoint resumed as `resumed` (API), `second`'s as `cli_states` (CLI)."""
    common = dict(precision="bf16", max_steps=2, batch_size=8, save_every=2)
    one, two = tmp_path / "one", tmp_path / "two"
    fitone.train(cpu_config(**common, optimizer_states=first, out=str(one)))
    fitone.train(cpu_config(**common, optimizer_states=second, out=str(two)))
    before = sorted((p.relative_to(one), p.stat().st_mtime_ns) for p in one.rglob("*"))
    with pytest.raises(RunDirError, match=re.escape(refused)):
        fitone.train(cpu_config(**{**common, "max_steps": 4}, optimizer_states=resumed, out=str(one), resume=True))
    assert sorted((p.relative_to(one), p.stat().st_mtime_ns) for p in one.rglob("*")) == before  # untouched
    code, _out, err = run_main(["train", "--model", "t5-tiny", "--from-scratch", "--data", "sample", "--src-len", "8",
                                "--tgt-len", "48", "--batch-size", "8", "--precision", "bf16", "--device", "cpu",
                                "--eval-examples", "0", "--no-progress", "--max-steps", "4", "--save-every", "2",
                                "--optimizer-states", cli_states, "--out", str(two), "--resume"])
    assert code == 2 and cli_refused in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_kahans_compensation_moves_with_a_checkpoint_into_other_parameter_groups(tmp_path, monkeypatch):
    """Saved in one group, resumed into dozens (fitone.zero2.layout.regroup_saved_state): the compensation moves
    parameter by parameter with the master and moments, so the resumed steps give the weights of resuming into
    the layout it was saved in, bit for bit (the 16-bit step is elementwise: no SIMD tail to differ)."""
    from fitone.zero2 import layout

    def engine_in(groups: int):
        monkeypatch.setattr(layout, "GROUP_ELEMENTS", groups)
        return tiny_engine("bf16", states="bf16-kahan")

    engine = engine_in(2**27)
    try:
        _train(engine, steps=3)
        engine.save(str(tmp_path), "one-group", {})
    finally:
        engine.close()
    resumed, n_groups = [], []
    for groups in (2**27, 20_000):
        engine = engine_in(groups)
        try:
            engine.load(str(tmp_path), "one-group")
            states = list(engine.optimizer.optimizer.state.values())
            assert all(s["compensation"].count_nonzero() > 0 for s in states)  # moved, not made anew
            n_groups.append(len(states))
            resumed.append(weights(engine) | {"losses": torch.tensor(_train(engine, steps=3))})
        finally:
            engine.close()
    assert n_groups[0] == 1 and n_groups[1] > 10
    assert all(torch.equal(resumed[0][k], resumed[1][k]) for k in resumed[0])


@pytest.mark.parametrize("precision, why", [("fp16", "needs --precision bf16 \\(fp16 training given\\)"),
                                            ("fp32", "needs --precision bf16 \\(fp32 training given\\)")])
def test_other_precisions_are_refused_in_one_line(precision, why):
    from fitone.run import resolve_planned

    with pytest.raises(ConfigError, match=why):
        resolve_planned(cpu_config(precision=precision, optimizer_states="bf16", device="auto"), 1)


@pytest.mark.parametrize("options, why", [
    (dict(delayed_update=True), "runs in the pipelined update: drop --delayed-update"),
    (dict(pipelined_update=False), "runs in the pipelined update: drop --no-pipelined-update"),
    (dict(offload="none"), "needs --offload cpu"),
])
def test_what_the_16bit_step_does_not_run_on_is_refused(options, why):
    from fitone.run import resolve_planned

    with pytest.raises(ConfigError, match=why):
        resolve_planned(cpu_config(precision="bf16", optimizer_states="bf16", device="auto", **options), 1)


def test_deepspeeds_bf16_master_weights_without_the_option_are_refused(tmp_path):
    import json

    from fitone.run import resolve_planned

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}))
    with pytest.raises(ConfigError, match="give --optimizer-states bf16"):
        resolve_planned(cpu_config(precision="bf16", ds_config=str(path), device="auto"), 1)


@pytest.mark.parametrize("arch, bos", [("llama3", True), ("gpt_neox", False), ("qwen3", True), ("bart", False)])
def test_bf16_states_train_and_export_users_models(arch, bos, tmp_path, text_jsonl):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    model = user_models.model_dir(arch, tmp_path / arch, bos=bos)
    seq2seq = arch in user_models.SEQ2SEQ
    data = dict(data="sample") if seq2seq else dict(data=str(text_jsonl), seq_len=32)
    result = fitone.train(cpu_config(model=str(model), from_scratch=False, precision="bf16", optimizer_states="bf16",
                                     max_steps=8, batch_size=4, grad_accum=2, lr=3e-3, out=str(tmp_path / "run"),
                                     **data))
    assert result.update == "pipelined" and result.losses[-1] < result.losses[0]
    exported = tmp_path / "run" / "final"
    loaded = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(exported)
    assert AutoConfig.from_pretrained(exported).model_type == AutoConfig.from_pretrained(model).model_type
    assert all(torch.isfinite(p).all() for p in loaded.parameters())
