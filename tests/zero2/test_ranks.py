"""The pipelined update on several ranks (issue 30): 2 and 4 gloo CPU ranks under torchrun, real DeepSpeed engines.

Each rank runs Adam on its own ZeRO-2 partition of every parameter group chunk by chunk, and each chunk is
all-gathered as the forward first needs it (fitone.zero2.ranks). N ranks at micro-batch 8 with accumulation A see,
step by step, the N x A micro-batches one process accumulates at micro-batch 8 (fitone.data.batches slices each
step's examples by rank), so the curves are the same arithmetic summed in another order
(tests/test_distributed.py); and the N-rank run with DeepSpeed's own step is the pipelined one but for the Adam
implementation (tests/zero2/test_overlap.py's bounds, at its learning rate).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

import fitone
from conftest import CLI_RUN, child_env, cpu_config, run_child, tiny_engine
from tolerance import LINEAR_STEPS, apart, fp32_loss_drift

LR = 1e-3  # constant, no warm-up: the settings of the pipelined update's one-rank bounds (tests/zero2/test_overlap.py)
STEPS = LINEAR_STEPS  # whole-run fp32 bounds hold over these steps (tolerance.py)
EVAL = 16  # held-out examples scored with the final weights
TRAIN = [*CLI_RUN, "--batch-size", "8", "--lr", str(LR), "--lr-schedule", "constant", "--warmup-steps", "0",
         "--eval-examples", str(EVAL)]
CHUNK = 4096  # the lean layout's chunk in the children: each rank's partitions in over a hundred chunks and gathers
GROUP = 2**18  # elements per parameter group in the children: the tiny T5's 968k in four groups, each partitioned
# `fitone train` as `python -m fitone train` runs it, with the lean layout's chunk and the groups cut first
CHILD = f"""import sys
from fitone.zero2 import layout
layout.CHUNK_ELEMENTS, layout.GROUP_ELEMENTS = {CHUNK}, {GROUP}
from fitone.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _torchrun(ranks: int, out: Path, *extra: str) -> tuple[list[float], float]:
    """`fitone train` on `ranks` CPU ranks under torchrun, in chunks of CHUNK; the run's per-step losses and
    its final weights' held-out loss."""
    child = out.parent / "fitone_child.py"
    child.write_text(CHILD)
    with socket.socket() as sock:  # a free port, so runs in parallel do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(port),
           str(child), "train", *TRAIN, "--out", str(out), *extra]
    proc = run_child(cmd, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r], [r["eval_loss"] for r in records if "eval_loss" in r][-1]


@pytest.mark.numeric
@pytest.mark.parametrize("ranks, accumulation", [(2, 2), (4, 1)])
def test_the_pipelined_update_on_several_ranks_trains_like_one_process_and_like_deepspeeds_step(
        tmp_path, ranks, accumulation):
    common = ["--max-steps", str(STEPS), "--grad-accum", str(accumulation)]
    pipelined, held_out = _torchrun(ranks, tmp_path / "pipelined", *common, "--pipelined-update",
                                    "--save-every", str(STEPS))
    deepspeeds, deepspeeds_held_out = _torchrun(ranks, tmp_path / "deepspeed", *common)  # several ranks' default
    one = fitone.train(cpu_config(batch_size=8, grad_accum=ranks * accumulation, max_steps=STEPS, lr=LR,
                                  lr_schedule="constant", warmup_steps=0, eval_examples=EVAL, pipelined_update=True))
    assert one.update == "pipelined" and one.world_size == 1
    # every rank's partition reached rank 0's model: its export is the fp32 weights rebuilt from the ranks'
    # optimizer partitions, bit for bit (fp32 training), so each chunk's all-gather landed before the export
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = tmp_path / "pipelined" / "checkpoints"
    assert len(list((ckpt / f"step-{STEPS:08d}").glob("zero_pp_rank_*_optim_states.pt"))) == ranks
    rebuilt = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=f"step-{STEPS:08d}")
    exported = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "pipelined" / "final").state_dict()
    assert rebuilt and all(torch.equal(exported[name], value) for name, value in rebuilt.items())
    # one process accumulating the same micro-batches with the same update: fp32 rounding from the first step
    # on (the ranks' gradients are summed by a reduce, the micro-batches' by accumulation, the clip norm's
    # squares per rank in fp32); the final weights compared by their held-out loss, as the one-rank tests do
    assert apart(pipelined, one.losses, fp32_loss_drift, first_differing_step=1) == []
    want = one.quality["eval_loss"]
    assert abs(held_out - want) <= fp32_loss_drift(want, steps=STEPS)
    # DeepSpeed's own step on the same ranks: step 1's update is DeepSpeed's arithmetic on the lean layout, so
    # steps 1 and 2 are equal; from step 3 on a forward sees updates by PyTorch's fused AdamW instead
    assert pipelined[:2] == deepspeeds[:2] and pipelined[2:] != deepspeeds[2:]
    assert apart(pipelined, deepspeeds, fp32_loss_drift, first_differing_step=3) == []
    assert abs(held_out - deepspeeds_held_out) <= fp32_loss_drift(deepspeeds_held_out, steps=STEPS - 1)


def test_a_resumed_pipelined_run_on_two_ranks_continues_as_the_uninterrupted_one(tmp_path):
    common = ["--grad-accum", "2", "--pipelined-update", "--save-every", "4"]
    straight, _ = _torchrun(2, tmp_path / "straight", "--max-steps", str(STEPS), *common)
    out = tmp_path / "run"
    _torchrun(2, out, "--max-steps", "4", *common)
    resumed, _ = _torchrun(2, out, "--max-steps", str(STEPS), "--resume", *common)
    assert len(resumed) == STEPS and resumed[:4] == straight[:4]
    # the same operations on the restored numbers: fp32 rounding at most, from the resumed step on
    assert apart(resumed, straight, fp32_loss_drift, first_differing_step=5) == []


def test_a_module_waits_for_its_weights_furthest_into_any_partition():
    """fitone.zero2.layout.module_needs on partitions: chunk c of every partition arrives at once, so a module
    needs the chunks up to the furthest element of its weights into their partition (counted here by marking
    its elements in the flat buffer folded into its partitions)."""
    from fitone.zero2.layout import module_needs

    engine = tiny_engine()
    try:
        opt, model = engine.optimizer, engine.module
        flat = opt.bit16_groups_flat[0]
        parts = 4
        size = flat.numel() // parts
        assert len(opt.bit16_groups_flat) == 1 and size * parts == flat.numel()
        base, width = flat.data_ptr(), flat.element_size()
        crossing = 0
        for module, needs in module_needs(opt, model, [size]):
            marked = torch.zeros(flat.numel(), dtype=torch.bool)
            for p in module.parameters(recurse=False):
                start = (p.data.data_ptr() - base) // width
                marked[start:start + p.numel()] = True
            folded = marked.view(parts, size).any(dim=0)
            assert needs == [(0, int(folded.nonzero().max()) + 1)]
            crossing += needs[0][1] == size
        assert crossing > 0  # some module's weights cross a partition's end and wait for every chunk
    finally:
        engine.close()
