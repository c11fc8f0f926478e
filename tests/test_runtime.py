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
