"""Atomic checkpoints: a run killed in the middle of a save keeps its last complete checkpoint, and
`--resume` picks the newest complete one and cleans up the leftover."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fitone
from fitone import checkpoint, hf_export
from fitone.errors import RunDirError
from fitone.metrics import MetricsLog, read_metrics

from conftest import cpu_config
from conftest import CLI_RUN, child_env, run_main
import user_models

# SIGKILL arrives while DeepSpeed is writing the optimizer file of the second checkpoint: half of
# that file is on disk, the rest never comes. Patched in a child process only; fitone has no hook.
KILL_MID_SAVE = textwrap.dedent('''
    import io, os, signal, sys
    import torch

    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if ".tmp-step-00000002" in str(f) and "optim_states" in str(f):
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            with open(f, "wb") as out:
                out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                out.flush()
                os.fsync(out.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    from fitone.cli import main
    sys.exit(main(sys.argv[1:]))
''')


def test_sigkill_during_a_save_keeps_the_last_complete_checkpoint_and_resume_uses_it(tmp_path):
    out = tmp_path / "run"
    driver = tmp_path / "kill_mid_save.py"
    driver.write_text(KILL_MID_SAVE)
    argv = ["train", *CLI_RUN, "--max-steps", "3", "--save-every", "1", "--out", str(out)]
    child = subprocess.run([sys.executable, str(driver), *argv], env=child_env(), capture_output=True, text=True,
                           timeout=400)
    assert child.returncode == -9, child.stderr[-2000:]

    root = checkpoint.checkpoint_root(out)
    leftover = root / ".tmp-step-00000002"
    assert leftover.is_dir()  # the half-written save is there ...
    assert checkpoint.latest(out) == root / "step-00000001"  # ... and ignored
    assert checkpoint.read_state(root / "step-00000001")["step"] == 1
    killed_curve = {r["step"]: r["loss"] for r in read_metrics(out)}
    assert sorted(killed_curve) == [1, 2]  # step 2 was trained and logged, then killed while saving

    resumed = fitone.train(cpu_config(batch_size=4, max_steps=3, save_every=1, keep_checkpoints=2, out=str(out),
                                      resume=True))
    assert resumed.resumed_from == 1 and resumed.steps == 3 and len(resumed.losses) == 2
    assert not leftover.exists()  # cleaned on resume
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step-00000002", "step-00000003"]  # keep 2
    assert not list(root.glob(".tmp-*"))
    # step 2 again from the step-1 checkpoint: the killed run's step-2 loss, bit for bit (exact resume)
    assert resumed.losses[0] == killed_curve[2]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


class _WritingEngine:
    """Stands in for DeepSpeed where the test is about the files around it: writes one file per save,
    or fails half-way with a full disk (a test cannot fill the disk for real)."""

    def __init__(self, disk_full: bool = False, error: BaseException | None = None):
        self.disk_full, self.saves = disk_full, 0
        self.error = error or OSError(errno.ENOSPC, "No space left on device")

    def save(self, save_dir: str, tag: str, client_state: dict) -> None:
        self.saves += 1
        (Path(save_dir) / tag).mkdir()
        (Path(save_dir) / tag / "model_states.pt").write_bytes(b"half")
        if self.disk_full:
            raise self.error


@pytest.mark.parametrize("error, said", [
    (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    # what torch.save's zip writer raised on a full disk on the GPU machine
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 29470354816 vs 29470354712"),
     "unexpected pos 29470354816 vs 29470354712")])
def test_a_full_disk_during_a_save_keeps_the_earlier_checkpoints_and_says_so(tmp_path, error, said):
    first = checkpoint.save(_WritingEngine(), tmp_path, 1, {"step": 1}, keep=2, is_main=True)
    with pytest.raises(RunDirError, match=said + r"; free disk space .* --resume .*step-00000001"):
        checkpoint.save(_WritingEngine(disk_full=True, error=error), tmp_path, 2, {"step": 2}, keep=2, is_main=True)
    assert checkpoint.latest(tmp_path) == first
    assert [p.name for p in checkpoint.checkpoint_root(tmp_path).iterdir()] == ["step-00000001"]


def test_a_step_already_saved_is_not_rewritten_and_only_the_newest_k_are_kept(tmp_path):
    engine = _WritingEngine()
    for step in (1, 2, 3, 3):  # the repeat: a stop request right after a periodic save
        checkpoint.save(engine, tmp_path, step, {"step": step}, keep=2, is_main=True)
    assert engine.saves == 3
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    assert json.loads((tmp_path / "checkpoints" / "step-00000003" / checkpoint.STATE_FILE).read_text())["step"] == 3


def test_metrics_cut_mid_line_by_a_kill_are_read_and_trimmed_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    MetricsLog(path, resume_step=2)
    assert path.read_text() == "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2))


def test_export_copies_weights_to_the_host_instead_of_cloning_them_on_their_device(tmp_path):
    """DeepSpeed's weights share flat buffers; save_pretrained clones such tensors where they are, which on
    a full GPU is a second copy of the model (llama-7b ran out of memory there). The export hands it one
    host copy per distinct tensor instead: nothing is cloned, and tied weights stay tied."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForSeq2SeqLM, ByT5Tokenizer

    from conftest import tiny_engine

    class Clones(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.clone.default:
                Clones.count += 1
            return func(*args, **(kwargs or {}))

    engine = tiny_engine()
    try:
        flat = engine.optimizer.bit16_groups_flat[0]
        assert any(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                   for p in engine.module.parameters())  # the premise: weights live in a shared buffer
        with Clones():
            final = hf_export.export(engine.module, ByT5Tokenizer(), tmp_path)
        assert Clones.count == 0
        loaded = AutoModelForSeq2SeqLM.from_pretrained(final).state_dict()
        for name, tensor in engine.module.state_dict().items():
            assert torch.equal(loaded[name], tensor), name
        assert loaded["shared.weight"].data_ptr() == loaded["encoder.embed_tokens.weight"].data_ptr()
        assert not (tmp_path / ".tmp-final").exists()
    finally:
        engine.close()


SMALL_SHARD = 300_000  # bytes: the tiny models' exports split into several shards (as a 7B one does at 2GB),
# each above their largest weight (a larger one gets a shard of its own)


def _loads_equal_to(final, engine, auto) -> dict:
    import torch

    loaded = auto.from_pretrained(final).state_dict()
    for name, tensor in engine.module.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    return loaded


def test_a_sharded_export_has_a_valid_index_and_loads_equal_to_the_engine(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForSeq2SeqLM, ByT5Tokenizer

    from conftest import tiny_engine

    engine = tiny_engine()
    try:
        final = hf_export.export(engine.module, ByT5Tokenizer(), tmp_path, shard_size=SMALL_SHARD)
        index = json.loads((final / "model.safetensors.index.json").read_text())
        shards = sorted(final.glob("model-*-of-*.safetensors"))
        assert len(shards) > 2 and not (final / "model.safetensors").exists()
        assert sorted(set(index["weight_map"].values())) == [p.name for p in shards]
        total = 0
        for shard in shards:
            with safe_open(shard, "pt") as f:
                assert sorted(f.keys()) == sorted(k for k, v in index["weight_map"].items() if v == shard.name)
                total += sum(f.get_tensor(k).nbytes for k in f.keys())
        assert index["metadata"]["total_size"] == total
        loaded = _loads_equal_to(final, engine, AutoModelForSeq2SeqLM)
        assert loaded["shared.weight"].data_ptr() == loaded["encoder.embed_tokens.weight"].data_ptr()
    finally:
        engine.close()


def test_the_export_holds_at_most_one_shard_of_weights_on_the_host_at_a_time(tmp_path, monkeypatch):
    """A whole 7B model copied to the host for the export would not fit beside training's host memory: each
    shard's host copies are written and released before the next shard is copied. Every host storage a
    torch op makes during the export (the model's own excepted: it lives on the CPU here) is tracked, and
    those alive are summed whenever a shard is written."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from transformers import ByT5Tokenizer

    from conftest import tiny_engine

    engine = tiny_engine()
    model_storages = {t.untyped_storage().data_ptr() for t in engine.module.state_dict().values()}
    made: dict[int, tuple[weakref.ref, int]] = {}  # host storage -> (a tensor on it, its bytes)

    def alive() -> int:
        return sum(size for ref, size in made.values() if ref() is not None)

    def alive_ref(ptr: int):
        return made[ptr][0]() if ptr in made else None

    class HostCopies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in model_storages and alive_ref(storage.data_ptr()) is None:
                        made[storage.data_ptr()] = (weakref.ref(t), storage.nbytes())
            return out

    real_save_file = hf_export.save_file
    written: list[tuple[int, int]] = []  # (bytes handed to save_file, host bytes alive then)

    def save_file(tensors, filename, metadata=None):
        written.append((sum(t.nbytes for t in tensors.values()), alive()))
        real_save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(hf_export, "save_file", save_file)
    try:
        with HostCopies():
            hf_export.export(engine.module, ByT5Tokenizer(), tmp_path, shard_size=SMALL_SHARD)
        distinct = {t.data_ptr(): t.nbytes for t in engine.module.state_dict().values()}
    finally:
        engine.close()
    assert len(written) > 2
    assert all(shard <= alive_then <= SMALL_SHARD for shard, alive_then in written), written
    assert sum(shard for shard, _ in written) == sum(distinct.values())  # every weight once, tied ones too
    assert alive() < 1000  # nothing kept after the export


def test_a_causal_lm_with_a_tied_lm_head_round_trips(tmp_path):
    from transformers import AutoModelForCausalLM, ByT5Tokenizer

    from conftest import tiny_engine

    engine = tiny_engine("bf16", model="gpt2-tiny")
    try:
        final = hf_export.export(engine.module, ByT5Tokenizer(), tmp_path, shard_size=SMALL_SHARD)
        loaded = _loads_equal_to(final, engine, AutoModelForCausalLM)
        assert loaded["lm_head.weight"].data_ptr() == loaded["transformer.wte.weight"].data_ptr()
        assert (final / "generation_config.json").is_file() and (final / "tokenizer_config.json").is_file()
    finally:
        engine.close()


@pytest.mark.parametrize("model, precision", [("t5-tiny", "fp32"), ("gpt2-tiny", "bf16")])
def test_the_export_writes_what_save_pretrained_writes(tmp_path, model, precision):
    """Same files, same tensors under the same names in the same shards, same config and index as save_pretrained
    given one host copy per distinct tensor (the export before it streamed; given ZeRO-2's views themselves,
    save_pretrained counts a tied weight's size as its whole flat buffer's in the index's total_size)."""
    from transformers import ByT5Tokenizer

    from conftest import tiny_engine

    engine = tiny_engine(precision, model=model)
    try:
        # save_pretrained records both in the config: the export must too, whatever the config held before
        engine.module.config.architectures, engine.module.config.dtype = None, None
        final = hf_export.export(engine.module, ByT5Tokenizer(), tmp_path / "ours", shard_size=SMALL_SHARD)
        engine.module.save_pretrained(tmp_path / "theirs", state_dict=hf_export.host_state_dict(engine.module),
                                      max_shard_size=SMALL_SHARD)
    finally:
        engine.close()
    _assert_same_files(final, tmp_path / "theirs")
    config = json.loads((final / "config.json").read_text())
    assert config["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[precision] and config["architectures"]


def _assert_same_files(final: Path, theirs: Path) -> None:
    """final/ holds, beside the tokenizer's files, the files of `theirs` (a save_pretrained dir): the same
    JSON, and the same tensors under the same names, metadata and shards."""
    import torch
    from safetensors import safe_open

    ours = sorted(p.name for p in final.iterdir() if not p.name.startswith(("tokenizer", "added_tokens", "special")))
    assert ours == sorted(p.name for p in theirs.iterdir())
    for name in ours:
        if name.endswith(".json"):
            assert json.loads((final / name).read_text()) == json.loads((theirs / name).read_text()), name
            continue
        with safe_open(final / name, "pt") as a, safe_open(theirs / name, "pt") as b:
            assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys()), name
            for key in a.keys():
                assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


# the user architectures whose weights transformers renames or fuses on load (and reverts on save): save_pretrained
# exports them; every other one streams
CONVERTED_ON_LOAD = {"gpt_neox", "mixtral", "qwen2_moe", "olmoe"}


@pytest.mark.parametrize("arch", user_models.ARCHITECTURES)
def test_a_users_model_dir_exports_what_save_pretrained_writes(tmp_path, monkeypatch, arch):
    """Each architecture of a user's own directory (tests/user_models.py, its own tokenizer; BOS-adding or not
    as the family's), loaded as fitone loads it (from_pretrained): final/ holds save_pretrained's files, streamed
    one shard at a time unless transformers converts the model's weights on load."""
    from fitone.models import load_model

    path = user_models.model_dir(arch, tmp_path / "user", bos=user_models.family_bos(arch))
    loaded = load_model(str(path), from_scratch=False)
    model = loaded.model
    streamed: list[str] = []
    real_write = hf_export._write_weights
    monkeypatch.setattr(hf_export, "_write_weights", lambda *a: streamed.append("stream") or real_write(*a))
    final = hf_export.export(model, loaded.tokenizer, tmp_path / "ours", shard_size=SMALL_SHARD)
    assert streamed == ([] if arch in CONVERTED_ON_LOAD else ["stream"])
    model.save_pretrained(tmp_path / "theirs", state_dict=hf_export.host_state_dict(model),
                          max_shard_size=SMALL_SHARD)
    _assert_same_files(final, tmp_path / "theirs")


def test_a_model_whose_weights_are_renamed_on_save_is_exported_by_save_pretrained(tmp_path):
    """transformers reverts load-time weight conversions when saving (revert_weight_conversion); the stream
    does not, so such models go through save_pretrained with a host copy: the files carry the saved names."""
    from safetensors import safe_open
    from transformers import ByT5Tokenizer
    from transformers.core_model_loading import WeightRenaming

    from fitone.models import build_model, load_config

    model = build_model(load_config("gpt2-tiny", from_scratch=True))
    model._weight_conversions = [WeightRenaming(r"^legacy\.", "transformer.")]  # as if loaded from legacy.* names
    final = hf_export.export(model, ByT5Tokenizer(), tmp_path)
    with safe_open(final / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "legacy.wte.weight" in names and not any(n.startswith("transformer.") for n in names)


def test_an_untested_transformers_gets_save_pretrained_and_one_warning_line(tmp_path, monkeypatch):
    """The stream follows transformers' internals as read from the tested versions: under another version
    (a monkeypatched version string stands in for installing one) final/ is written by save_pretrained,
    which loads the same, and the run is told once how to get the streamed export back."""
    import torch
    from transformers import AutoModelForCausalLM, ByT5Tokenizer

    from fitone.models import build_model, load_config

    assert hf_export.untested_transformers() is None  # the installed one is tested
    assert [hf_export.untested_transformers(v) is None for v in ("5.17.0", "5.25.1", "5.16.2", "5.26.0.dev0",
                                                                  "6.0.0", "weird")] == [True, True] + [False] * 4
    model = build_model(load_config("gpt2-tiny", from_scratch=True))
    streamed: list[str] = []
    real_write = hf_export._write_weights
    monkeypatch.setattr(hf_export, "_write_weights", lambda *a: streamed.append("stream") or real_write(*a))
    said: list[str] = []
    hf_export.export(model, ByT5Tokenizer(), tmp_path / "tested", say=said.append)
    assert streamed == ["stream"] and said == []

    # the module that `import transformers` finds now (by here, no longer always the one imported above)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.30.0")
    final = hf_export.export(model, ByT5Tokenizer(), tmp_path / "untested", say=said.append)
    assert len(said) == 1, said
    assert streamed == ["stream"]  # save_pretrained wrote it
    assert said[0].startswith("warning: ") and "transformers 5.30.0 is installed" in said[0]
    assert "pip install 'transformers>=5.17,<5.26'" in said[0] and "\n" not in said[0]
    loaded = AutoModelForCausalLM.from_pretrained(final).state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in model.state_dict().items())


# -- what a save costs: disk and host RAM -----------------------------------------------------------
def _stepped_engine(precision: str, model: str, states: str = "fp32"):
    """A real engine after one optimizer step (Adam's moments exist from the first)."""
    from conftest import fixed_batch, tiny_engine

    engine = tiny_engine(precision, model=model, states=states)
    batch = fixed_batch(1)
    if model.startswith("gpt2"):
        batch = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                 "labels": batch["input_ids"]}
    engine.backward(engine.forward(batch))
    engine.step()
    return engine


@pytest.mark.parametrize("model, precision, states", [("t5-tiny", "fp32", "fp32"), ("gpt2-tiny", "bf16", "fp32"),
                                                     ("gpt2-tiny", "bf16", "bf16"),
                                                     ("gpt2-tiny", "bf16", "bf16-kahan")])
def test_a_checkpoints_bytes_on_disk_are_what_checkpoint_bytes_counts(tmp_path, model, precision, states):
    """The weights as trained + the fp32 master + Adam's two fp32 moments per parameter (bf16 ones with
    --optimizer-states bf16), and a little: the per-parameter part is pinned to the byte (a byte per
    parameter off would be ~0.5-1 MB here)."""
    engine = _stepped_engine(precision, model, states)
    try:
        ckpt = checkpoint.save(engine, tmp_path, 1, {"step": 1}, keep=1, is_main=True)
        n_params = sum(p.numel() for p in engine.module.parameters())  # tied weights once
    finally:
        engine.close()
    written = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    per_param = checkpoint.checkpoint_bytes(n_params, precision, states) - checkpoint.CHECKPOINT_OVERHEAD
    assert per_param <= written <= per_param + 256 * 2**10, (written, per_param)  # the rest: scripts, pickles
    assert written <= checkpoint.checkpoint_bytes(n_params, precision, states)


def test_a_save_copies_nothing_that_lies_on_the_host(tmp_path):
    """The premise of save_host_bytes: DeepSpeed's ZeRO-2 save hands torch.save the optimizer's own host buffers
    (views, no clones), which torch.save writes from where they lie. Every storage a torch op makes during the
    save is counted: a handful of bytes, where a copy of the fp32 master alone would be 4 MB. On the CPU nothing
    lies off the host, so the estimate is its cushion; what a GPU's weights add (the largest 16-bit group, copied
    one at a time by torch.save) cannot be made here."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    engine = _stepped_engine("bf16", "t5-tiny")
    held = {t.untyped_storage().data_ptr()
            for t in [*engine.module.state_dict().values(), *checkpoint._tensors(engine.optimizer.state_dict())]}
    made: dict[int, int] = {}

    class NewStorages(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held:
                    made[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return out

    try:
        assert checkpoint.save_host_bytes(engine) == checkpoint.SAVE_HOST_CUSHION
        with NewStorages():
            checkpoint.save(engine, tmp_path, 1, {"step": 1}, keep=1, is_main=True)
    finally:
        engine.close()
    assert sum(made.values()) < 64 * 2**10, made


def _fake_free_disk(monkeypatch, free: int) -> None:
    """FAKED: the free-disk reading (a test cannot fill a disk)."""
    from fitone import rundir

    monkeypatch.setattr(rundir, "free_disk_bytes", lambda _path: free)


def _tiny_checkpoint_bytes() -> int:
    from fitone.models import build_model, load_config

    n_params = sum(p.numel() for p in build_model(load_config("t5-tiny", from_scratch=True)).parameters())
    return checkpoint.checkpoint_bytes(n_params, "fp32")


def test_save_every_whose_checkpoints_cannot_fit_the_free_disk_is_refused_before_training(tmp_path, monkeypatch):
    """keep K checkpoints: the disk holds K + 1 while the newest is written. One byte short of that is one line,
    exit 2, before anything is built or written; exactly that trains."""
    size = _tiny_checkpoint_bytes()
    out = tmp_path / "run"
    _fake_free_disk(monkeypatch, 3 * size - 1)
    rc, _, err = run_main(["train", *CLI_RUN, "--max-steps", "3", "--save-every", "1", "--keep-checkpoints", "2",
                           "--out", str(out)])
    assert rc == 2
    assert err.strip().splitlines() == [
        f"fitone: error: --save-every 1: one checkpoint of this model is {size / 2**30:.2f} GiB, and with "
        f"--keep-checkpoints 2 the disk holds 3 at once (the newest is written before the oldest goes): "
        f"{3 * size / 2**30:.2f} GiB, but {out} has {(3 * size - 1) / 2**30:.2f} GiB free; free disk space, lower "
        "--keep-checkpoints, or give an --out on a larger disk (--no-preflight skips this check)"]
    assert not out.exists()
    _fake_free_disk(monkeypatch, 3 * size)
    rc, _, err = run_main(["train", *CLI_RUN, "--max-steps", "3", "--save-every", "1", "--keep-checkpoints", "2",
                           "--out", str(out)])
    assert rc == 0, err
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step-00000002", "step-00000003"]


def test_a_resumed_runs_own_checkpoints_count_toward_the_room_it_needs(tmp_path, monkeypatch):
    """Resuming with the K checkpoints already written, the disk needs only what K + 1 take beyond those."""
    size = _tiny_checkpoint_bytes()
    out = tmp_path / "run"
    fitone.train(cpu_config(batch_size=4, max_steps=2, save_every=1, keep_checkpoints=2, out=str(out)))
    held = sum(f.stat().st_size for c in checkpoint.complete_checkpoints(out) for f in c.rglob("*") if f.is_file())
    assert held < 2 * size
    _fake_free_disk(monkeypatch, 3 * size - held - 1)
    with pytest.raises(RunDirError, match=r"the disk holds 3 at once .* of it already there"):
        fitone.train(cpu_config(batch_size=4, max_steps=3, save_every=1, keep_checkpoints=2, out=str(out),
                                resume=True))
    _fake_free_disk(monkeypatch, 3 * size - held)
    fitone.train(cpu_config(batch_size=4, max_steps=3, save_every=1, keep_checkpoints=2, out=str(out), resume=True))
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step-00000002", "step-00000003"]


def test_a_run_that_writes_fewer_checkpoints_than_it_keeps_needs_room_for_those(tmp_path, monkeypatch):
    """--max-steps 3 --save-every 2 writes two (step 2's and the end's), whatever --keep-checkpoints allows: the
    room for two is enough (a 7B benchmark of 21 steps saving at 20 needed two 94 GB checkpoints on a 128 GiB
    disk and failed at the second: bench/results/2026-11-30-issue19/). --max-steps 2 --save-every 2 writes one:
    the end's save is step 2's (a t5-3b run saving once was refused for want of room for two:
    bench/results/2026-12-02b-gpu/)."""
    size = _tiny_checkpoint_bytes()
    for steps, written in ((3, 2), (2, 1)):
        _fake_free_disk(monkeypatch, written * size - 1)
        with pytest.raises(RunDirError, match=rf"the disk holds {written} at once"):
            fitone.train(cpu_config(batch_size=4, max_steps=steps, save_every=2, keep_checkpoints=5,
                                    out=str(tmp_path / f"short-{steps}")))
        _fake_free_disk(monkeypatch, written * size)
        out = tmp_path / f"run-{steps}"
        result = fitone.train(cpu_config(batch_size=4, max_steps=steps, save_every=2, keep_checkpoints=5,
                                         out=str(out)))
        assert result.steps == steps
        assert len(checkpoint.complete_checkpoints(out)) == written


def test_the_plan_says_how_big_one_checkpoint_is():
    """The same arithmetic as the disk check: llama-7b in bf16 is 94 GB (87.9 GiB) a checkpoint, as measured
    (bench/results/2026-11-30-issue19/)."""
    p = fitone.plan(model="llama-7b", from_scratch=True, precision="bf16", seq_len=512, gpu_mem="24GiB",
                    host_mem="128GiB")
    assert p.checkpoint_bytes == checkpoint.checkpoint_bytes(p.n_params, "bf16")
    assert round(p.checkpoint_bytes / 1e9) == 94
    assert p.to_dict()["checkpoint_gib"] == pytest.approx(p.checkpoint_bytes / 2**30, abs=1e-3)
    assert f"one checkpoint (--save-every): {p.checkpoint_bytes / 2**30:.2f} GiB of disk" in str(p)
