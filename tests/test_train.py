"""fitone.train end to end on the CPU with real DeepSpeed ZeRO-2 + CPU-offload engines."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import fitone
from fitone.errors import RunDirError
from conftest import cpu_config
from tolerance import LINEAR_STEPS, apart, fp32_loss_drift


def _falls(losses: list[float], factor: float) -> bool:
    head = sum(losses[:3]) / 3
    tail = sum(losses[-3:]) / 3
    return tail < head * factor


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tiny_t5_loss_falls_with_zero2_offload(precision):
    result = fitone.train(cpu_config(precision=precision, max_steps=40))
    assert result.steps == 40
    assert all(math.isfinite(x) for x in result.losses)
    assert _falls(result.losses, 0.5), result.losses
    assert result.precision == precision and result.skipped_steps == 0


def test_engine_is_zero2_with_cpu_adam(monkeypatch):
    """The optimizer really is DeepSpeedCPUAdam under a ZeRO stage-2 optimizer (not a silent fallback)."""
    from fitone.train import Trainer

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)  # an earlier in-process run leaves them set: this one must set them
    run = Trainer(cpu_config(max_steps=1))
    try:
        run.setup()
        assert type(run.engine.optimizer).__name__ == "DeepSpeedZeroOptimizer"
        assert type(run.engine.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"
        assert run.engine.ds.zero_optimization_stage() == 2
        assert run.engine.ds.zero_cpu_offload()
        assert run.loaded.model.is_gradient_checkpointing
        # facts of DeepSpeed's CPU accelerator: gloo, and the launcher's env vars filled in-process
        import os

        import torch.distributed as dist

        assert dist.get_backend() == "gloo"
        assert {os.environ[k] for k in ("RANK", "LOCAL_RANK")} == {"0"} and os.environ["WORLD_SIZE"] == "1"
        assert int(os.environ["MASTER_PORT"]) > 0
    finally:
        run.cleanup()


def test_tiny_causal_lm_loss_falls(tiny_gpt_dir, text_jsonl):
    result = fitone.train(cpu_config(model=str(tiny_gpt_dir), from_scratch=False, data=str(text_jsonl),
                                     seq_len=64, batch_size=8, max_steps=30, precision="bf16"))
    assert _falls(result.losses, 0.5), result.losses


def test_causal_lm_with_a_prompt_field_learns_the_answers(tiny_gpt_dir, tmp_path):
    """Instruction-style rows: the loss (and the held-out score) covers the answers only, so it falls to
    what the answers alone cost; the prompts are many and random, the answers a function of them."""
    import json
    import random

    words = ["alpha", "beta", "gamma", "delta"]
    rng = random.Random(0)

    def rows(n):
        out = []
        for _ in range(n):
            prompt = " ".join(rng.choice(words) for _ in range(4))
            out.append({"instruction": prompt, "answer": " " + prompt.split()[-1].upper()})
        return "".join(json.dumps(r) + "\n" for r in out)

    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    train.write_text(rows(400))
    dev.write_text(rows(32))
    result = fitone.train(cpu_config(model=str(tiny_gpt_dir), from_scratch=False, data=str(train),
                                     eval_data=str(dev), eval_examples=32, prompt_field="instruction",
                                     text_field="answer", seq_len=64, batch_size=8, max_steps=40, lr=3e-3))
    assert _falls(result.losses, 0.5), result.losses
    assert result.quality["token_accuracy"] > 0.5  # over the answers' tokens only
    # the same rows with the prompt trained on too: the random prompt words now count in the loss
    merged = tmp_path / "merged.jsonl"
    merged.write_text("".join(json.dumps({"text": r["instruction"] + r["answer"]}) + "\n"
                              for r in map(json.loads, train.read_text().splitlines())))
    whole = fitone.train(cpu_config(model=str(tiny_gpt_dir), from_scratch=False, data=str(merged), seq_len=64,
                                    batch_size=8, max_steps=40, lr=3e-3))
    assert sum(result.losses[-5:]) < 0.5 * sum(whole.losses[-5:])


def test_pretrained_dir_trains_and_export_loads_and_generates(tiny_t5_dir, tmp_path):
    out = tmp_path / "run"
    result = fitone.train(cpu_config(model=str(tiny_t5_dir), from_scratch=False, max_steps=20, out=str(out)))
    assert _falls(result.losses, 0.7)
    final = out / "final"
    assert result.final_dir == str(final)
    model = AutoModelForSeq2SeqLM.from_pretrained(final)  # no DeepSpeed involved
    tok = AutoTokenizer.from_pretrained(final)
    ids = tok(["42"], return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=8)
    assert generated.shape[0] == 1 and generated.shape[1] > 1
    # the exported weights are the trained ones, not the initial ones
    initial = AutoModelForSeq2SeqLM.from_pretrained(tiny_t5_dir)
    assert not torch.equal(model.shared.weight, initial.shared.weight)
    metrics = (out / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 20
    import json

    first = json.loads(metrics[0])
    for key in ("step", "loss", "lr", "samples_per_s", "gpu_peak_gib", "host_rss_gib"):
        assert key in first


def test_the_export_holds_the_engines_weights_tensor_for_tensor(tmp_path):
    """DIR/final/, loaded with from_pretrained (no DeepSpeed), equals the engine's module after the run in
    every tensor (tied ones and buffers included) after the cast to the engine's dtype; bf16 with the
    pipelined update, whose last update must land before the export: the weights are the fp32 masters
    rounded to bf16."""
    from fitone.train import Trainer

    run = Trainer(cpu_config(precision="bf16", pipelined_update=True, max_steps=4, out=str(tmp_path / "run")))
    try:
        run.setup()
        result = run.train()
        module = run.engine.module
        engine_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        flat = torch.cat([p.detach().flatten() for p in module.parameters()])
        master = run.engine.optimizer.single_partition_of_fp32_groups[0].detach()[: flat.numel()].clone()
    finally:
        run.cleanup()
    assert torch.equal(flat, master.to(torch.bfloat16))  # the last update is in the module
    exported = AutoModelForSeq2SeqLM.from_pretrained(result.final_dir).state_dict()
    assert exported.keys() == engine_state.keys()
    assert all(torch.equal(exported[k].to(v.dtype), v) for k, v in engine_state.items())


def test_eval_data_scores_the_users_held_out_file(tmp_path, text_jsonl):
    """--eval-data: the same numbers the shipped sample's own held-out set gives when it is that file, under
    the user's field names; a user's training file alone is never split to make one."""
    import json

    from fitone.data import SAMPLE_EVAL, data_file
    from fitone.models import CAUSAL, SEQ2SEQ

    shipped_rows = [json.loads(line) for line in SAMPLE_EVAL.read_text().splitlines()]
    renamed, wrong = tmp_path / "held-out.jsonl", tmp_path / "wrong-answers.jsonl"
    renamed.write_text("".join(json.dumps({"question": r["source"], "answer": r["target"]}) + "\n"
                               for r in shipped_rows))
    wrong.write_text("".join(json.dumps({"question": r["source"], "answer": r["target"][::-1]}) + "\n"
                             for r in shipped_rows))
    common = dict(max_steps=6, eval_examples=16, lr=1e-2)
    shipped = fitone.train(cpu_config(**common))
    users = fitone.train(cpu_config(**common, eval_data=str(renamed), source_field="question", target_field="answer"))
    assert set(users.quality) == {"eval_loss", "token_accuracy", "exact_match"}
    assert users.quality == pytest.approx(shipped.quality, rel=1e-6)
    # the file really is what gets scored: reversed answers cost the trained model more
    reversed_ = fitone.train(cpu_config(**common, eval_data=str(wrong), source_field="question",
                                        target_field="answer"))
    assert reversed_.quality["eval_loss"] > 1.2 * shipped.quality["eval_loss"]
    assert data_file(cpu_config(data=str(text_jsonl)).data_settings(), CAUSAL, split="eval") is None
    assert data_file(cpu_config(data="synthetic").data_settings(), SEQ2SEQ, split="eval") is None


def test_eval_every_scores_during_the_run_and_logs_each_score(tmp_path):
    """Every 3 steps and at the end, into metrics.jsonl (what `fitone report` draws) and the result; with the
    pipelined update the pending update lands before each score, so the scores are the plain run's."""
    import json

    from fitone.report import read_run, summarize

    common = dict(max_steps=7, eval_every=3, eval_examples=8, lr=1e-3, lr_schedule="constant", warmup_steps=0)
    plain = fitone.train(cpu_config(**common, out=str(tmp_path / "run")))
    assert [e["step"] for e in plain.evals] == [3, 6, 7]
    assert plain.evals[-1] == {"step": 7, **plain.quality}
    assert plain.evals[0]["eval_loss"] > plain.evals[-1]["eval_loss"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6, 7]
    assert len([r for r in records if "loss" in r]) == 7
    assert summarize(read_run(tmp_path / "run")).eval["eval_loss"] == pytest.approx(plain.quality["eval_loss"])
    pipelined = fitone.train(cpu_config(**common, pipelined_update=True))
    for got, want in zip(pipelined.evals, plain.evals, strict=True):
        # weights from step - 1 pipelined updates (step 1 is DeepSpeed's): fp32 rounding of two Adam
        # implementations (tolerance.py); a counted token would flip only on a near-tie of two logits
        assert [got[k] for k in ("step", "token_accuracy", "exact_match")] == \
            [want[k] for k in ("step", "token_accuracy", "exact_match")]
        assert abs(got["eval_loss"] - want["eval_loss"]) <= fp32_loss_drift(want["eval_loss"], steps=got["step"] - 1)
    # the delayed update holds step N's update until step N+1's backward: a score at step 3 must first
    # apply it, and so equal the final score of the same run stopped at step 3
    delayed = dict(common, delayed_update=True, delayed_update_after=1)
    along = fitone.train(cpu_config(**delayed))
    stopped = fitone.train(cpu_config(**{**delayed, "max_steps": 3, "eval_every": None}))
    assert along.evals[0] == pytest.approx({"step": 3, **stopped.quality}, rel=1e-6)
    assert along.evals[0]["eval_loss"] != pytest.approx(along.evals[1]["eval_loss"], rel=1e-3)


def test_metrics_log_the_gradient_norm_and_the_overlapped_updates_own_counters(tmp_path):
    """Each step's record holds the gradient norm before clipping and, under the pipelined update, its last
    completed update's thread time, wait and speculation counters: what says why one step was slower."""
    import json

    cfg = cpu_config(max_steps=4, grad_clip=100.0, pipelined_update=True, speculative_update=True,
                     out=str(tmp_path / "run"))
    fitone.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows)
    later = rows[1:]  # from step 2 on, the record carries step - 1's update
    assert all(r["update_thread_s"] > 0 and r["update_wait_s"] >= 0 for r in later)
    # no clipping at 100: every chunk speculated and kept, or left to the update when the backward ended first
    assert sum(r["update_speculated_chunks"] + r["update_unstarted_chunks"] for r in later) > 0
    assert all(r["update_rolled_back_chunks"] == 0 for r in later)
    plain = fitone.train(cpu_config(max_steps=2, pipelined_update=False, out=str(tmp_path / "plain")))
    assert plain.update == "deepspeed"
    rows = [json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["grad_norm"] > 0 for r in rows) and not any(k.startswith("update_") for r in rows for k in r)


def test_a_held_out_score_that_runs_out_of_gpu_memory_is_skipped_and_training_goes_on(monkeypatch, capsys):
    """The CPU cannot run out of GPU memory: a hook raises torch.OutOfMemoryError in the model's forward
    while it is in eval mode, for the mid-run score at step 2 only."""
    from fitone.train import Trainer

    setup = Trainer._setup_model

    def with_oom_in_eval(self, *args):
        loaded = setup(self, *args)
        model = loaded.model

        def hook(module, _inputs):
            if not module.training and self.state["step"] == 2:
                raise torch.OutOfMemoryError("CUDA out of memory (faked)")
        model.register_forward_pre_hook(hook)
        return loaded

    monkeypatch.setattr(Trainer, "_setup_model", with_oom_in_eval)
    result = fitone.train(cpu_config(max_steps=6, eval_every=2, eval_examples=8))
    assert [e["step"] for e in result.evals] == [4, 6] and result.steps == 6
    said = capsys.readouterr()
    assert "held-out scoring at step 2 ran out of GPU memory and was skipped" in said.out + said.err


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_decaying_schedule_without_warm_up_runs(schedule):
    """DeepSpeed 0.19's schedulers refuse warmup_num_steps 0 (fitone's default warm-up): this crashed once."""
    result = fitone.train(cpu_config(max_steps=6, lr_schedule=schedule, warmup_steps=0, lr=1e-3))
    peak = result.lrs.index(max(result.lrs))
    assert peak <= 2 and result.lrs[peak:] == sorted(result.lrs[peak:], reverse=True)
    assert result.lrs[-1] < 0.5 * max(result.lrs)


@pytest.mark.numeric
def test_resume_continues_the_uninterrupted_curve(tmp_path):
    """Stop after 10 steps, resume to 20: steps 11-20 are the uninterrupted run's, bit for bit (CPU: every
    state is restored exactly, DeepSpeedCPUAdam's running bias-correction powers replayed)."""
    common = dict(max_steps=20, warmup_steps=5, lr_schedule="constant", batch_size=8)
    straight = fitone.train(cpu_config(**common))
    out = tmp_path / "run"
    first = fitone.train(cpu_config(**{**common, "max_steps": 10}, out=str(out), save_every=10))
    assert first.losses == straight.losses[:10]
    resumed = fitone.train(cpu_config(**common, out=str(out), resume=True, save_every=10))
    assert resumed.resumed_from == 10
    assert resumed.steps == 20 and len(resumed.losses) == 10  # the run's steps; this call's losses
    assert resumed.losses == straight.losses[10:]
    steps = [int(__import__("json").loads(line)["step"]) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))


def test_existing_run_dir_is_not_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(RunDirError, match="--resume .* --overwrite"):
        fitone.train(cpu_config(out=str(out)))
    assert (out / "keep.txt").read_text() == "precious"
    with pytest.raises(RunDirError, match="nothing to resume"):
        fitone.train(cpu_config(out=str(out), resume=True))


def _steps_taken(cfg) -> tuple[object, int, int]:
    """Train; return the result and DeepSpeed's own counts of optimizer steps and micro-steps."""
    from fitone.train import Trainer

    run = Trainer(cfg)
    try:
        run.setup()
        result = run.train()
        return result, run.engine.ds.global_steps, run.engine.ds.micro_steps
    finally:
        run.cleanup()


def test_global_batch_derives_accumulation():
    result, steps, micro_steps = _steps_taken(cpu_config(batch_size=4, global_batch=16, max_steps=3))
    assert result.grad_accum == 4 and result.steps == 3
    assert (steps, micro_steps) == (3, 12)  # DeepSpeed stepped once per 4 micro-batches


@pytest.mark.numeric
def test_two_micro_batches_of_two_train_as_one_micro_batch_of_four():
    """2 x 2 (micro-batch x accumulation) against 4 x 1: the same 4 examples per optimizer step, in the same
    order. Synthetic data has every example at full length, so each micro-batch's token mean weighs its
    tokens as the batch of 4 does: the same arithmetic summed in another order."""
    common = dict(data="synthetic", src_len=8, tgt_len=8, max_steps=LINEAR_STEPS, lr=1e-3, lr_schedule="constant",
                  warmup_steps=0)
    accumulated, steps, micro_steps = _steps_taken(cpu_config(**common, batch_size=2, grad_accum=2))
    whole, whole_steps, whole_micro = _steps_taken(cpu_config(**common, batch_size=4))
    assert accumulated.grad_accum == 2 and whole.grad_accum == 1
    assert (steps, micro_steps) == (LINEAR_STEPS, 2 * LINEAR_STEPS)
    assert (whole_steps, whole_micro) == (LINEAR_STEPS, LINEAR_STEPS)
    # sums in another order: fp32 rounding from the first loss on (tolerance.py)
    assert apart(accumulated.losses, whole.losses, fp32_loss_drift, first_differing_step=1) == []
    # and not by chance: a run on other examples is further apart than that
    shifted, _, _ = _steps_taken(cpu_config(**common, batch_size=4, seed=1))
    assert apart(shifted.losses, whole.losses, fp32_loss_drift, first_differing_step=1) != []


def test_a_finished_training_lets_go_of_its_engine_even_while_the_engine_object_is_held(monkeypatch):
    """A notebook re-running a training cell may still hold the last run's objects: closing the engine must
    release DeepSpeed's engine, its ZeRO optimizer and DeepSpeedCPUAdam (the memory), and the next run works.
    The Engine objects themselves are kept alive here on purpose, as such a notebook would."""
    import gc
    import importlib
    import weakref

    from fitone.engine import Engine

    held, parts = [], []

    class Held(Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            held.append(self)
            parts.append([weakref.ref(x) for x in (self.ds, self.optimizer, self.optimizer.optimizer, self.ds.module)])

    monkeypatch.setattr(importlib.import_module("fitone.build"), "Engine", Held)  # training's engine is built there
    first = fitone.train(cpu_config(max_steps=3))
    second = fitone.train(cpu_config(max_steps=3))
    assert first.losses == second.losses  # the second run in the process trains as the first did
    gc.collect()
    assert len(held) == 2
    assert [[ref() is None for ref in refs] for refs in parts] == [[True] * 4] * 2
