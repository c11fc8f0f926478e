"""Item 8: where a checkpoint resumed into another group layout first differs (run from the repo root:
PYTHONPATH=$PWD python bench/results/2026-12-01-issue26-cpu/resume_dbg.py)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from conftest import fixed_batch
import test_zero2 as tz
from fitone.zero2 import layout


def by_name(engine):
    opt = engine.optimizer
    out = {}
    for g, mapping in enumerate(opt._param_slice_mappings):
        flat = opt.single_partition_of_fp32_groups[g]
        st = opt.optimizer.state.get(flat, {})
        for name, frag in mapping.items():
            sl = slice(frag.start, frag.start + frag.numel)
            out[name] = {
                "fp32": flat.data[sl].clone(),
                **{k: st[k][sl].clone() for k in ("exp_avg", "exp_avg_sq") if k in st},
                "step": st.get("step"),
            }
    return out


def run(tmp, tag, groups):
    layout.GROUP_ELEMENTS = groups or 2**27
    e = tz.make_engine()
    e.load(tmp, tag)
    snaps = [by_name(e)]
    norms = []
    for step in range(1, 4):
        loss = e.forward(fixed_batch(100 * step))
        e.backward(loss)
        e.step()
        norms.append(float(e.optimizer._global_grad_norm) if hasattr(e.optimizer, "_global_grad_norm") else None)
        snaps.append(by_name(e))
    e.close()
    return snaps, norms


tmp = "/tmp/issue26-resume-ckpt"
layout.GROUP_ELEMENTS = 2**27
e = tz.make_engine()
tz.train(e, 3)
e.save(tmp, "one", {})
e.close()
same, n1 = run(tmp, "one", None)
across, n2 = run(tmp, "one", tz.SMALL_GROUPS)
print("norms", n1, n2, [a == b for a, b in zip(n1, n2)])
for i, (a, b) in enumerate(zip(same, across)):
    diffs = []
    for name in a:
        for k in ("fp32", "exp_avg", "exp_avg_sq"):
            if k in a[name] and not torch.equal(a[name][k], b[name][k]):
                d = (a[name][k] - b[name][k]).abs()
                diffs.append((name, k, int((d > 0).sum()), float(d.max())))
        if a[name]["step"] != b[name]["step"]:
            diffs.append((name, "step", a[name]["step"], b[name]["step"]))
    print("snapshot", i, "differences:", len(diffs))
    [print("  ", x) for x in diffs[:12]]
