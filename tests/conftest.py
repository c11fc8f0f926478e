"""Shared fixtures: tiny models saved with save_pretrained (no hub), small data files, CPU settings.

Everything here runs real DeepSpeed ZeRO-2 engines with DeepSpeedCPUAdam on the CPU; fp16 is proven
on the GPU instead (DeepSpeed's CPU accelerator refuses it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from pathlib import Path

import pytest

# DeepSpeed's JIT builds go where a user's run puts them: TORCH_EXTENSIONS_DIR if set (CI sets its own,
# .ci/run), else torch's default, so the suite reuses the quick start's build (fitone.extensions)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from fitone.cli import main
from fitone.config import TrainConfig

REPO = Path(__file__).resolve().parent.parent


def cpu_config(**overrides) -> TrainConfig:
    """A fast CPU run of the tiny T5 on the sample task."""
    values = dict(model="t5-tiny", from_scratch=True, data="sample", src_len=8, tgt_len=48, batch_size=16,
                  lr=3e-3, max_steps=30, precision="fp32", device="cpu", eval_examples=0, progress=False,
                  seed=0)
    values.update(overrides)
    return TrainConfig(**values)


def tiny_engine(precision: str = "fp32", model: str = "t5-tiny", *, grad_accum: int = 1, gpu_ds_config: bool = False,
                lean: bool = False, lean_host: bool = True, chunk: int | None = None, pipelined: bool = False,
                delayed_after: int | None = None, states: str = "fp32", rounding_seed: int = 0,
                speculative: bool = False):
    """A real ZeRO-2 CPU-offload engine on the tiny T5 (or `model`; seeded weights, micro-batch 4, constant lr
    1e-3, clip 1.0 so the clip path runs), the one engine builder of the CPU tests.

    `pipelined`, `delayed_after`: fitone.engine.Engine's own updates. `gpu_ds_config`: the DeepSpeed config a GPU
    run gets (pin_memory, overlap_comm), on this CPU engine. `lean`: the lean host layout in chunks of `chunk`
    elements with no update on it (only to compare gradients: DeepSpeed's own step is refused there), its
    LeanHost left to the test with `lean_host=False`; `chunk` with `pipelined`: the pipelined update and its
    layout built here in such chunks, instead of by the Engine. `states`: --optimizer-states (bf16 ones run the
    pipelined update, seeded by `rounding_seed`); `speculative`: the Engine's --speculative-update."""
    import torch

    from fitone.ds_config import build_ds_config
    from fitone.engine import Engine
    from fitone.run import resolve_planned, start_runtime
    from fitone.models import build_model, load_config
    from fitone.zero2 import layout, overlap

    cfg = cpu_config(precision=precision, lr=1e-3, lr_schedule="constant", warmup_steps=0, grad_accum=grad_accum,
                     optimizer_states=states)
    pipelined = pipelined or states != "fp32"
    run = start_runtime(cfg)
    torch.manual_seed(0)
    module = build_model(load_config(model, from_scratch=True))
    if gpu_ds_config:  # as planned for a GPU (the engine itself runs on the CPU)
        run = resolve_planned(cfg.replace(device="auto"), 1)
    ds = build_ds_config(run.with_batch(4).with_steps(100))
    chunked = lean or bool(pipelined and chunk)
    if chunked:
        ds = layout.lean_offload_config(ds)
    engine = Engine(module, ds, pipelined=pipelined and not chunked, delayed_after=delayed_after,
                    states="fp32" if chunked else states, rounding_seed=rounding_seed, speculative=speculative)
    if chunked and lean_host:
        # Adam's widened slices a quarter of a chunk, so the tests' chunks each run several
        engine.host = layout.LeanHost(engine.optimizer, chunk_elements=chunk,
                                      widen_elements=chunk // 4 if chunk and chunk % (4 * 256) == 0 else None)
    if pipelined and chunked:
        engine.overlap = overlap.PipelinedUpdate(engine.optimizer, engine.module, after=1, host=engine.host,
                                                 states=states, rounding_seed=rounding_seed)
    return engine


def fixed_batch(step: int, vocab: int = 256) -> dict:
    """The same 4 x 8 -> 6-token batch for the same step number, for engines compared step by step."""
    import torch

    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, vocab, (4, 8), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.randint(3, vocab, (4, 6), generator=g)}


def drain(engine) -> None:
    """Wait until every chunk the backward handed to --speculative-update's Adam has run (errors stay in their
    futures): the backward may end first, and the step would leave the rest to the update; waiting makes what is
    speculated independent of the machine's speed."""
    speculation = getattr(engine.overlap, "speculation", None)
    for future in list(speculation._futures if speculation is not None else []):
        future.exception()


def weights(engine) -> dict:
    """A copy of the engine module's parameters, by name."""
    return {k: v.detach().clone() for k, v in engine.module.named_parameters()}


def _save_tiny(name: str, path: Path) -> Path:
    """A tiny model saved like a downloaded one: config, weights and tokenizer files."""
    from fitone.models import build_model, load_config
    from transformers import ByT5Tokenizer

    build_model(load_config(name, from_scratch=True)).save_pretrained(path)
    ByT5Tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_t5_dir(tmp_path_factory) -> Path:
    return _save_tiny("t5-tiny", tmp_path_factory.mktemp("models") / "tiny-t5")


@pytest.fixture(scope="session")
def tiny_gpt_dir(tmp_path_factory) -> Path:
    return _save_tiny("gpt2-tiny", tmp_path_factory.mktemp("models") / "tiny-gpt")


@pytest.fixture(scope="session")
def text_jsonl(tmp_path_factory) -> Path:
    """A small causal-LM corpus with a learnable pattern."""
    path = tmp_path_factory.mktemp("data") / "text.jsonl"
    words = ["alpha", "beta", "gamma", "delta"]
    with open(path, "w") as f:
        for i in range(400):
            f.write(json.dumps({"text": " ".join(words[(i + k) % 4] for k in range(6))}) + "\n")
    return path


@pytest.fixture
def fake_cgroup(tmp_path, monkeypatch):
    """FAKED: a cgroup v2 memory limit on this process, as the files of a folder that fitone.memory's reader is
    pointed at (this machine's own limit is whatever it is). Returns set(limit, used), which (re)writes them."""
    from fitone import memory

    group, proc = tmp_path / "cgroup-v2" / "job", tmp_path / "proc-self-cgroup"
    group.mkdir(parents=True)
    proc.write_text("0::/job\n")
    monkeypatch.setattr(memory, "CGROUP_ROOT", group.parent)
    monkeypatch.setattr(memory, "PROC_CGROUP", proc)

    def set_usage(limit: int, used: int) -> None:
        (group / "memory.max").write_text(f"{limit}\n")
        (group / "memory.current").write_text(f"{used}\n")
        (group / "memory.stat").write_text(f"anon {used}\ninactive_file 0\n")

    return set_usage


# -- the CLI, in this process and as a child process ---------------------------------------------
# the CLI twin of cpu_config (batch 4), so a run started by the CLI resumes through fitone.train
CLI_RUN = ["--model", "t5-tiny", "--from-scratch", "--data", "sample", "--src-len", "8", "--tgt-len", "48",
           "--batch-size", "4", "--lr", "3e-3", "--seed", "0", "--precision", "fp32", "--device", "cpu",
           "--eval-examples", "0", "--no-progress"]


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def child_env(*, one_thread: bool = True, drop: tuple[str, ...] = (), **values: str) -> dict[str, str]:
    """Environment for a child process (`python -m fitone`, a script): this checkout first on the path, one OpenMP
    thread (no spinning against the test process on a shared machine; `one_thread=False` leaves the setting as it
    is), and without the torch.distributed variables an in-process run set here (the child would reuse a port in
    use) nor the variables in `drop`; `values` are set over all that."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", *drop)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    return {**env, **values}


def run_child(command: list[str], *, timeout: float, **options) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True), except that a timeout ends the child's whole process tree
    before it raises: its own children, in their own process groups or sessions too (the benchmark scripts
    start theirs so), would otherwise keep running, or keep compiling, after the test."""
    import psutil

    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            tree = [*psutil.Process(child.pid).children(recursive=True), psutil.Process(child.pid)]
        except psutil.NoSuchProcess:  # it ended just now
            tree = []
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(tree, timeout=30)
        child.communicate()
        raise
    return subprocess.CompletedProcess(command, child.returncode, out, err)


@pytest.fixture(scope="session")
def deepspeed_ops_built() -> Path:
    """The JIT ops (DeepSpeed's cpu_adam and shm_comm, by a tiny engine here; fitone's fused 16-bit and exact fp32
    steps and its GIL-releasing call of DeepSpeed's Adam) built before a test whose child may be cut short by a
    timeout or a budget: a child stopped mid-build leaves a half-built extension behind."""
    from fitone import extensions
    from fitone.zero2 import adam32, cpu_adam, low_precision

    if not all(extensions.is_built(name) for name in extensions.OPS if name not in extensions.NATIVE_OPS):
        tiny_engine().close()
    low_precision.fused_op()
    adam32.available()
    cpu_adam.load_op()
    return extensions.extensions_root()


# -- the slow marker ------------------------------------------------------------------------------
# Tests that take over ~20 s each on a loaded 2-core CPU (measured with --durations), by module file name and test
# function ("*": every test of the module, where a module-scoped fixture is the slow part). Marked here, in one
# list, so the marker does not touch the test modules; `python -m pytest -q -m "not slow"` is the quick pass and
# the README's command still runs them all.
SLOW: dict[str, tuple[str, ...]] = {
    "test_bench_pack.py": ("test_the_dry_run_trains_packed_and_unpacked_children_and_records_both",),
    "test_bench_smoke.py": ("test_every_tool_writes_a_record_with_the_promised_fields",  # the `smoke` fixture's
                            "test_step_times_are_medians_of_the_timed_steps",
                            "test_all_tools_train_the_same_model_on_the_same_data",
                            "test_each_loop_records_where_a_step_goes", "test_child_logs_and_table_are_written",
                            "test_a_causal_lm_runs_at_its_seq_len_with_accumulation",  # the `causal` fixture's
                            "test_the_split_adds_up_every_micro_batch_of_a_step",
                            "test_the_stock_loop_hands_deepspeed_the_parameter_groups",
                            "test_the_update_modes_run_as_their_own_tools",
                            "test_a_child_cut_by_a_test_timeout_leaves_no_process_behind"),
    "test_checkpoint.py": ("test_sigkill_during_a_save_keeps_the_last_complete_checkpoint_and_resume_uses_it",),
    "test_cli.py": ("test_bad_input_through_a_real_process",
                    "test_import_fitone_is_light_and_the_api_loads_on_first_use"),
    "test_sources.py": ("test_a_200k_row_parquet_trains_without_being_read_into_memory",),
    "test_distributed.py": ("*",),  # torchrun children, each test and the fixture over 60 s
    "test_multi_node.py": ("test_two_nodes_over_loopback_train_checkpoint_and_resume",  # 35-60 s each: two nodes
                           "test_deepspeeds_per_node_launcher_on_two_nodes_trains"),
    "test_extensions.py": ("test_fitone_train_after_an_interrupted_build_clears_the_lock_and_says_what_it_builds",),
    "test_faults.py": ("test_sigterm_checkpoints_says_how_to_resume_and_resume_continues",),
    "test_overlap.py": ("test_in_bf16_the_pipelined_update_follows_the_default_and_the_delayed_one_lags",
                        "test_the_pipelined_update_trains_exports_and_resumes",
                        "test_by_default_a_run_on_one_gpu_takes_the_pipelined_update_and_says_so",
                        "test_the_pipelined_update_on_a_causal_lm_with_tied_weights_and_accumulation",
                        "test_train_with_the_delayed_update_learns_exports_and_resumes"),
    "test_ranks.py": ("test_the_pipelined_update_on_several_ranks_trains_like_one_process_and_like_deepspeeds_step",
                      "test_a_resumed_pipelined_run_on_two_ranks_continues_as_the_uninterrupted_one"),  # torchrun
    "test_preflight.py": ("test_a_model_too_big_for_host_ram_is_refused_in_seconds_without_building_it",),
    "test_quiet.py": ("test_offload_none_builds_no_deepspeed_op_and_trains",
                      "test_plan_on_a_machine_without_a_gpu_prints_no_deepspeed_warning",
                      "test_on_the_cpu_a_run_that_names_no_precision_trains_in_fp32_with_a_note",
                      "test_an_unknown_model_without_a_network_is_one_line_at_once"),
    "test_run_recipes.py": ("test_the_dry_run_trains_each_recipe_in_a_child_and_records_it",),
    "test_runtime.py": ("test_a_run_destroys_the_process_group_it_made_and_keeps_its_caller_s",
                        "test_a_taken_master_port_from_the_user_is_one_line_from_the_cli"),
    "test_low_precision.py": ("test_the_fused_step_is_built_once_and_says_so_in_one_line",),  # a real build
    "test_layout.py": ("test_a_checkpoint_resumes_across_the_one_group_and_the_grouped_layouts",
                      "test_the_pipelined_update_on_the_lean_layout_follows_deepspeeds_step_with_accumulation",
                      "test_the_lean_layout_trains_bit_for_bit_as_deepspeeds_layout"),
}


@pytest.hookimpl(tryfirst=True)  # marked before `-m` deselects by the marks (SLOW's names: tests/test_tree.py)
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        names = SLOW.get(item.path.name, ())
        if "*" in names or getattr(item, "originalname", item.name) in names:
            item.add_marker(pytest.mark.slow)
