"""A share of the pipelined update's Adam on the GPU (--gpu-adam-share): the same bits, beside the CPU's.

The pipelined update's CPU Adam is bound by the 16 or so cores streaming the states, not by the link: the copies to
and from the GPU ride beside it (bench/NOTES.md, 2026-12-07c). So while the CPU steps its chunks, every k-th chunk's
fp32 master, moments and 16-bit gradient go up, a CUDA kernel steps them (csrc/adam_gpu.cu: csrc/adam32.cpp's
arithmetic, operation for operation), the new master is cast into the model's 16-bit weights there, and the master
and moments come back down. A clipped step's Adam (no speculation can be kept on it) is then shorter by about that
share. Host memory is unchanged: the moments are page-locked in place, as the master and gradients already are.
"""

from __future__ import annotations

import functools
import math
import struct
from pathlib import Path
from typing import Any

import torch

from fitone import extensions
from fitone.zero2 import adam32, pinning

OP = "fitone_adam_gpu"
_SOURCE = Path(__file__).parent / "csrc" / "adam_gpu.cu"
PIECE_ELEMENTS = 2**23  # a chunk goes up in pieces of this many elements, through SETS buffers of them on the GPU
SETS = 3  # one piece's buffers up, one stepped, one coming down
PIECE_BYTES = 3 * 4 + 2  # fp32 master and moments, a 16-bit gradient
DECAYS = {"none": 0, "adamw": 1, "adam": 2}  # csrc/adam_gpu.cu's Decay


def gpu_bytes() -> int:
    """What the share holds on the GPU: SETS pieces' buffers (fitone.plan counts it)."""
    return SETS * PIECE_ELEMENTS * PIECE_BYTES


def chosen(ordinal: int, share: float) -> bool:
    """Whether the step's chunk number `ordinal` (0-based, in the update's order) is one of the GPU's: `share` of
    them, evenly spread, so the forward's next chunk is rarely both the GPU's and behind."""
    return math.floor((ordinal + 1) * share) > math.floor(ordinal * share)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def constants(*, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
              grad_scale: float | None) -> list[float]:
    """csrc/adam32.cpp's fp32 constants (its `Hyper`) from PyTorch's double arguments, by its expressions: scale,
    decay, wd, coeff, beta2, c2, bc2_sqrt, eps, neg_step_size, small."""
    beta1, beta2 = betas
    s = _f32(float(step))  # PyTorch reads its step tensor as a float
    bias_correction1 = 1 - beta1 ** s
    bias_correction2 = 1 - beta2 ** s
    w = _f32(1 - beta1)
    small = abs(w) < 0.5
    return [_f32(1.0 if grad_scale is None else grad_scale), _f32(1 - lr * weight_decay), _f32(weight_decay),
            w if small else _f32(w - 1.0), _f32(beta2), _f32(1 - beta2), _f32(math.sqrt(bias_correction2)),
            _f32(eps), -_f32(lr / bias_correction1), 1.0 if small else 0.0]


@functools.cache
def _op() -> Any:
    major, minor = torch.cuda.get_device_capability()
    return extensions.load_cuda(OP, _SOURCE, build_name=f"{OP}_sm{major}{minor}")


def adamw(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *, step: int,
          lr: float, betas: tuple[float, float], eps: float, weight_decay: float, grad_scale: float | None = None,
          adam_w_mode: bool = True) -> None:
    """fitone.zero2.adam32.adamw's bits on CUDA tensors (a 16-bit gradient, every element in the op's vector loop:
    a chunk of a multiple of its lanes), on the current stream."""
    _step(master, exp_avg, exp_avg_sq, grad, *arguments(step=step, lr=lr, betas=betas, eps=eps,
                                                         weight_decay=weight_decay, grad_scale=grad_scale,
                                                         adam_w_mode=adam_w_mode))


def arguments(*, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
              grad_scale: float | None, adam_w_mode: bool) -> tuple[list[float], bool, int, bool]:
    """The op's arguments after the tensors (constants, scaled, decay, fused): the same for every piece of a chunk,
    so GpuShare.run makes them once a chunk."""
    fused = adam32.ARITHMETIC[adam32._capability()][0]
    decay = "none" if weight_decay == 0 else "adamw" if adam_w_mode else "adam"
    return (constants(step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale),
            grad_scale is not None, DECAYS[decay], fused)


def _step(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
          hyper: list[float], scaled: bool, decay: int, fused: bool) -> None:
    _op().adamw(master, exp_avg, exp_avg_sq, grad, hyper, scaled, decay, fused)


def share_for(update: Any, share: float) -> GpuShare | None:
    """The GPU's share of a PipelinedUpdate's Adam, or None (no share asked, or one line on why it cannot run)."""
    on_gpu = update.opt.bit16_groups_flat[0].is_cuda
    if share and not (update.reads_16bit and on_gpu and not update.ranks.several):
        extensions._say("--gpu-adam-share runs on one GPU's lean layout with fp32 optimizer states, 16-bit "
                        "gradients and fitone's exact fp32 Adam (x86): the CPU steps every chunk here")
        return None
    if not share:
        return None
    gpu_share = GpuShare(update.opt, update.host, share)
    for i in range(len(update.chunks)):  # made as the first step makes them, to be page-locked before any step
        state = update.state(i)
        for key in ("exp_avg", "exp_avg_sq"):
            gpu_share._pin(i, key, state[key])
    return gpu_share


class GpuShare:
    """The GPU's share of one rank's pipelined update (fitone.zero2.overlap.PipelinedUpdate, fp32 states on the
    lean layout, 16-bit gradients). `run` queues one chunk; `finish` waits for every copy back to the host."""

    def __init__(self, optimizer: Any, host: Any, share: float):
        if not 0 < share < 1:
            raise ValueError(f"the GPU's share of the Adam is a fraction between 0 and 1, got {share}")
        self.opt, self.host, self.share = optimizer, host, share
        self.lanes = adam32.ARITHMETIC[adam32._capability()][1]
        device = optimizer.bit16_groups_flat[0].device
        _op()  # built here (the first run of a machine), not in the update thread
        self.up, self.down = torch.cuda.Stream(device), torch.cuda.Stream(device)
        grad_dtype = host.gradients[0].dtype
        self._sets = [{"p": torch.empty(PIECE_ELEMENTS, device=device), "m": torch.empty(PIECE_ELEMENTS, device=device),
                       "v": torch.empty(PIECE_ELEMENTS, device=device),
                       "g": torch.empty(PIECE_ELEMENTS, dtype=grad_dtype, device=device),
                       "stepped": torch.cuda.Event(), "freed": torch.cuda.Event()} for _ in range(SETS)]
        self._k = 0  # pieces queued, round the sets
        self._ordinal = self._taken = 0  # this update's chunks come to / taken
        self._pinned: dict[tuple[int, str], torch.Tensor] = {}  # (group, state key) -> the tensor page-locked here

    def takes(self, ordinal: int, lo: int, hi: int) -> bool:
        """Whether chunk `ordinal` [lo, hi) is the GPU's: every element in adam32's vector loop, and in the share."""
        return (hi - lo) % self.lanes == 0 and chosen(ordinal, self.share)

    def start(self, backward_done: Any) -> None:
        """A new update: its casts must not overwrite weights the last backward still reads."""
        self._ordinal = self._taken = 0
        if backward_done is not None:
            self.up.wait_event(backward_done)

    def took(self, update: Any, i: int, c: int, lo: int, hi: int, scale: float | None, hyper: dict[str, Any],
             step: int, target: torch.Tensor) -> bool:
        """Whether chunk c [lo, hi) of group i, the update's next, is the GPU's (not speculated, in the share): if so
        it is queued, and the update's forward waits on its CUDA event (the chunk is `ready` at once)."""
        self._ordinal += 1
        if update.speculated(i, c) or not self.takes(self._ordinal - 1, lo, hi):
            return False
        update.uploaded[i][c] = self.run(i, lo, hi, scale, hyper, step, target.data)
        update.ready[i][c].set()
        self._taken += 1
        return True

    def run(self, i: int, lo: int, hi: int, scale: float | None, hyper: dict[str, Any], step: int,
            target: torch.Tensor) -> torch.cuda.Event:
        """Queue Adam on elements [lo, hi) of group i and their cast into `target` (the 16-bit weights); returns the
        event the forward waits on for them."""
        master = self.opt.single_partition_of_fp32_groups[i]
        state = self.opt.optimizer.state[master]
        m_host, v_host = (self._pin(i, key, state[key]) for key in ("exp_avg", "exp_avg_sq"))
        p_host, g_host = master.data, self.host.gradients[i]  # page-locked by the lean layout
        args = arguments(step=step, lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"],
                         weight_decay=hyper["weight_decay"], grad_scale=scale,
                         adam_w_mode=getattr(self.opt.optimizer, "adam_w_mode", True))
        for a in range(lo, hi, PIECE_ELEMENTS):
            b = min(a + PIECE_ELEMENTS, hi)
            n = b - a
            s = self._sets[self._k % SETS]
            self._k += 1
            with torch.cuda.stream(self.up):
                self.up.wait_event(s["freed"])  # this set's last piece is back on the host
                for key, src in (("p", p_host), ("m", m_host), ("v", v_host), ("g", g_host)):
                    s[key][:n].copy_(src[a:b], non_blocking=True)
                _step(s["p"][:n], s["m"][:n], s["v"][:n], s["g"][:n], *args)
                target.data[a:b].copy_(s["p"][:n])  # cast as the CPU chunks' uploads are cast
                s["stepped"].record(self.up)
            with torch.cuda.stream(self.down):
                self.down.wait_event(s["stepped"])
                for key, dst in (("p", p_host), ("m", m_host), ("v", v_host)):
                    dst[a:b].copy_(s[key][:n], non_blocking=True)
                s["freed"].record(self.down)
        done = torch.cuda.Event()
        done.record(self.up)
        return done

    def finish(self) -> dict[str, float]:
        """Block until every queued piece is back on the host (the next update, a checkpoint or a speculation reads
        those states); returns the update's counter of chunks taken."""
        self.up.synchronize()
        self.down.synchronize()
        return {"gpu_chunks": float(self._taken)}

    def _pin(self, i: int, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """Page-lock `tensor` in place (once: the copies must be asynchronous); one that replaced it (a resume) is
        re-locked. share_for locks the moments first, when the engine is built: locking them takes seconds
        (bench/results/2026-12-07d-gpu), which would otherwise land in a training step."""
        held = self._pinned.get((i, key))
        if held is not None and held.data_ptr() == tensor.data_ptr():
            return tensor
        if held is not None:
            pinning.page_unlock(self._pinned.pop((i, key)).data_ptr())
        if pinning.page_lock(tensor):
            self._pinned[(i, key)] = tensor  # held until unlocked: its pages must not be freed while locked
        return tensor

    def close(self) -> None:
        """Unlock the moments' pages (before DeepSpeed frees them)."""
        self.finish()
        while self._pinned:
            _, tensor = self._pinned.popitem()
            pinning.page_unlock(tensor.data_ptr())
