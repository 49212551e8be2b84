"""The host's work per decode step: this package against another checkout of it, step by step, one process.

    git worktree add /tmp/before COMMIT
    PYTHONPATH=$PWD python scripts/experiments/host_cost_ab.py OUT --against /tmp/before [--rows 128] [--context 1024]

Why not two runs of host_cost.py: on a shared machine the speed of a core drifts by up to 3x within
minutes (notes/benchmarks_history_2026-11-29_to_2026-12-02.md), more than most changes to the host's work. Here the other checkout's
`minibatch` is copied under another name and imported beside this one; two identical runs (N requests
with a prompt of C tokens, prefilled untimed, then decoding in the decode layout a GPU run builds) take
turns step by step, the order alternating, so a drift slows both alike. Parts timed per step: schedule,
build (build_batch), carry (carry_over_mask), load (IOSlot.load, into plain host tensors: no device
is opened) and update. Prints the median ms per step of each part and of all five, for both, and
writes host_cost_ab.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for host_cost.py

from host_cost import PARTS, host_steps  # noqa: E402


class _HostOnly:
    """Just enough of a device for an IOSlot: host tensors for both sides, no events."""

    def empty(self, shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype)

    def pin(self, tensor):
        return tensor.clone()

    def event(self):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output folder (host_cost_ab.json)")
    p.add_argument("--against", required=True, help="another checkout of the project (its minibatch/ is used)")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of every request")
    p.add_argument("--steps", type=int, default=300, help="timed decode steps per side")
    a = p.parse_args()
    other = Path(a.against) / "minibatch"
    if not (other / "__init__.py").is_file():
        p.error(f"--against {a.against}: no minibatch package there")
    torch.set_num_threads(1)  # the loop's host thread
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(other, Path(tmp) / "minibatch_against", ignore=shutil.ignore_patterns("assets"))
        sys.path.insert(0, tmp)
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        sides = {name: host_steps(pkg, _HostOnly(), a.rows, a.context, a.steps + 10, True, temperature=0.7)
                 for name, pkg in (("this", "minibatch"), ("against", "minibatch_against"))}
        times = {k: [] for k in sides}
        for i in range(a.steps):
            for name in (("this", "against") if i % 2 else ("against", "this")):
                times[name].append(sides[name]())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    print(f"{a.rows} rows, {a.context}-token contexts, {a.steps} steps each; ms per step, median")
    print(f"{'':9}" + "".join(f"{x:>10}" for x in (*PARTS, "total")))
    for name, ts in times.items():
        med = {part: 1e3 * statistics.median(t[k] for t in ts) for k, part in enumerate(PARTS)}
        med["total"] = 1e3 * statistics.median(sum(t) for t in ts)
        results[name] = med
        print(f"{name:9}" + "".join(f"{med[x]:>10.3f}" for x in (*PARTS, "total")))
    print(f"this / against, total: {results['this']['total'] / results['against']['total']:.2f}")
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv])}
    (out / "host_cost_ab.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))


if __name__ == "__main__":
    main()
