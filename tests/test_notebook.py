"""examples/quickstart.ipynb run the way a user runs it: a real Jupyter kernel (ipykernel, started by
nbclient) on the CPU, every cell in order; then its training cell run again in the same kernel."""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "examples" / "quickstart.ipynb"
# Host RSS may grow this much from one training of the 1M-parameter T5 to the next in one kernel: allocator
# caches and imports settle after the first run; a leaked engine, model or optimizer state would repeat.
RERUN_RSS_BOUND = 100 * 2**20
TRAIN_LINE = re.compile(r"TrainResult\(\d+ steps, loss [\d.]+ -> [\d.]+, [\d.]+ samples/s")


class Kernel:
    """A live kernel that has run the notebook; `run(code)` executes one more cell and returns its text."""

    def __init__(self, client: NotebookClient, nb):
        self.client, self.nb = client, nb

    def run(self, source: str) -> str:
        cell = new_code_cell(source)
        self.nb.cells.append(cell)
        self.client.execute_cell(cell, len(self.nb.cells) - 1)
        return _text(cell)


def _text(cell) -> str:
    """What a cell printed to stdout and its results' text (warnings on stderr left out)."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream" and out.name == "stdout":
            parts.append(out.text)
        elif "data" in out:
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    work = tmp_path_factory.mktemp("notebook")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(work)}})
    with pytest.MonkeyPatch.context() as env:  # the kernel's environment, as a fresh Jupyter would give it
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
            env.delenv(name, raising=False)  # this process's (test) distributed settings are not the kernel's
        env.setenv("FITONE_CACHE_DIR", str(work / "cache"))  # a fresh probe, and none saved in ~/.cache
        # one thread: on a shared 2-core machine OpenMP threads spinning against other work made a 20-step
        # run of this tiny model take 104 s instead of 4 s
        env.setenv("OMP_NUM_THREADS", "1")
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        session = client.setup_kernel()
        session.__enter__()
    try:
        for index, cell in enumerate(list(nb.cells)):
            client.execute_cell(cell, index)
        yield Kernel(client, nb)
    finally:
        session.__exit__(None, None, None)


def test_quickstart_runs_in_a_kernel_and_prints_the_train_result(kernel):
    cells = {tuple(c.metadata.get("tags", [])): c for c in kernel.nb.cells if c.cell_type == "code"}
    train_cell = cells[("train",)]
    assert TRAIN_LINE.search(_text(train_cell)), _text(train_cell)
    everything = "\n".join(_text(c) for c in kernel.nb.cells if c.cell_type == "code")
    assert "ProbeResult(" in everything and "verdict:" in everything
    images = [o for c in kernel.nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # the plan's bars, the loss curve, the report's throughput
    assert (Path(kernel.client.resources["metadata"]["path"]) / "runs/quickstart/report/loss.png").is_file()


def test_the_notebook_shows_no_third_party_noise(kernel):
    """DeepSpeed's op check (the linker's "cannot find -laio" on descriptor 2), its accelerator warning,
    tqdm's ipywidgets warning and transformers' save bar: none of them asks anything of the user."""
    streams = "".join(o.text for c in kernel.nb.cells for o in c.get("outputs", []) if o.output_type == "stream")
    for noise in ("IProgress", "cannot find -laio", "collect2", "[WARNING]", "Writing model shards"):
        assert noise not in streams, noise


def test_rerunning_the_training_cell_in_the_same_kernel_works_and_frees_memory(kernel):
    rss = "import psutil; print(psutil.Process().memory_info().rss)"
    after_first = int(kernel.run(rss))
    train_source = next(c.source for c in kernel.nb.cells if "train" in c.metadata.get("tags", []))
    assert TRAIN_LINE.search(kernel.run(train_source))
    after_second = int(kernel.run(rss))
    assert after_second - after_first < RERUN_RSS_BOUND, (after_first, after_second)
    # torn down: no engine is reachable from the kernel (`result`, `probe`, IPython's history) any more
    engines = kernel.run("import gc, deepspeed\ngc.collect()\n"
                         "print(sum(isinstance(o, deepspeed.DeepSpeedEngine) for o in gc.get_objects()))")
    assert engines.strip() == "0"


def test_the_repository_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
