"""Benchmark (issue 23 item 4): plan ResNet-50's top-level blocks for N = 1,024 ranks, B = 1,024.

Costs: ResNet-50 (hpcdl.models, 64x64 inputs, 100 classes) profiled here for one step of
4 samples (pipe_profile.profile_costs), parameters and output bytes from its shapes. A
figure, not a test: it prints the planning time.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from hpcdl.models.resnet import resnet50
from hpcdl.parallel.pipe_planner import CostModel, Network, baselines, plan
from hpcdl.parallel.pipe_profile import layer_infos, profile_costs


def main(ranks: int = 1024, global_batch: int = 1024) -> None:
    rng = np.random.default_rng(0)
    shape, batch = (3, 64, 64), 4
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, 100, batch)
    costs = profile_costs(resnet50(shape, 100, rng=np.random.default_rng(0)), x, y, steps=1)
    layers = layer_infos(resnet50(shape, 100, rng=np.random.default_rng(0)), shape, batch, costs)
    model = CostModel(tuple(layers), batch, Network(5e-6, 1e-10), "1f1b")
    start = time.perf_counter()
    chosen, step = plan(model, ranks, global_batch)
    took = time.perf_counter() - start
    print(f"{len(layers)} layers, N = {ranks}, B = {global_batch}: planned in {took:.2f} s")
    print(f"  plan       {chosen}  predicted {step * 1e3:.2f} ms")
    for name, found in baselines(model, ranks, global_batch).items():
        print(f"  {name:<10} " + ("-" if found is None else f"{found[0]}  predicted {found[1] * 1e3:.2f} ms"))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
