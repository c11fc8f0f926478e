"""The pipelined update's uploads: each stepped chunk of the master goes up into the model's 16-bit weights.

By default the master goes up as it is, into one of two landing chunks on the GPU, and is cast there. With
HOST_CAST, an fp32 master and 16-bit weights (fp16 or bf16 training, fp32 optimizer states), fitone's fp32 Adam
writes the new master's 16-bit cast as it goes (fitone.zero2.adam32's `out`: the same round-to-nearest bits) into
one of two page-locked host chunks, and that goes up: 2 B a weight over the link instead of 4, and no landing
chunks on the GPU; on the CPU the cast goes straight into the weights. It is off because on an H100 the CPU's Adam
slowed more than the link gained (bench/NOTES.md, 2026-12-08).
"""

from __future__ import annotations

from typing import Any

import torch

HOST_CAST = False  # tests and the bench's A/B set it (read when an Uploads is built)


def casts_on_host(master_bytes: int, weight_bytes: int) -> bool:
    """Whether the update casts on the host, from the master's and the weights' bytes per element."""
    return HOST_CAST and master_bytes == 4 and weight_bytes == 2


def buffer_bytes(chunk_elements: int, master_bytes: int, weight_bytes: int) -> tuple[int, int]:
    """(GPU bytes, host bytes) of the two chunks the uploads go through (fitone.plan counts them)."""
    if casts_on_host(master_bytes, weight_bytes):
        return 0, 2 * weight_bytes * chunk_elements
    return 2 * master_bytes * chunk_elements, 0


class Uploads:
    """Two chunks, used in turn, for uploads queued on `stream` (the update's side stream) of at most
    `chunk_elements` each, from `optimizer`'s master partitions into its flat weights. Without a stream (weights on
    the CPU) no chunks: the cast goes straight into the weights."""

    def __init__(self, optimizer: Any, stream: torch.cuda.Stream | None, chunk_elements: int):
        master = optimizer.single_partition_of_fp32_groups[0]
        weights = optimizer.bit16_groups_flat[0]
        self.stream = stream
        self.on_host = casts_on_host(master.element_size(), weights.element_size())
        self._chunks: list[torch.Tensor] = []
        if stream is not None and self.on_host:
            self._chunks = [torch.empty(chunk_elements, dtype=weights.dtype, pin_memory=True) for _ in range(2)]
        elif stream is not None:
            self._chunks = [torch.empty(chunk_elements, dtype=master.dtype, device=weights.device) for _ in range(2)]
        self._sent: list[torch.cuda.Event | None] = [None, None]  # per chunk: its last upload, once queued
        self._k = 0  # uploads queued

    def out(self, target: torch.Tensor) -> torch.Tensor | None:
        """Where the next chunk's Adam may write the 16-bit cast of its master for `target` (the weights' slice it
        goes to; None: the master goes up as it is). On the GPU a host chunk whose last upload has read it (this
        blocks until then; it was queued two chunks ago); on the CPU `target` itself."""
        if not self.on_host or self.stream is None:
            return target if self.on_host else None
        return self._free(target.numel())

    def _free(self, n: int) -> torch.Tensor:
        """The next host chunk's first n elements, once its last upload has read it."""
        sent = self._sent[self._k % 2]
        if sent is not None:
            sent.synchronize()
        return self._chunks[self._k % 2][:n]

    def send(self, master: torch.Tensor, target: torch.Tensor, cast: bool) -> torch.cuda.Event | None:
        """Queue `master` (the page-locked slice Adam just stepped) into `target` (the weights' slice); `cast`: `out`
        already holds its 16-bit cast, else it is made here. Returns the upload's CUDA event (None on the CPU)."""
        if self.stream is None:
            if not cast:
                target.copy_(master)
            return None
        n = master.numel()
        chunk = self._chunks[self._k % 2][:n]
        if self.on_host and not cast:  # a chunk stepped by a kernel that writes no cast (DeepSpeed's, an undo)
            self._free(n).copy_(master)
        with torch.cuda.stream(self.stream):  # the side stream runs in order: a GPU chunk is free two uploads on
            if self.on_host:
                target.copy_(chunk, non_blocking=True)
            else:
                chunk.copy_(master, non_blocking=True)
                target.copy_(chunk)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._sent[self._k % 2] = event
        self._k += 1
        return event

    def synchronize(self) -> None:
        """Block until every queued upload has read its chunk and the master (the next update may write both)."""
        if self.stream is not None:
            self.stream.synchronize()
