"""The pipelined update's ZeRO-2 partitions over several ranks (issue 30): each rank's own part of the step.

DeepSpeed 0.19.8 cuts each group's flat 16-bit weights into one equal, padded partition per rank
(`parallel_partitioned_bit16_groups[i][r]`); a rank runs Adam on its own (`single_partition_of_fp32_groups[i]`),
copies it into its 16-bit partition, then all-gathers every partition before the next forward
(`all_gather_dp_groups`). The pipelined update cuts every partition into the same chunks (the same sizes on
every rank): the update thread runs Adam on and uploads this rank's chunks, and chunk c of all partitions is
all-gathered once the forward needs it (`dist.all_gather` on the optimizer's data-parallel group, the call
DeepSpeed's own gather makes without all_gather_into_tensor): the same bits in the flat buffer, chunk by chunk.
A forward waits for the chunks holding its weights in any partition (`fitone.zero2.layout.module_needs`).

The gathers are issued by the main thread, in one order on every rank (group by group, chunk by chunk, each
with all those before it), from the forward's waits, `before_backward` and `sync`: so every collective of a run
comes from one thread in program order, the same on every rank, whatever the forward reads first. A gather
from the update thread would race the training loop's own collectives (its loss mean, its stop votes), which
run on the default group while the update runs; gloo would take that, NCCL may deadlock on it. On a GPU a gather
runs on a stream of its own, after the chunk's upload event, and the forward's stream waits for it; the main
thread only queues it. On the CPU it runs where it is issued (nothing to overlap there).
"""

from __future__ import annotations

from typing import Any

import torch


class Partitions:
    """This rank's partition of each group of a ZeRO-2 optimizer, and the gathers of their chunks."""

    def __init__(self, optimizer: Any):
        import torch.distributed as dist

        self.opt = optimizer
        self.groups = list(optimizer.real_dp_process_group)
        self.rank = [dist.get_rank(group=g) for g in self.groups]
        self.world = [dist.get_world_size(group=g) for g in self.groups]
        sizes = [[p.numel() for p in parts] for parts in optimizer.parallel_partitioned_bit16_groups]
        if any(len(set(s)) != 1 for s in sizes):  # DeepSpeed pads the flat buffers so that they are
            raise ValueError(f"the pipelined update gathers equal partitions, got sizes {sizes}")
        # per group: the elements of each rank's partition (None on one rank: offsets are the flat buffer's)
        self.sizes: list[int] | None = [s[0] for s in sizes] if self.several else None
        on_gpu = self.several and optimizer.bit16_groups_flat[0].is_cuda
        self._stream = torch.cuda.Stream() if on_gpu else None  # the gathers' own
        self._next = (0, 0)  # the next (group, chunk) to gather this step

    @property
    def several(self) -> bool:
        return max(self.world) > 1

    def own(self, i: int) -> torch.Tensor:
        """This rank's partition of group i's flat 16-bit weights (the update's upload writes it)."""
        return self.opt.parallel_partitioned_bit16_groups[i][self.rank[i]]

    def restart(self) -> None:
        """A new update: its first chunk is the next to gather."""
        self._next = (0, 0)

    def arrived(self, update: Any, i: int, c: int) -> None:
        """Chunk c of group i is uploaded on this rank (`update` a PipelinedUpdate, its `ready` event set): order
        the current GPU stream after it and, on several ranks, gather it and every chunk before it in the one
        order, each once this rank's upload of it is done."""
        if not self.several:
            if update.uploaded[i][c] is not None:
                torch.cuda.current_stream().wait_event(update.uploaded[i][c])
            return
        while self._next <= (i, c):
            g, k = self._next
            update.ready[g][k].wait()  # before (i, c) in the thread's order: normally set already
            ends = update.chunks[g]
            if self._stream is None:
                self.gather(g, ends[k - 1] if k else 0, ends[k])
            else:
                self._stream.wait_event(update.uploaded[g][k])
                with torch.cuda.stream(self._stream):
                    self.gather(g, ends[k - 1] if k else 0, ends[k])
            self._next = (g, k + 1) if k + 1 < len(ends) else (g + 1, 0)
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)

    def gather(self, i: int, lo: int, hi: int) -> None:
        """Elements [lo, hi) of every rank's partition of group i into this rank's flat buffer, from each
        rank's own; every rank calls it for the same chunks in the same order."""
        import torch.distributed as dist

        shards = [p.narrow(0, lo, hi - lo).detach() for p in self.opt.parallel_partitioned_bit16_groups[i]]
        dist.all_gather(shards, shards[self.rank[i]], group=self.groups[i])
