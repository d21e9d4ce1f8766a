"""Time budgets on a loaded machine: how far past its budget an attack ends, with torch's
threads spinning and on the one thread spear-fl switches to (``spear.api.budget_threads``).

A machine running more threads than it has cores slows torch's OpenMP threads far beyond
their share: they spin while they wait for each other. This script loads the machine with
``--load`` processes multiplying matrices (numpy), waits until the 1-minute load average
exceeds the cores (what spear-fl looks at), and attacks the head of ``spear.fl.small_cnn``
(float32, trained, MNIST) with each time budget, both ways:
- ``one thread``: spear-fl's default there;
- ``spinning``: the switch off (the code before it), torch's threads as the user set them.

Before loading, it also runs the same attack with a proposal budget on 2 threads and on one,
idle, and records how far apart their results are (the last bits: thread counts change the
order of some sums).

Default (about 6 minutes on 2 cores, most of it waiting for the load average):
    python benchmarks/bench_loaded.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

import spear
import spear.api
from common import machine, run_settings, write_json
from spear.data import load_dataset
from spear.fl import feature_layer, pretrain, simulate_fedsgd, small_cnn

_LOAD = "import numpy as np\na = np.random.rand(400, 400)\nwhile True:\n    a = a @ a\n    a /= a.max()\n"


def client_round(dataset: str, b: int, steps: int, seed: int):
    """The float32 CNN head's FedSGD round: (model, layer, gradients)."""
    data = load_dataset(dataset)
    model = small_cnn(data.image_shape, hidden=500, classes=data.classes, seed=seed, dtype=torch.float32)
    pretrain(model, data, steps, seed=seed)
    view, _ = simulate_fedsgd(model, data, b, seed=seed)
    return view.model, feature_layer(model), view.gradients


def thread_counts(model, layer, gradients, seed: int, proposals: int) -> dict:
    """The same work budget on torch's threads and on one, idle: how far apart the results are."""
    threads = torch.get_num_threads()
    runs = {}
    for count in (threads, 1):
        torch.set_num_threads(count)
        rec = spear.attack_layer(model, layer, gradients, seed=seed, max_proposals=proposals)
        runs[count] = rec
    torch.set_num_threads(threads)
    many, one = runs[threads], runs[1]
    a, b = many.certified_inputs, one.certified_inputs
    same_shape = a is not None and b is not None and a.shape == b.shape
    return {
        "threads": threads,
        "proposals": [many.stats.proposals, one.stats.proposals],
        "certified": [many.stats.certified, one.stats.certified],
        "verified": [many.verified, one.verified],
        "max_abs_difference": float((a.double() - b.double()).abs().max()) if same_shape else None,
        "largest_entry": float(a.double().abs().max()) if a is not None else None,
    }


def start_load(processes: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", _LOAD]) for _ in range(processes)]


def wait_for_load(cores: int, limit: float) -> float:
    """Wait (up to ``limit`` seconds) until the 1-minute load average exceeds the cores."""
    start = time.perf_counter()
    while os.getloadavg()[0] < cores + 1 and time.perf_counter() - start < limit:
        time.sleep(2)
    return os.getloadavg()[0]


def budget_run(model, layer, gradients, seed: int, budget: float, mode: str) -> dict:
    switch = spear.api._oversubscribed
    if mode == "spinning":
        spear.api._oversubscribed = lambda: None
    try:
        load = os.getloadavg()[0]
        start = time.perf_counter()
        rec = spear.attack_layer(model, layer, gradients, seed=seed, time_budget=budget)
        seconds = time.perf_counter() - start
    finally:
        spear.api._oversubscribed = switch
    return {
        "mode": mode,
        "budget": budget,
        "seconds": seconds,
        "overrun": seconds - budget,
        "proposals": rec.stats.proposals,
        "certified": rec.stats.certified,
        "load": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--b", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=4)
    parser.add_argument("--budgets", type=float, nargs="+", default=[2.0, 5.0, 10.0, 15.0])
    parser.add_argument("--load", type=int, default=6, help="processes loading the machine")
    parser.add_argument("--proposals", type=int, default=2000, help="the idle thread-count check's budget")
    parser.add_argument("--out", default="benchmarks/results/loaded.json")
    args = parser.parse_args()
    model, layer, gradients = client_round(args.dataset, args.b, args.steps, args.seed)
    idle = thread_counts(model, layer, gradients, args.seed, args.proposals)
    print("idle, threads vs one:", idle, flush=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = start_load(args.load)
    runs = []
    try:
        print(f"load average {wait_for_load(cores, 120.0):.1f} on {cores} cores", flush=True)
        for budget in args.budgets:
            for mode in ("one thread", "spinning"):
                run = budget_run(model, layer, gradients, args.seed, budget, mode)
                runs.append(run)
                print(
                    f"{mode:10s} budget {budget:5.1f} s  ended {run['seconds']:6.2f} s  "
                    f"({run['overrun']:+.2f})  load {run['load']:.1f}",
                    flush=True,
                )
    finally:
        for process in load:
            process.kill()
    payload = {"benchmark": "time budgets on a loaded machine", "settings": run_settings(args)}
    payload.update({"machine": machine(), "cores": cores, "idle_thread_counts": idle, "runs": runs})
    print("wrote", write_json(args.out, payload))


if __name__ == "__main__":
    main()
