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
- Its fp32 gradient buffer (4 B/param) only ever holds 16-bit numbers: the GPU sums the micro-batches in 16
  bits and widens the sum at the copy. The lean layout keeps them in 16 bits (2 B/param) and widens a chunk
  at a time before Adam: the same numbers (bench/NOTES.md, 2026-12-01, third session).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from fitone.errors import RunDirError
from fitone.zero2 import pinning

GROUP_ELEMENTS = 2**27  # 256 MiB of 16-bit weights per group: the init peak's extra is about two of these
CHUNK_ELEMENTS = 32 * 2**20  # the lean layout's unit of work on its gradients: the GPU sums, the uploads
# 16-bit gradients are widened for Adam this many at a time (a chunk's fp32 scratch goes to memory and back;
# a slice that stays in cache is faster only on a quiet CPU: bench/NOTES.md, 2026-12-02, not yet measured on a GPU)
WIDEN_ELEMENTS = CHUNK_ELEMENTS
# a gradient larger than this is normed in pieces of it (LeanHost._lean_norm): only embeddings of large
# vocabularies are; every smaller one keeps DeepSpeed's norm bit for bit
NORM_CHUNK_ELEMENTS = CHUNK_ELEMENTS


def param_groups(model: torch.nn.Module, max_elements: int | None = None) -> list[dict[str, Any]]:
    """The trainable parameters in declaration order, cut into consecutive groups of at most `max_elements`
    (a larger single tensor gets a group of its own). The optimizer's settings are the same for every
    group, so the arithmetic is the one-group arithmetic, element for element."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups: list[list[torch.nn.Parameter]] = []
    for p, g in zip(params, group_of_each([p.numel() for p in params], max_elements)):
        if g == len(groups):
            groups.append([])
        groups[g].append(p)
    return [{"params": group} for group in groups]


def group_of_each(numels: list[int], max_elements: int | None = None) -> list[int]:
    """The group param_groups puts each of these tensor sizes in, in order (the plan sizes the init by it)."""
    max_elements = max_elements or GROUP_ELEMENTS
    groups, size = [], 0
    for n in numels:
        if not groups or size + n > max_elements:
            groups.append(groups[-1] + 1 if groups else 0)
            size = 0
        else:
            groups.append(groups[-1])
        size += n
    return groups


def world_size(opt: Any) -> int:
    """The ranks a ZeRO-2 optimizer's partitions are spread over (1: the whole model is this process's)."""
    import deepspeed.comm as dist

    return max(dist.get_world_size(group=g) for g in opt.real_dp_process_group)


def module_needs(opt: Any, model: torch.nn.Module,
                 sizes: list[int] | None = None) -> list[tuple[torch.nn.Module, list[tuple[int, int]]]]:
    """For each module of `model` with parameters of its own: (group, last element) of each of the ZeRO-2
    optimizer's flat 16-bit groups it reads (what the pipelined update's forward waits for). `sizes`, per
    group the elements of each rank's partition (several ranks, fitone.zero2.ranks): the last element is
    then the furthest one into its partition, since chunk c of every partition arrives at once."""
    where: dict[int, tuple[int, int]] = {}  # param data_ptr -> (group, end offset in the flat buffer)
    for i, (flat, params) in enumerate(zip(opt.bit16_groups_flat, opt.bit16_groups)):
        base, size = flat.data_ptr(), flat.element_size()
        for p in params:
            start = (p.data.data_ptr() - base) // size
            end = start + p.numel()
            if sizes:  # a tensor across a partition's end holds that partition's last element
                part = sizes[i]
                end = end - start // part * part if start // part == (end - 1) // part else part
            where[p.data_ptr()] = (i, end)
    needs = []
    for module in model.modules():
        ends: dict[int, int] = {}
        for p in module.parameters(recurse=False):
            if p.data_ptr() in where:
                i, end = where[p.data_ptr()]
                ends[i] = max(ends.get(i, 0), end)
        if ends:
            needs.append((module, sorted(ends.items())))
    return needs


def lean_offload_config(ds: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config the lean layout is built on: DeepSpeed allocates plain host memory (no pinned
    power-of-two blocks); `LeanHost` page-locks the two buffers the GPU copies touch, in place."""
    zero = dict(ds.get("zero_optimization") or {})
    zero["offload_optimizer"] = {**(zero.get("offload_optimizer") or {}), "pin_memory": False}
    return {**ds, "zero_optimization": zero}


class LeanHost:
    """A ZeRO-2 CPU-offload optimizer holding only what its arithmetic needs on the host: the fp32 master,
    the gradients in the 16 bits DeepSpeed sums them in, and Adam's two moments (14 B/param; fp32 training
    keeps DeepSpeed's fp32 gradients, 16 B/param; DeepSpeed's bf16 master weights and optimizer states, what
    --optimizer-states bf16 builds, 8 B/param: the same buffers in bf16, the gradients DeepSpeed's own).

    - The gradients (`gradients`, one flat buffer per group) are the 16-bit values DeepSpeed would have
      widened to fp32 on the GPU before the copy (`grad16.float()`), so they say the same numbers in half the
      bytes. Adam reads them through `fp32_gradient`, `widen_elements` at a time widened into one fp32 scratch
      (with bf16 master weights, none: the fused 16-bit step reads them as they are).
    - Between micro-batches the 16-bit sum so far lives in the parameter's slot of those buffers (DeepSpeed
      keeps a host buffer of its own per parameter, and creates one only where none is registered), and is
      overwritten by the whole step's gradient at the boundary, as DeepSpeed's boundary copy overwrites it.
    - Nothing the size of the largest parameter or group is held: the sums between micro-batches go up in
      chunks of `chunk_elements` through a small GPU buffer; DeepSpeed's 16-bit weight staging and its unused
      host gradient buffer are released. DeepSpeed's own step needed both, and a whole fp32 gradient: it is
      refused here, and the pipelined update runs its arithmetic chunk by chunk instead (`fitone.zero2.overlap`).
    - On a GPU the fp32 master and the gradient buffers are page-locked in place (cudaHostRegister: no copy,
      no rounding), so the gradient copies and the uploads stay asynchronous.

    On several ranks a parameter may lie partly in this rank's partition (`grad_position`): its sums between
    micro-batches, norm and copies run on that slice. DeepSpeed sums the whole parameter, and only its overflow
    check reads the rest: it drops a step whose fp16 sum overflows outside the slice alone, this layout does not.
    """

    def __init__(self, optimizer: Any, chunk_elements: int | None = None, widen_elements: int | None = None):
        if not getattr(optimizer, "cpu_offload", False) or optimizer.cpu_offload_pin_memory:
            raise ValueError("the lean host layout needs ZeRO-2's CPU offload built with pin_memory false")
        if optimizer.gradient_accumulation_dtype != optimizer.dtype:
            raise ValueError("the lean host layout keeps the gradients in the dtype DeepSpeed sums them in: "
                             "drop data_types.grad_accum_dtype from the DeepSpeed config")
        self.opt = optimizer
        self.chunk_elements = chunk_elements or CHUNK_ELEMENTS
        self.widen_elements = min(widen_elements or WIDEN_ELEMENTS, self.chunk_elements)
        self._registered: list[int] = []  # host addresses page-locked here, unregistered in close()
        self._release_unused_buffers()
        self.gradients = self._gradient_buffers()
        optimizer._get_offload_gradient_dict = self._offload_gradient_dict  # shadows the method on this optimizer
        self._offload_gradient_dict()
        self._upcast = self._upcast_scratch()
        self._accumulate_in_gradient_buffers()
        self._lean_accumulation()
        self._lean_boundary_copy()
        self._lean_norm()
        optimizer.step = _refuse_deepspeeds_step
        if optimizer.bit16_groups_flat[0].is_cuda:
            for master, grads in zip(optimizer.single_partition_of_fp32_groups, self.gradients):
                self._register(master.data)
                self._register(grads)

    # -- building the layout --------------------------------------------------------------------------
    def _release_unused_buffers(self) -> None:
        """DeepSpeed's 16-bit weight staging (only its own step uploads from it), its host buffer for the
        largest gradient (read by no offload path), and its GPU buffer for the largest parameter's sum so
        far, cut to one chunk (the adds below go chunk by chunk)."""
        opt = self.opt
        staging = opt.param_buffer_of_bit16_for_cpu_offload_groups
        for i, buffer in enumerate(staging):
            staging[i] = buffer.new_empty(0)
        opt.temp_grad_buffer_for_cpu_offload = opt.temp_grad_buffer_for_cpu_offload.new_empty(0)
        carried = opt.temp_grad_buffer_for_gpu_offload
        opt.temp_grad_buffer_for_gpu_offload = None  # freed before its successor is allocated
        opt.temp_grad_buffer_for_gpu_offload = torch.zeros(min(carried.numel(), self.chunk_elements),
                                                           dtype=carried.dtype, device=carried.device)

    def _gradient_buffers(self) -> list[torch.Tensor]:
        """One flat gradient buffer per group in the dtype of the GPU's gradients, in place of DeepSpeed's fp32
        ones (fp32 training: DeepSpeed's own). Each fp32 buffer is let go before its successor exists."""
        opt = self.opt
        for views in opt.offload_gradient_dict.values():  # views of the fp32 buffers (DeepSpeed's hp mapping)
            views.clear()
        buffers = []
        for i, master in enumerate(opt.single_partition_of_fp32_groups):
            dtype = opt.bit16_groups_flat[i].dtype
            if dtype == master.grad.dtype:
                buffers.append(master.grad)
                continue
            master.grad = None  # DeepSpeedCPUAdam would skip such a group: its step is refused (__init__)
            buffers.append(torch.zeros(master.numel(), dtype=dtype, device=master.device))  # as DeepSpeed's
        return buffers

    def _upcast_scratch(self) -> torch.Tensor | None:
        # bf16 master weights (--optimizer-states bf16): the fused 16-bit step reads the 16-bit gradients as they are
        if self.opt.single_partition_of_fp32_groups[0].dtype == torch.bfloat16:
            return None
        if all(g.dtype == torch.float32 for g in self.gradients):
            return None
        largest = max(g.numel() for g in self.gradients)
        return torch.empty(min(largest, self.widen_elements), dtype=torch.float32)

    @property
    def widens(self) -> bool:
        """Whether Adam's gradients are widened from 16 bits (at most `widen_elements` per `fp32_gradient`)."""
        return self._upcast is not None

    def _offload_gradient_dict(self) -> None:
        """DeepSpeed's per-parameter views of the host gradients (`_get_offload_gradient_dict`, what
        safe_get_full_grad reads), on these buffers: rebuilt at init and whenever DeepSpeed relinks after a
        checkpoint load."""
        opt = self.opt
        for i, params in enumerate(opt.params_in_partition):
            views = []
            for p in params:
                _, _, dest_offset, n = opt.grad_position[opt.get_param_id(p)]
                views.append(self.gradients[i].narrow(0, dest_offset, n))
            opt.offload_gradient_dict[i] = views

    def _accumulate_in_gradient_buffers(self) -> None:
        opt = self.opt
        for i, params in enumerate(opt.params_in_partition):
            for p in params:
                param_id = opt.get_param_id(p)
                _, _, dest_offset, n = opt.grad_position[param_id]
                opt.accumulated_grads_in_cpu[param_id] = self.gradients[i].narrow(0, dest_offset, n)

    def _lean_accumulation(self) -> None:
        """DeepSpeed's accumulation between micro-batches (async_accumulate_grad_in_cpu_via_gpu), the same
        16-bit adds on the GPU in the same order, in chunks, without two costs that protect what this layout
        does not have (bench/NOTES.md, 2026-12-01):
        - its host wait, per parameter, for every earlier gradient copy: a pageable host buffer is read when
          its copy is queued, not in stream order, but these are page-locked (on a GPU) or not copied
          asynchronously at all (on a CPU). The wait kept the next layer's backward from being queued
          beside the copies. The copies are still recorded, so the step's own wait before the update
          reads the buffers stays.
        - at the accumulation boundary, its copy of the 16-bit sum to the host: the boundary copy right after
          it, on the same stream, overwrites that slot (`_lean_boundary_copy`).
        The sum so far comes up chunk by chunk through one chunk-sized GPU buffer (DeepSpeed's is as large as
        the largest parameter): copies and adds are queued on one stream, so a chunk's copy lands only after
        the last chunk's add has read the buffer. An add is elementwise: chunked, the same bits.
        """
        opt, chunk = self.opt, self.chunk_elements

        def accumulate(param: torch.nn.Parameter) -> None:
            param_id = opt.get_param_id(param)
            held = opt.accumulated_grads_in_cpu[param_id].view(-1)
            _, source_offset, _, n = opt.grad_position[param_id]  # this rank's slice (all of it on one rank)
            grad = opt.get_param_gradient_attribute(param).data.view(-1).narrow(0, source_offset, n)
            if opt.micro_step_id > 0:
                for lo in range(0, grad.numel(), chunk):
                    hi = min(lo + chunk, grad.numel())
                    carried = opt.temp_grad_buffer_for_gpu_offload.narrow(0, 0, hi - lo)
                    carried.copy_(held[lo:hi], non_blocking=True)
                    grad[lo:hi].add_(carried)
            if not opt.is_gradient_accumulation_boundary():
                held.copy_(grad, non_blocking=True)
            opt._record_offload_copy()

        def restore(param: torch.nn.Parameter) -> None:
            raise ValueError("the lean host layout runs DeepSpeed's managed gradient accumulation: drop "
                             "managed_gradient_accumulation false from the DeepSpeed config")

        opt.async_accumulate_grad_in_cpu_via_gpu = accumulate  # shadows the method on this optimizer only
        opt._restore_cpu_offload_grad_to_gpu = restore  # unmanaged mode's, sized by the buffer cut above

    def _lean_boundary_copy(self) -> None:
        """DeepSpeed's copy of a parameter's whole-step gradient to the host (async_inplace_copy_grad_to_fp32_
        buffer_from_gpu), without its widening to fp32 on the GPU (a transient fp32 copy of the parameter):
        the 16-bit values go down as they are, half the bytes, and `fp32_gradient` widens them on the host."""
        from deepspeed.accelerator import get_accelerator

        opt = self.opt

        def copy_to_host(param: torch.nn.Parameter) -> None:
            i, source_offset, dest_offset, n = opt.grad_position[opt.get_param_id(param)]
            grad = opt.get_param_gradient_attribute(param)
            assert grad is not None
            stream = get_accelerator().current_stream()
            if opt._offload_gradient_safety_enabled:  # as DeepSpeed: a slot may last have been written elsewhere
                for producer, event in opt._pending_offload_events.items():
                    if producer != stream:
                        stream.wait_event(event)
            self.gradients[i].narrow(0, dest_offset, n).copy_(grad.view(-1).narrow(0, source_offset, n),
                                                             non_blocking=True)
            opt._record_gradient_stream(grad, stream)
            opt._record_offload_copy()
            opt.clear_grad_attribute(param)

        opt.async_inplace_copy_grad_to_fp32_buffer_from_gpu = copy_to_host  # on this optimizer only

    def _lean_norm(self) -> None:
        """DeepSpeed's norm of each parameter's gradient at the boundary (set_norm_for_param_grad_in_gpu) widens
        the whole gradient to fp64 first: 8 bytes per element of the largest parameter on the GPU (4 GiB for a
        128k-vocabulary embedding). A parameter larger than one chunk is normed a chunk at a time instead, in
        fp64, and the chunks' norms combined in fp64. That rounds differently from one fp64 norm, by about
        1e-16 relative; DeepSpeed rounds the total to fp32 before it is used (the clip factor, the overflow
        vote), so the two agree unless the total lies that close to an fp32 rounding midpoint. Parameters of
        NORM_CHUNK_ELEMENTS or less (every one in the CPU suite) get DeepSpeed's own norm, bit for bit."""
        from deepspeed.runtime.zero.utils import get_norm_dtype

        opt, chunk, own = self.opt, NORM_CHUNK_ELEMENTS, self.opt.set_norm_for_param_grad_in_gpu

        def norm(param: torch.nn.Parameter) -> None:
            _, source_offset, _, n = opt.grad_position[opt.get_param_id(param)]
            if n <= chunk:
                return own(param)
            grad = opt.get_param_gradient_attribute(param)
            grad = (param.grad if grad is None else grad).data.view(-1).narrow(0, source_offset, n)
            dtype = get_norm_dtype()
            parts = torch.stack([grad[lo:lo + chunk].to(dtype).norm(2) for lo in range(0, n, chunk)])
            opt.norm_for_param_grads[opt.get_param_id(param)] = parts.norm(2)

        opt.set_norm_for_param_grad_in_gpu = norm  # shadows the method on this optimizer only

    # -- what the update reads ------------------------------------------------------------------------
    def fp32_gradient(self, i: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of group i's gradient in fp32 (at most `widen_elements` of them): the buffer
        itself in fp32 training, else widened into the one scratch chunk, valid until the next call. The
        widening is exact: every 16-bit number is an fp32 number."""
        grads = self.gradients[i][lo:hi]
        if grads.dtype == torch.float32:
            return grads
        if self._upcast is None:
            raise ValueError("16-bit optimizer states hold no fp32 scratch: their step reads `gradients` as they are")
        if hi - lo > self._upcast.numel():
            raise ValueError(f"{hi - lo} elements asked for at once; the scratch holds {self._upcast.numel()}")
        return self._upcast[:hi - lo].copy_(grads)

    def _register(self, tensor: torch.Tensor) -> None:
        if pinning.page_lock(tensor):
            self._registered.append(tensor.data_ptr())

    def host_bytes(self) -> dict[str, int]:
        """What the optimizer holds on the host, by buffer (Adam's moments once its first step made them)."""
        opt = self.opt
        masters = opt.single_partition_of_fp32_groups
        def held(*keys: str) -> int:
            return sum(t.numel() * t.element_size() for m in masters for k, t in opt.optimizer.state[m].items()
                       if isinstance(t, torch.Tensor) and k in keys)

        kind = "bf16" if masters[0].dtype == torch.bfloat16 else "fp32"  # --optimizer-states bf16: DeepSpeed's bf16 one
        compensation = held("compensation")  # --optimizer-states bf16-kahan only
        return {f"{kind} master": sum(m.numel() * m.element_size() for m in masters),
                "gradients": sum(g.numel() * g.element_size() for g in self.gradients),
                "Adam moments": held("exp_avg", "exp_avg_sq"),
                "fp32 upcast": 0 if self._upcast is None else self._upcast.numel() * 4,
                **({"compensation": compensation} if compensation else {})}

    def close(self) -> None:
        """Unlock the pages before DeepSpeed frees the buffers (the driver must not keep recycled pages)."""
        while self._registered:
            pinning.page_unlock(self._registered.pop())


def _refuse_deepspeeds_step(closure: Any = None) -> None:
    raise RuntimeError("DeepSpeed's own step cannot run on the lean host layout (it reads one fp32 gradient "
                       "buffer per group, which the layout does not hold): fitone.zero2.overlap.PipelinedUpdate "
                       "steps it")


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
        keys = ["fp32"] + [k for k in ("exp_avg", "exp_avg_sq", "compensation") if old_state and k in old_state[0]]
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
            state[g] = {"step": old_state[0]["step"], **{k: new[k] for k in keys[1:]}}
    groups = [{**old_base["param_groups"][0], "params": [g]} for g in range(len(fp32))]
    return {**saved, "single_partition_of_fp32_groups": fp32,
            "base_optimizer_state": {"state": state, "param_groups": groups},
            **{k: target[k] for k in ("group_paddings", "param_alignment_paddings", "partition_count",
                                      "param_slice_mappings") if k in target}}


def _states_kind(dtype: torch.dtype, states: Any) -> str:
    """fp32, bf16, or bf16-kahan (bf16 with a compensation buffer), from a master's dtype and Adam's states."""
    kind = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
    return kind + "-kahan" if any("compensation" in s for s in states) else kind


def check_saved_states(saved: dict[str, Any], opt: Any, path: str) -> None:
    """Refuse, in one line, an optimizer state saved with other --optimizer-states than `opt` holds: DeepSpeed
    would cast it silently (fp32 rounded to bf16, or bf16 widened, as if it were the exact mode's), or drop or
    miss bf16-kahan's compensation buffer (`bf16` and `bf16-nearest` hold the same buffers)."""
    masters = saved.get("single_partition_of_fp32_groups") or []
    if not masters or not isinstance(masters[0], torch.Tensor):
        return
    base = saved.get("base_optimizer_state")  # DeepSpeed's rigid form (a dict) or its elastic one (a list)
    saved_states = (base.get("state") or {}).values() if isinstance(base, dict) else base or []
    was = _states_kind(masters[0].dtype, saved_states)
    now = _states_kind(opt.single_partition_of_fp32_groups[0].dtype, opt.optimizer.state.values())
    if was != now:
        flag = {"bf16": "bf16 (or bf16-nearest)"}.get(was, was)
        raise RunDirError(f"checkpoint {os.path.dirname(path)} holds {was} optimizer states and this run keeps {now} "
                          f"ones: resume with --optimizer-states {flag}, or start a new "
                          "run from the exported model (final/)")


@contextmanager
def loading_across_layouts(ds_engine: Any, opt: Any) -> Iterator[None]:
    """While DeepSpeed loads a checkpoint: an optimizer state saved under other parameter groups is laid
    out in this engine's groups first (`regroup_saved_state`); one saved under the same groups is as saved.
    One saved with other --optimizer-states is refused (`check_saved_states`)."""
    engine_load = ds_engine.checkpoint_engine.load

    def load(path: str, *args: Any, **kwargs: Any) -> Any:
        loaded = engine_load(path, *args, **kwargs)
        saved = loaded.get("optimizer_state_dict") if isinstance(loaded, dict) else None
        if isinstance(saved, dict):
            check_saved_states(saved, opt, path)
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
