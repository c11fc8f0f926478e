"""How ZeRO-2's memory is laid out: bounded parameter groups (the GPU's init peak) and the lean host
layout that the pipelined update runs on (the host's bytes per parameter).

Why each exists (measured in bench/results/2026-11-30-issue19/):
- DeepSpeed flattens each parameter group into one 16-bit buffer on the GPU while the group's own
  tensors are still there, and clones that buffer on the GPU to make the fp32 master. With the whole
  model in one group that is a second (and third) copy of the weights: a 7B model cannot initialise
  on a 24 GB card. With groups of at most `GROUP_ELEMENTS` the extra is about two groups.
- DeepSpeed's offload keeps, besides the fp32 master, gradients and Adam's moments (16 B/param), a
  16-bit staging copy of the weights (2 B/param, its own step uploads from it), a pinned 16-bit buffer
  per parameter for gradient accumulation, and every pinned block rounded up to a power of two.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

GROUP_ELEMENTS = 2**27  # 256 MiB of 16-bit weights per group: the init peak's extra is about two of these


def param_groups(model: torch.nn.Module, max_elements: int | None = None) -> list[dict[str, Any]]:
    """The trainable parameters in declaration order, cut into consecutive groups of at most `max_elements`
    (a larger single tensor gets a group of its own). The optimizer's settings are the same for every
    group, so the arithmetic is the one-group arithmetic, element for element."""
    max_elements = max_elements or GROUP_ELEMENTS
    groups: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if not groups or size + p.numel() > max_elements:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel()
    return [{"params": params} for params in groups]


def world_size(opt: Any) -> int:
    """The ranks a ZeRO-2 optimizer's partitions are spread over (1: the whole model is this process's)."""
    import deepspeed.comm as dist

    return max(dist.get_world_size(group=g) for g in opt.real_dp_process_group)


def lean_offload_config(ds: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config the lean layout is built on: DeepSpeed allocates plain host memory (no pinned
    power-of-two blocks); `LeanHost` page-locks the two buffers the GPU copies touch, in place."""
    zero = dict(ds.get("zero_optimization") or {})
    zero["offload_optimizer"] = {**(zero.get("offload_optimizer") or {}), "pin_memory": False}
    return {**ds, "zero_optimization": zero}


class LeanHost:
    """A ZeRO-2 CPU-offload optimizer holding only what its arithmetic needs on the host: the fp32 master,
    the fp32 gradients and Adam's two moments (16 B/param).

    - DeepSpeed's step stages each group's new 16-bit weights on the host before the upload, one group
      after another; every group's staging buffer here is a view of one scratch buffer the size of the
      largest group (DeepSpeed's first step uses it; the pipelined update uploads fp32 chunks instead).
    - Between micro-batches, DeepSpeed keeps the 16-bit gradient sum so far in a host buffer of its own per
      parameter. Here that buffer is the first half of the parameter's slot in the fp32 gradient buffer:
      the same 16-bit values (so DeepSpeed's arithmetic, bit for bit), overwritten by the fp32 gradient at
      the boundary as before. DeepSpeed creates a buffer only where none is registered.
    - On a GPU the fp32 master and gradient buffers are page-locked in place (cudaHostRegister: no copy, no
      rounding), so the gradient copies and the uploads stay asynchronous.

    One rank only (the pipelined update's case), where every parameter lies whole in the partition.
    """

    def __init__(self, optimizer: Any):
        if not getattr(optimizer, "cpu_offload", False) or optimizer.cpu_offload_pin_memory:
            raise ValueError("the lean host layout needs ZeRO-2's CPU offload built with pin_memory false")
        self.opt = optimizer
        self._registered: list[int] = []  # host addresses page-locked here, unregistered in close()
        staging = optimizer.param_buffer_of_bit16_for_cpu_offload_groups
        scratch = staging[0].new_empty(max(b.numel() for b in staging))  # a pageable copy to the GPU returns
        for i, buffer in enumerate(staging):  # once the source is read, so the next group may reuse it
            staging[i] = scratch[:buffer.numel()].view_as(buffer)
        self._accumulate_in_gradient_buffers()
        self._lean_accumulation()
        if optimizer.bit16_groups_flat[0].is_cuda:
            for master in optimizer.single_partition_of_fp32_groups:
                self._register(master.data)
                self._register(master.grad)

    def _accumulate_in_gradient_buffers(self) -> None:
        opt = self.opt
        for i, params in enumerate(opt.params_in_partition):
            dtype = opt.bit16_groups_flat[i].dtype
            per_slot = 4 // torch.tensor([], dtype=dtype).element_size()  # 16-bit: two per fp32 slot; fp32: one
            slots = opt.single_partition_of_fp32_groups[i].grad.view(dtype)
            for p in params:
                param_id = opt.get_param_id(p)
                _, source_offset, dest_offset, n = opt.grad_position[param_id]
                if source_offset != 0 or n != p.numel():
                    raise ValueError("the lean host layout runs on one rank (each parameter whole in the partition)")
                opt.accumulated_grads_in_cpu[param_id] = slots.narrow(0, per_slot * dest_offset, n)

    def _lean_accumulation(self) -> None:
        """DeepSpeed's accumulation between micro-batches (async_accumulate_grad_in_cpu_via_gpu), the same
        16-bit adds on the GPU in the same order, without two costs that protect what this layout does not
        have (bench/NOTES.md, 2026-12-01):
        - its host wait, per parameter, for every earlier gradient copy: a pageable host buffer is read when
          its copy is queued, not in stream order, but these are page-locked (on a GPU) or not copied
          asynchronously at all (on a CPU). The wait kept the next layer's backward from being queued
          beside the copies. The copies are still recorded, so the step's own wait before the update
          reads the buffers stays.
        - at the accumulation boundary, its copy of the 16-bit sum to the host: the fp32 gradient copied
          right after it, on the same stream, overwrites that slot (`_accumulate_in_gradient_buffers`).
        """
        opt = self.opt

        def accumulate(param: torch.nn.Parameter) -> None:
            held = opt.accumulated_grads_in_cpu[opt.get_param_id(param)].view(-1)
            grad = opt.get_param_gradient_attribute(param).data.view(-1)
            if opt.micro_step_id > 0:
                # a reused GPU buffer, as DeepSpeed's: the copy and the add are queued on one stream
                carried = opt.temp_grad_buffer_for_gpu_offload.view(-1).narrow(0, 0, param.numel())
                carried.copy_(held, non_blocking=True)
                grad.add_(carried)
            if not opt.is_gradient_accumulation_boundary():
                held.copy_(grad, non_blocking=True)
            opt._record_offload_copy()

        opt.async_accumulate_grad_in_cpu_via_gpu = accumulate  # shadows the method on this optimizer only

    def _register(self, tensor: torch.Tensor) -> None:
        if tensor.numel() == 0 or tensor.is_pinned():
            return
        code = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister failed ({code}) on {tensor.numel() * tensor.element_size()} bytes")
        self._registered.append(tensor.data_ptr())

    def host_bytes(self) -> dict[str, int]:
        """What the optimizer holds on the host, by buffer (Adam's moments once its first step made them)."""
        opt = self.opt
        masters = opt.single_partition_of_fp32_groups
        moments = sum(t.numel() * t.element_size() for m in masters for k, t in opt.optimizer.state[m].items()
                      if isinstance(t, torch.Tensor) and k in ("exp_avg", "exp_avg_sq"))
        return {"fp32 master": sum(m.numel() * 4 for m in masters),
                "fp32 gradients": sum(m.grad.numel() * 4 for m in masters),
                "Adam moments": moments,
                "16-bit staging": max(b.untyped_storage().nbytes()
                                      for b in opt.param_buffer_of_bit16_for_cpu_offload_groups)}

    def close(self) -> None:
        """Unlock the pages before DeepSpeed frees the buffers (the driver must not keep recycled pages)."""
        while self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._registered.pop())


def regroup_saved_state(saved: dict[str, Any], opt: Any) -> dict[str, Any]:
    """A ZeRO-2 optimizer state saved under other parameter groups (before bounded groups, fitone saved
    models of any size as one group), laid out again in `opt`'s groups, parameter by parameter: both
    layouts name each parameter's slice of its group (`param_slice_mappings`). One rank only."""
    if max(saved.get("partition_count") or [1]) != 1 or world_size(opt) != 1:
        raise ValueError("a checkpoint saved under other parameter groups resumes on one rank only")
    where = {name: (g, frag)
             for g, mapping in enumerate(saved["param_slice_mappings"]) for name, frag in mapping.items()}
    target = opt.state_dict()
    old_fp32 = saved["single_partition_of_fp32_groups"]
    old_base = saved["base_optimizer_state"]
    old_state = old_base["state"]
    fp32, state = [], {}
    for g, mapping in enumerate(target["param_slice_mappings"]):
        size = target["single_partition_of_fp32_groups"][g].numel()
        keys = ["fp32"] + (["exp_avg", "exp_avg_sq"] if old_state else [])
        new = {k: torch.zeros(size, dtype=torch.float32) for k in keys}
        for name, frag in mapping.items():
            if name not in where:
                raise ValueError(f"the checkpoint has no optimizer state for parameter {name}")
            og, old = where[name]
            for k in keys:
                source = old_fp32[og] if k == "fp32" else old_state[og][k]
                new[k][frag.start:frag.start + frag.numel].copy_(source[old.start:old.start + old.numel])
        fp32.append(new["fp32"])
        if old_state:
            state[g] = {"step": old_state[0]["step"], "exp_avg": new["exp_avg"], "exp_avg_sq": new["exp_avg_sq"]}
    groups = [{**old_base["param_groups"][0], "params": [g]} for g in range(len(fp32))]
    return {**saved, "single_partition_of_fp32_groups": fp32,
            "base_optimizer_state": {"state": state, "param_groups": groups},
            **{k: target[k] for k in ("group_paddings", "param_alignment_paddings", "partition_count",
                                      "param_slice_mappings") if k in target}}


@contextmanager
def loading_across_layouts(ds_engine: Any, opt: Any) -> Iterator[None]:
    """While DeepSpeed loads a checkpoint: an optimizer state saved under other parameter groups is laid
    out in this engine's groups first (`regroup_saved_state`); one saved under the same groups is as saved."""
    engine_load = ds_engine.checkpoint_engine.load

    def load(path: str, *args: Any, **kwargs: Any) -> Any:
        loaded = engine_load(path, *args, **kwargs)
        saved = loaded.get("optimizer_state_dict") if isinstance(loaded, dict) else None
        if isinstance(saved, dict) and "param_slice_mappings" in saved:
            names = [list(m) for m in saved["param_slice_mappings"]]
            if names != [list(m) for m in opt._param_slice_mappings]:
                loaded = {**loaded, "optimizer_state_dict": regroup_saved_state(saved, opt)}
        return loaded

    ds_engine.checkpoint_engine.load = load
    try:
        yield
    finally:
        ds_engine.checkpoint_engine.load = engine_load
