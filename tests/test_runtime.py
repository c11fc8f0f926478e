"""fitone.runtime: a single process's distributed setup."""

import subprocess
import sys

from conftest import child_env

# The port fitone picked for a single process is taken by someone else before the store binds it: the
# setup picks another. The port is taken by a listening socket here, which is what the race looks like.
_TAKEN = """
import os, socket
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen()
taken = listener.getsockname()[1]
from fitone import runtime
runtime._free_port = lambda ports=iter([taken]), real=runtime._free_port: next(ports, None) or real()
runtime.init_distributed("cpu")
import torch.distributed as dist
assert dist.is_initialized() and dist.get_world_size() == 1
assert int(os.environ["MASTER_PORT"]) != taken
print("OK", taken, os.environ["MASTER_PORT"])
"""


def test_a_taken_port_is_replaced_when_fitone_chose_it():
    run = subprocess.run([sys.executable, "-c", _TAKEN], capture_output=True, text=True, env=child_env(), timeout=120)
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-2000:]


def test_a_launchers_port_is_never_replaced():
    env = {**child_env(), "MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    code = _TAKEN.replace("runtime.init_distributed",
                          "os.environ['MASTER_PORT'] = str(taken); runtime.init_distributed")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode != 0 and "EADDRINUSE" in run.stderr


# A user's own MASTER_PORT, no launcher: used as given (the store listens on it), or, where another process has
# it, one line naming the fix; never moved to another port. In one process: fitone picked a port for an earlier
# run (a notebook's first cell), then the user set one, taken.
_USERS_PORT = """
import os, socket, sys
from fitone import runtime
from fitone.errors import DeviceError
if sys.argv[1] == "taken-after-fitone-chose":
    runtime.ensure_dist_env()  # an earlier run's choice
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        del os.environ[name]
    listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen()
    os.environ["MASTER_PORT"] = str(listener.getsockname()[1])
given = os.environ["MASTER_PORT"]
try:
    runtime.init_distributed("cpu")
except DeviceError as exc:
    print("REFUSED", os.environ["MASTER_PORT"] == given, exc)
    raise SystemExit
probe = socket.socket()
try:
    probe.bind(("127.0.0.1", int(given)))
    print("NOT-LISTENING")
except OSError:
    print("USED", os.environ["MASTER_PORT"] == given)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_users_master_port_without_a_launcher_is_the_one_the_store_listens_on():
    port = _free_port()
    run = subprocess.run([sys.executable, "-c", _USERS_PORT, "free"], capture_output=True, text=True, timeout=120,
                         env={**child_env(), "MASTER_PORT": str(port)})
    assert run.stdout.strip().splitlines()[-1:] == ["USED True"], run.stdout[-2000:] + run.stderr[-2000:]


def test_a_users_master_port_that_is_taken_is_one_line_and_never_moved():
    run = subprocess.run([sys.executable, "-c", _USERS_PORT, "taken-after-fitone-chose"], capture_output=True,
                         text=True, timeout=120, env=child_env())
    lines = run.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("REFUSED True MASTER_PORT "), run.stderr[-2000:]
    assert lines[-1].endswith(" is in use by another process (EADDRINUSE): unset MASTER_PORT to let fitone pick "
                              "a free port, or set it to a free one")


def test_a_taken_master_port_from_the_user_is_one_line_from_the_cli():
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        from conftest import CLI_RUN

        run = subprocess.run([sys.executable, "-m", "fitone", "train", *CLI_RUN, "--max-steps", "1"],
                             capture_output=True, text=True, timeout=300, env={**child_env(), "MASTER_PORT": str(port)})
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == (f"fitone: error: MASTER_PORT {port} is in use by another process "
                                                   "(EADDRINUSE): unset MASTER_PORT to let fitone pick a free port, "
                                                   "or set it to a free one")
    assert "Traceback" not in run.stderr


# Runs in its own process, so that no group of an earlier test in this one is alive when it starts.
_RUNS = """
import os, socket
import torch.distributed as dist
import fitone

run = dict(model="t5-tiny", from_scratch=True, device="cpu", precision="fp32", src_len=8, tgt_len=8, batch_size=4,
           max_steps=1, eval_examples=0, progress=False)
for _ in range(2):  # a notebook's second run starts a group of its own
    assert fitone.train(**run).steps == 1
    assert not dist.is_initialized(), "fitone.train left its process group alive"
fitone.probe_batch(max_batch=1, verify_steps=0, say=lambda text: None, **run)
assert not dist.is_initialized(), "a standalone probe left its process group alive"
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
assert fitone.train(**run).steps == 1
assert dist.is_initialized(), "fitone destroyed a process group its caller made"
print("OK")
"""


def test_a_run_destroys_the_process_group_it_made_and_keeps_its_caller_s(tmp_path):
    env = {**child_env(), "FITONE_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", _RUNS], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=900)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stderr[-3000:]
