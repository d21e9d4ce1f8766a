"""The same attacks on the CPU and on a GPU (``device="cuda"``): exactness, proposals, seconds.

Each cell is one of bench_realism.py's (``setting:dtype:train_steps:m:b``, seed 0 unless
``--seeds``), attacked with ``spear.attack_layer`` on each device in turn. Before the timed
cells, each device runs one small warm-up attack (CUDA's libraries load on first use); its
time is recorded apart.

Default (a GPU machine; about two minutes):
    python benchmarks/bench_device.py --devices cpu cuda
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench_realism import DTYPES, SETTINGS, one
from common import machine, run_settings, write_json
from spear.data import load_dataset

DEFAULT_CELLS = [
    "mlp:float64:0:1000:128",
    "mlp:float32:0:1000:128",
    "hidden:float64:200:1000:64",
    "cnn:float64:0:1000:128",
    "mlp:float64:0:2000:256",
]
WARM_UP = ("mlp", "float64", 0, 256, 16)


def parse_cell(text: str) -> tuple[str, str, int, int, int]:
    parts = text.split(":")
    if len(parts) != 5 or parts[0] not in SETTINGS or parts[1] not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a cell is setting:dtype:train_steps:m:b, e.g. mlp:float64:0:1000:128 "
            f"(settings {sorted(SETTINGS)}, dtypes {sorted(DTYPES)})"
        )
    setting, dtype, steps, m, b = parts
    return setting, dtype, int(steps), int(m), int(b)


def attack(dataset, cell: tuple, seed: int, budget: float, device: str) -> dict:
    setting, dtype, steps, m, b = cell
    run = one(setting, dataset, DTYPES[dtype], steps, m, b, seed, budget, device)
    return {"cell": ":".join(map(str, cell)), "device": device, **run}


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--devices", nargs="+", default=["cpu", "cuda"])
    parser.add_argument("--cells", nargs="+", type=parse_cell, default=[parse_cell(c) for c in DEFAULT_CELLS])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds per attack")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "device.json"))
    args = parser.parse_args()
    if "cuda" in args.devices and not torch.cuda.is_available():
        parser.error("--devices names cuda, but CUDA is not available here")
    dataset = load_dataset("mnist")
    runs, warm_up = [], {}
    for device in args.devices:
        start = time.perf_counter()
        attack(dataset, WARM_UP, 0, args.budget, device)
        warm_up[device] = time.perf_counter() - start
        for cell in args.cells:
            for seed in range(args.seeds):
                run = attack(dataset, cell, seed, args.budget, device)
                runs.append(run)
                print(
                    f"{device:4s} {run['cell']:24s} seed {seed} exact {run['exact']} "
                    f"{run.get('seconds', float('nan')):.1f} s {run.get('proposals')} proposals",
                    flush=True,
                )
    payload = {
        "benchmark": "the same attacks on each device (MNIST, FedSGD, attack_layer defaults)",
        "settings": run_settings(args),
        "machine": machine("cuda" if "cuda" in args.devices else "cpu"),
        "warm_up_seconds": warm_up,
        "runs": runs,
    }
    print("wrote", write_json(args.out, payload))


if __name__ == "__main__":
    main()
