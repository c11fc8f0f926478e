"""Several machines: `fitone plan --gpus N --nodes M` plans each node's host RAM (its N ranks' shares of a ZeRO-2
partition over N x M ranks), and the pre-flight of a launched run counts the ranks on its own node.

The launchers' environment is FAKED (the variables torchrun and DeepSpeed's launcher set for each rank): no
process group starts, the pre-flight runs from the config alone, as it does before any engine. The host-RAM
reading is faked too (this machine has what it has).
"""

from __future__ import annotations

import json

import pytest

from conftest import run_main
from fitone import memory
from fitone.config import TrainConfig
from fitone.errors import MemoryBudgetError
from fitone.plan import DOES_NOT_FIT, plan, preflight
from fitone.run import resolve
from fitone.units import GIB

T5_3B = dict(model="t5-3b", from_scratch=True, src_len=128, tgt_len=128, precision="fp16", gpu_mem="24GiB")


def per_rank(p) -> int:
    return sum(c.bytes for c in p.host)


def test_two_nodes_of_two_plan_each_nodes_host_and_partition_over_all_four():
    four = plan(**T5_3B, host_mem="256GiB", gpus=4)
    nodes = plan(**T5_3B, host_mem="256GiB", gpus=2, nodes=2)
    one_node_of_two = plan(**T5_3B, host_mem="256GiB", gpus=2)
    # ZeRO-2 partitions over all four ranks: a rank's host and GPU are those of four GPUs on one node
    assert nodes.host == four.host and nodes.gpu == four.gpu and nodes.gpu_peak == four.gpu_peak
    assert per_rank(nodes) < per_rank(one_node_of_two)  # a quarter of the states, not a half
    # and a node holds its own two ranks' shares, not all four
    assert (nodes.gpus, nodes.nodes, nodes.world_size) == (2, 2, 4)
    assert nodes.host_total == 2 * per_rank(nodes) == four.host_total // 2


def test_deepspeeds_own_estimate_beside_the_plan_is_asked_for_the_same_nodes():
    # without offload DeepSpeed counts a node's host as its GPUs' fp32 copies: 2 x 2 and 4 x 1 tell apart
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    small = dict(model="t5-small", from_scratch=True, gpu_mem="24GiB", host_mem="64GiB", offload="none")
    p = plan(**small, gpus=2, nodes=2)
    host, gpu = estimate_zero2_model_states_mem_needs(p.n_params, 2, 2, cpu_offload=False)
    assert p.deepspeed_estimate == {"gpu": gpu, "host": host} != plan(**small, gpus=4).deepspeed_estimate


def test_the_verdict_judges_one_nodes_host_against_host_mem():
    # a host between what two ranks and what four ranks of the same run hold: one node of four does not fit,
    # two nodes of two do, each on such a host
    two_ranks = plan(**T5_3B, host_mem="256GiB", gpus=2, nodes=2).host_export
    host = f"{(two_ranks + GIB) / GIB:.0f}GiB"
    one_node = plan(**T5_3B, host_mem=host, gpus=4)
    assert one_node.verdict == DOES_NOT_FIT and one_node.short["host"] > 0
    fits = plan(**T5_3B, host_mem=host, gpus=2, nodes=2)
    assert fits.verdict != DOES_NOT_FIT and "host" not in fits.short


def test_cli_prints_and_jsons_the_nodes_and_a_nodes_host(capsys):
    argv = ["plan", "--model", "t5-small", "--from-scratch", "--gpu-mem", "24GiB", "--host-mem", "64GiB",
            "--gpus", "2", "--nodes", "3"]
    rc, out, _err = run_main([*argv, "--json"])
    assert rc == 0
    got = json.loads(out)
    assert (got["gpus"], got["nodes"], got["world_size"]) == (2, 3, 6)
    assert got["host_gib"] == pytest.approx(2 * got["host_per_rank_gib"], abs=0.002)
    rc, out, _err = run_main(argv)
    assert rc == 0
    assert out.splitlines()[0].endswith("2 GPUs on each of 3 nodes")
    assert "host, per rank (x2 ranks of one node in the total)" in out
    rc, out, _err = run_main([*argv[:-4], "--nodes", "3"])
    assert rc == 0 and "\nhost, one node's " in out
    rc, out, _err = run_main(argv[:-4])  # one node: as before
    assert rc == 0 and "nodes" not in out.splitlines()[0] and "one node" not in out
    rc, out, _err = run_main(argv[:-4] + ["--json"])
    assert rc == 0 and (json.loads(out)["nodes"], json.loads(out)["world_size"]) == (1, 1)


@pytest.mark.parametrize("nodes", ["0", "-1"])
def test_nodes_below_one_is_one_line_and_exit_2(nodes):
    rc, _out, err = run_main(["plan", "--model", "t5-small", "--from-scratch", "--gpu-mem", "24GiB", "--nodes", nodes])
    assert rc == 2 and err.strip().count("\n") == 0 and "--nodes must be a positive whole number" in err


# -- the pre-flight of a launched run ----------------------------------------------------------------
# what each launcher sets for a rank of a two-rank run: (the variables, ranks on this node)
LAUNCHED = {
    "torchrun --nnodes 2 --nproc-per-node 1": ({"LOCAL_WORLD_SIZE": "1"}, 1),
    "deepspeed, a hostfile of 2 hosts x 1 slot": ({"LOCAL_SIZE": "1", "CROSS_SIZE": "2"}, 1),
    "torchrun --nproc-per-node 2": ({"LOCAL_WORLD_SIZE": "2"}, 2),
    "deepspeed --num_gpus 2": ({"LOCAL_SIZE": "2", "CROSS_SIZE": "1"}, 2),
    "a launcher that names no local size": ({}, 2),  # every rank counted here: never under-counted
}


@pytest.mark.parametrize("launcher", LAUNCHED)
def test_the_preflight_counts_the_host_ram_of_the_ranks_on_its_own_node(monkeypatch, launcher):
    """t5-3b trained on the CPU by two ranks: each rank's host holds its half of the offloaded states (~26 GiB)
    and, on a CPU, its whole model (~11 GiB). 50 GiB holds one such rank, not two, nor one process alone."""
    values, here = LAUNCHED[launcher]
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500", **values}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 50 * GIB)
    monkeypatch.setattr(memory, "host_rss_bytes", lambda: 0)
    cfg = TrainConfig(model="t5-3b", from_scratch=True, data="synthetic", precision="fp32", device="cpu",
                      src_len=128, tgt_len=128, batch_size=1)
    run = resolve(cfg).with_given_batch()
    assert (run.world_size, run.dist.ranks_on_node) == (2, here)
    if here == 1:
        p = preflight(run)
        assert p.gpus == 1 and p.world_size == 2 and p.host_total == per_rank(p)
    else:
        with pytest.raises(MemoryBudgetError, match=r"host RAM too small.*per rank x 2 ranks on this node"):
            preflight(run)
    # one process alone holds all of the states: more than either rank of two
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(MemoryBudgetError, match="host RAM too small"):
        preflight(resolve(cfg).with_given_batch())
