"""The pipelined update's ZeRO-2 partitions over several ranks (issue 30): each rank's own part of the step.

DeepSpeed 0.19.8 cuts each group's flat 16-bit weights into one equal, padded partition per rank
(`parallel_partitioned_bit16_groups[i][r]`); a rank runs Adam on its own (`single_partition_of_fp32_groups[i]`),
copies it into its 16-bit partition, then all-gathers every partition before the next forward
(`all_gather_dp_groups`). The pipelined update cuts every partition into the same chunks (same sizes on every
rank) and gathers chunk c of all partitions as soon as each rank's Adam and upload of its chunk c are done,
with `dist.all_gather` on the optimizer's data-parallel group, the call DeepSpeed's own gather makes without
all_gather_into_tensor: the same bits in the flat buffer, chunk by chunk. A forward waits for the chunks holding
its weights in every partition (`fitone.zero2.layout.module_needs` with `sizes`).

Order of collectives: the update thread issues its gathers in the same order on every rank (group, then chunk),
and the main thread issues none on that group until `before_backward` has waited for every chunk; the norm and
overflow votes of the next step come after that backward. The training loop's own votes (fitone.runtime) use
the default group, another communicator. On a GPU a gather is issued on the update's side stream, after the
upload, and the chunk's event is recorded after it, so a forward's wait orders it after the gather.
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

    @property
    def several(self) -> bool:
        return max(self.world) > 1

    def own(self, i: int) -> torch.Tensor:
        """This rank's partition of group i's flat 16-bit weights (the update's upload writes it)."""
        return self.opt.parallel_partitioned_bit16_groups[i][self.rank[i]]

    def gather(self, i: int, lo: int, hi: int) -> None:
        """Elements [lo, hi) of every rank's partition of group i into this rank's flat buffer, from each
        rank's own (a no-op on one rank). Called on every rank for the same chunks in the same order."""
        if self.world[i] == 1:
            return
        import torch.distributed as dist

        shards = [p.narrow(0, lo, hi - lo).detach() for p in self.opt.parallel_partitioned_bit16_groups[i]]
        dist.all_gather(shards, shards[self.rank[i]], group=self.groups[i])
