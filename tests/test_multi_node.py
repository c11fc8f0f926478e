"""Two "nodes" on this machine: two torchrun launcher groups over loopback (gloo), one CPU rank each.

The multi-node path as docs/multi-gpu.md's "Several machines" runs it: `torchrun --nnodes 2 --node-rank K` on
each machine, with the same master address and port, each running the same `fitone train`. Here both groups are
on 127.0.0.1 and share this disk, as real nodes share the run directory's filesystem. Each group's rank is its
node's only one (LOCAL_RANK 0, LOCAL_WORLD_SIZE 1), the layout a one-node run never has.
"""

from __future__ import annotations

import base64
import json
import shlex
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM

from conftest import CLI_RUN, REPO, child_env, run_child

PAGE = (REPO / "docs" / "multi-gpu.md").read_text().split("## Several machines")[1]


def _free_port() -> int:
    with socket.socket() as sock:  # a free port, so runs in parallel do not collide
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _on_both_nodes(command) -> list[subprocess.CompletedProcess]:
    """command(node_rank) run as node 0 and node 1 at once: each waits for the other at the rendezvous."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda rank: run_child(command(rank), timeout=300, env=child_env()), (0, 1)))


def _two_nodes(out: Path, *extra: str) -> list[subprocess.CompletedProcess]:
    """`fitone train` on two one-rank nodes (node ranks 0 and 1) that meet at 127.0.0.1, each its own torchrun."""
    port = _free_port()
    return _on_both_nodes(lambda rank: [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
        "-m", "fitone", "train", *CLI_RUN, "--out", str(out), *extra])


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_over_loopback_train_checkpoint_and_resume(tmp_path, deepspeed_ops_built):
    out = tmp_path / "run"
    first = _two_nodes(out, "--max-steps", "4", "--save-every", "4")
    for proc in first:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [p.stdout.count("TrainResult(4 steps") for p in first] == [1, 0]  # global rank 0 reports, on node 0
    ckpt = out / "checkpoints" / "step-00000004"
    # every rank's optimizer partition, one per node, in the one checkpoint
    assert sorted(p.name for p in ckpt.glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]

    # the ranks agree: the fp32 weights rebuilt from both nodes' partitions are the weights rank 0 exported
    # (fp32 training: bit for bit), so rank 1's half of the update reached rank 0's model
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    rebuilt = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag=ckpt.name)
    exported = AutoModelForSeq2SeqLM.from_pretrained(out / "final").state_dict()
    assert rebuilt and all(torch.equal(exported[name], value) for name, value in rebuilt.items())

    second = _two_nodes(out, "--max-steps", "8", "--save-every", "4", "--resume")
    for proc in second:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert second[0].stdout.count("TrainResult(8 steps (resumed at 4)") == 1 and "TrainResult(" not in second[1].stdout
    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, 9))  # the resume continued at the saved step 5
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] * 0.8 and losses[-1] < losses[3], losses
    assert (out / "checkpoints" / "step-00000008").is_dir()


def test_the_docs_two_node_commands_are_what_the_launchers_read():
    """docs/multi-gpu.md's hostfile and `deepspeed --hostfile` line as DeepSpeed's runner parses them, and its two
    torchrun lines as torchrun does: two nodes of 4, node ranks 0 and 1, one master, the same fitone command."""
    from deepspeed.launcher.runner import _parse_hostfile, parse_args
    from torch.distributed.run import get_args_parser

    assert dict(_parse_hostfile([x for x in PAGE.splitlines() if "slots=" in x])) == {"node1": 4, "node2": 4}
    line = next(x for x in PAGE.splitlines() if x.startswith("deepspeed "))
    ds = parse_args(shlex.split(line)[1:])
    assert ds.hostfile == "hostfile" and ds.module and ds.user_script == "fitone" and ds.user_args[0] == "train"
    runs = [get_args_parser().parse_args(shlex.split(x)[1:]) for x in PAGE.splitlines() if x.startswith("torchrun ")]
    assert [(r.nnodes, r.nproc_per_node, r.node_rank, r.master_addr) for r in runs] == [
        ("2", "4", 0, "node1"), ("2", "4", 1, "node1")]
    assert all(r.module and r.training_script == "fitone" and r.training_script_args == ds.user_args for r in runs)


def test_deepspeeds_per_node_launcher_on_two_nodes_trains(tmp_path, deepspeed_ops_built):
    """What `deepspeed --hostfile` runs on each host over pdsh (deepspeed.launcher.launch with the hostfile's
    world and the host's --node_rank), here on two "hosts" of one CPU rank each over loopback: it sets
    LOCAL_SIZE 1 and WORLD_SIZE 2 for each rank, not torchrun's variables."""
    world = base64.urlsafe_b64encode(json.dumps({"node1": [0], "node2": [0]}).encode()).decode()
    port, out = _free_port(), tmp_path / "run"
    procs = _on_both_nodes(lambda rank: [
        sys.executable, "-m", "deepspeed.launcher.launch", f"--world_info={world}", f"--node_rank={rank}",
        "--master_addr=127.0.0.1", f"--master_port={port}", "--module", "fitone", "train", *CLI_RUN,
        "--max-steps", "2", "--out", str(out)])
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [p.stdout.count("TrainResult(2 steps") for p in procs] == [1, 0]
    assert len(_records(out)) == 2 and (out / "final" / "config.json").is_file()
