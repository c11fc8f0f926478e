"""DeepSpeedCPUAdam against PyTorch's fused CPU AdamW (what fitone.zero2.overlap uses) on one flat fp32 tensor.

Median of 5 steps after one warm-up step, and the largest weight difference after them. With `--slices`,
instead: the lean layout's update from 16-bit gradients (widen a slice into an fp32 scratch, then fused AdamW
on it) at each slice size, to see what a scratch that stays in the CPU's cache saves (bench/NOTES.md). With
`--states`: that update (one slice) against --optimizer-states bf16's step (fitone.zero2.low_precision) rounded
to the nearest and stochastically, on the same gradients.

    python scripts/bench_cpu_adam.py --elements 100000000
    python scripts/bench_cpu_adam.py --elements 100000000 --slices 33554432,4194304,1048576
    python scripts/bench_cpu_adam.py --elements 33554432 --states
    python scripts/bench_cpu_adam.py --elements 33554432 --fused16
    python scripts/bench_cpu_adam.py --elements 1073741824 --threads 4,8,12,15,16

`--fused16`: the exact mode's update against the candidates for one fused 16-bit step, each from the bf16
gradient as it is: fitone's C++ op (fitone.zero2.low_precision.fused_adamw_16bit, nearest and stochastic),
DeepSpeedCPUAdam on bf16 parameters and bf16 states, and torch.compile of the reference's arithmetic; with
each one's bits against the reference's (low_precision.adamw_16bit) after one step.

`--threads`: the pipelined update's exact op (fitone.zero2.adam32, fp32 master and moments from bf16 gradients)
chunk by chunk as the update runs it, from a thread of its own, at each thread count; with the bytes it moves a
second (26 an element), against which the machine's memory bandwidth says how close to its limit it runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import _harness  # noqa: F401 - the checkout's fitone first on the path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=100_000_000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--slices", default=None, help="comma-separated slice sizes (elements): time the widening + "
                    "AdamW from bf16 gradients at each")
    ap.add_argument("--states", action="store_true", help="time the 16-bit optimizer states' step beside fp32's")
    ap.add_argument("--fused16", action="store_true", help="time the fused 16-bit step's candidates beside fp32's")
    ap.add_argument("--threads", default=None, help="comma-separated OpenMP thread counts: time the exact op at each")
    args = ap.parse_args()
    if args.threads:
        return exact_op_threads(args.elements, [int(x) for x in args.threads.split(",")], args.steps)
    if args.fused16:
        return fused_candidates(args.elements, args.steps)
    if args.states:
        return sixteen_bit_states(args.elements, args.steps)
    if args.slices:
        return widened(args.elements, [int(x) for x in args.slices.split(",")], args.steps)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fitone/torch_extensions"))
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    n = args.elements
    torch.manual_seed(0)
    start, grad = torch.randn(n), torch.randn(n) * 1e-3
    ds_param = torch.nn.Parameter(start.clone())
    ds_param.grad = grad.clone()
    ds = DeepSpeedCPUAdam([ds_param], lr=1e-3, weight_decay=0.01)
    param, m, v, step = start.clone(), torch.zeros(n), torch.zeros(n), torch.tensor(0.0)

    def torch_step() -> None:
        step.add_(1)
        torch._fused_adamw_([param], [grad], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)

    for name, fn in (("DeepSpeedCPUAdam", ds.step), ("torch._fused_adamw_", torch_step)):
        fn()  # warm-up (DeepSpeed's first call also builds or loads its extension)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(f"{name:22s} {statistics.median(times):.4f} s per step over {n:,} elements "
              f"({torch.get_num_threads()} threads)")
    print(f"largest weight difference after {args.steps + 1} steps: {(ds_param.data - param).abs().max().item():.2e}")


def exact_op_threads(n: int, counts: list[int], steps: int) -> None:
    """fitone.zero2.adam32's op over n elements in the lean layout's chunks, run from a background thread (the
    update's) with `torch.set_num_threads(k)` there for each k."""
    import threading

    from fitone.zero2 import adam32
    from fitone.zero2.layout import CHUNK_ELEMENTS

    if not adam32.available():
        raise SystemExit("the exact op cannot be built here")
    param, m, v = torch.full((n,), 0.5), torch.zeros(n), torch.zeros(n)
    grad = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def run(k: int, out: list[float]) -> None:
        torch.set_num_threads(k)  # this thread's OpenMP teams only
        for step in range(1, steps + 2):
            t0 = time.perf_counter()
            for lo in range(0, n, CHUNK_ELEMENTS):
                hi = min(lo + CHUNK_ELEMENTS, n)
                adam32.adamw(param[lo:hi], m[lo:hi], v[lo:hi], grad[lo:hi], step=step, grad_scale=1024.0, **hyper)
            if step > 1:  # the first pass warms the pages
                out.append(time.perf_counter() - t0)

    for k in counts:
        times: list[float] = []
        worker = threading.Thread(target=run, args=(k, times))
        worker.start()
        worker.join()
        s = statistics.median(times)
        print(f"exact op, {k:2d} threads: {s:.4f} s per step over {n:,} elements, {s / n * 1e9:.3f} s per 1e9, "
              f"{26 * n / s / 1e9:.1f} GB/s at 26 B an element", flush=True)


def widened(n: int, slices: list[int], steps: int) -> None:
    """Fused AdamW over n elements from bf16 gradients, widened into an fp32 scratch `size` elements at a time;
    the weights after the steps are compared bit for bit across slice sizes (the update is elementwise)."""
    torch.manual_seed(0)
    start, grad16 = torch.randn(n), (torch.randn(n) * 1e-3).bfloat16()
    results = {}
    for size in slices:
        param, m, v, scratch = start.clone(), torch.zeros(n), torch.zeros(n), torch.empty(size)
        step, times = torch.tensor(0.0), []
        for k in range(steps + 1):
            step.add_(1)
            t0 = time.perf_counter()
            for lo in range(0, n, size):
                hi = min(lo + size, n)
                g = scratch[:hi - lo].copy_(grad16[lo:hi])
                torch._fused_adamw_([param[lo:hi]], [g], [m[lo:hi]], [v[lo:hi]], [], [step], lr=1e-3, beta1=0.9,
                                    beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
            if k:  # the first pass warms the pages
                times.append(time.perf_counter() - t0)
        results[size] = param
        print(f"slices of {size:>11,}: {statistics.median(times):.4f} s per step over {n:,} elements "
              f"({torch.get_num_threads()} threads)", flush=True)
    first = next(iter(results.values()))
    print("weights bit-identical across slice sizes:", all(torch.equal(first, w) for w in results.values()))


def sixteen_bit_states(n: int, steps: int) -> None:
    """AdamW over n elements from bf16 gradients: fused on fp32 master and moments (the exact mode, one widened
    slice), then fitone.zero2.low_precision's step on bf16 ones, to the nearest and stochastically."""
    from fitone.zero2.low_precision import NEAREST, STOCHASTIC, RandomBits, Workspace, adamw_16bit

    torch.manual_seed(0)
    start, grad16 = torch.randn(n), (torch.randn(n) * 1e-3).bfloat16()
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    param, m, v, scratch = start.clone(), torch.zeros(n), torch.zeros(n), torch.empty(n)
    p16, m16, v16 = start.bfloat16(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)

    def exact(k: int) -> None:
        torch._fused_adamw_([param], [scratch.copy_(grad16)], [m], [v], [], [torch.tensor(float(k))], lr=1e-3,
                            beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)

    bits, work = RandomBits(0), Workspace()  # as the pipelined update keeps them

    def low(rounding: str):
        return lambda k: adamw_16bit(p16, m16, v16, scratch.copy_(grad16), step=k, rounding=rounding, bits=bits,
                                     work=work, **hyper)

    for name, fn in (("fp32 states, fused", exact), ("bf16 states, nearest", low(NEAREST)),
                     ("bf16 states, stochastic", low(STOCHASTIC))):
        times = []
        for k in range(1, steps + 2):
            t0 = time.perf_counter()
            fn(k)
            if k > 1:  # the first pass warms the pages
                times.append(time.perf_counter() - t0)
        print(f"{name:24s} {statistics.median(times):.4f} s per step over {n:,} elements "
              f"({torch.get_num_threads()} threads)", flush=True)


def _timed(name: str, fn, steps: int, n: int) -> None:
    times = []
    for k in range(1, steps + 2):
        t0 = time.perf_counter()
        fn(k)
        if k > 1:  # the first pass warms the pages (and builds or compiles)
            times.append(time.perf_counter() - t0)
    print(f"{name:34s} {statistics.median(times):.4f} s per step over {n:,} elements "
          f"({torch.get_num_threads()} threads)", flush=True)


def _differ(name: str, got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    """How many of the master's, m's and v's bf16 values differ from the reference's, and by at most how
    many bf16 steps (bf16 patterns of one sign are ordered as integers)."""
    parts = []
    for a, b in zip(got, want):
        gap = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
        parts.append(f"{int((gap != 0).sum()):,} ({int(gap.max())} steps at most)")
    print(f"{name:34s} against the reference, values that differ (master, m, v): {', '.join(parts)}", flush=True)


def fused_candidates(n: int, steps: int) -> None:
    """The exact mode's update (bf16 gradient widened into an fp32 scratch, fused AdamW on fp32 states), then
    each fused 16-bit candidate on bf16 states from the bf16 gradient; then each candidate's bits after one
    step from the same states against the reference (low_precision.adamw_16bit), to the nearest."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fitone/torch_extensions"))
    from fitone.zero2 import low_precision as lp

    torch.manual_seed(0)
    start, grad16 = torch.randn(n), (torch.randn(n) * 1e-3).bfloat16()
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    param, m, v, scratch = start.clone(), torch.zeros(n), torch.zeros(n), torch.empty(n)

    def states() -> tuple[torch.Tensor, ...]:
        return start.bfloat16(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)

    def exact(k: int) -> None:
        torch._fused_adamw_([param], [scratch.copy_(grad16)], [m], [v], [], [torch.tensor(float(k))], lr=1e-3,
                            beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)

    bits = lp.RandomBits(0)
    fused_states = states()

    def fused(rounding: str):
        return lambda k: lp.fused_adamw_16bit(*fused_states, grad16, step=k, rounding=rounding, bits=bits, **hyper)

    ds_param = torch.nn.Parameter(start.bfloat16())
    ds_param.grad = grad16.clone()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    ds = DeepSpeedCPUAdam([ds_param], fp32_optimizer_states=False, **hyper)
    compiled_states = states()
    compiled = torch.compile(_compiled_step, dynamic=False)

    def by_compile(k: int) -> None:
        compiled(*compiled_states, grad16, torch.tensor(float(k)))

    _timed("fp32 states, fused AdamW", exact, steps, n)
    _timed("bf16 states, fitone op, nearest", fused(lp.NEAREST), steps, n)
    _timed("bf16 states, fitone op, stochastic", fused(lp.STOCHASTIC), steps, n)
    _timed("bf16 states, DeepSpeedCPUAdam", lambda k: ds.step(), steps, n)
    _timed("bf16 states, torch.compile, nearest", by_compile, steps, n)

    want = states()
    lp.adamw_16bit(*want, grad16.float(), step=1, rounding=lp.NEAREST, **hyper)
    got = states()
    lp.fused_adamw_16bit(*got, grad16, step=1, rounding=lp.NEAREST, **hyper)
    _differ("fitone op, nearest", got, want)
    ds_param.data.copy_(start.bfloat16())
    ds = DeepSpeedCPUAdam([ds_param], fp32_optimizer_states=False, **hyper)
    ds.step()
    state = ds.state[ds_param]
    _differ("DeepSpeedCPUAdam", (ds_param.data, state["exp_avg"], state["exp_avg_sq"]), want)
    got = states()
    compiled(*got, grad16, torch.tensor(1.0))
    _differ("torch.compile", got, want)


def _compiled_step(p16: torch.Tensor, m16: torch.Tensor, v16: torch.Tensor, grad16: torch.Tensor,
                   step: torch.Tensor) -> None:
    """The reference's AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, wd 0.01), to the nearest, for torch.compile."""
    g = grad16.float()
    p = p16.float() * (1 - 1e-3 * 0.01)
    m = m16.float() * 0.9 + g * (1 - 0.9)
    v = v16.float() * 0.999 + (g * g) * (1 - 0.999)
    t = torch.sqrt(v) / torch.sqrt(1 - 0.999 ** step) + 1e-8
    p = p - (m / t) * (1e-3 / (1 - 0.9 ** step))
    p16.copy_(p)
    m16.copy_(m)
    v16.copy_(v)


if __name__ == "__main__":
    main()
