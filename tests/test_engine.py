"""Engine helpers that need no engine: the in-process distributed env and the JIT-build check."""

import pytest

from fitone.config import TrainConfig
from fitone.engine import cpu_adam_built, ensure_dist_env, resolve_device
from fitone.errors import DeviceError


def test_cpu_adam_built_looks_in_the_extensions_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not cpu_adam_built()
    (tmp_path / "py311_cpu" / "cpu_adam").mkdir(parents=True)
    (tmp_path / "py311_cpu" / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert cpu_adam_built()


def test_launcher_env_is_kept_and_a_single_process_gets_one(monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    info = ensure_dist_env()
    assert (info.rank, info.local_rank, info.world_size) == (0, 0, 1) and info.is_main
    import os

    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    info = ensure_dist_env()
    assert (info.rank, info.local_rank, info.world_size) == (3, 1, 4) and not info.is_main


def test_fp16_and_gpu_cap_are_refused_on_the_cpu():
    with pytest.raises(DeviceError, match="bf16 or fp32"):
        resolve_device(TrainConfig(device="cpu", precision="fp16"))
    with pytest.raises(DeviceError, match="--max-gpu-memory"):
        resolve_device(TrainConfig(device="cpu", precision="fp32", max_gpu_memory="8GiB"))
