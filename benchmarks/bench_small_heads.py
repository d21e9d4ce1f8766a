"""Small batches below a known narrow head: the head's pattern search in ``auto``'s small-b schedule.

Below b = 15, ``auto`` runs the paper's sampler, and on layers whose ReLU feeds a known narrow
layer (a classifier head) also the head's pattern search (:class:`MaskedSubspaceProposer`) at
its steps 3, 7, 15, 31, ... This script draws random settings where that search applies and
attacks each twice, with it and without it (``--ablate`` lists both), and records whether the
batch was verified and exact, the time and the proposals.

Settings: MNIST, Fashion-MNIST (where installed), photos32, digits, UCI Adult (where
installed); the LT paper's shallow zero-bias MLP, a two-layer MLP, an MLP's last hidden layer
(3-4 layers), a CNN head; float32 or float64; trained 0, 100 or 300 steps; b = 2-14;
normalized or raw inputs; m in {128, 200, 300, 500}; a 12 s budget per attack. "exact" is the
layer input within 1e-6 (float64) or 1e-3 (float32) of its largest entry, after matching.

Default (settings 0-59, both variants: about 8 minutes on 2 cores, run with nothing else):
    python benchmarks/bench_small_heads.py
The second run without only the columns that patterns pin (``pin_columns``), not the search:
    python benchmarks/bench_small_heads.py --without pinning --out benchmarks/results/small_heads_pinning.json
"""

from __future__ import annotations

import argparse
import random
import time
from statistics import median

import torch

import spear
from common import machine, relative_error, run_settings, write_json
from spear.core.proposers import MaskedSubspaceProposer, masked_subspace
from spear.data import load_dataset
from spear.errors import InputError
from spear.fl import (
    feature_layer,
    fully_connected,
    layer_inputs,
    pretrain,
    shallow_mlp,
    simulate_fedsgd,
    small_cnn,
)

DATASETS = ["mnist", "fashion-mnist", "photos32", "digits", "adult"]
_loaded: dict = {}


def _dataset(name: str):
    if name not in _loaded:
        try:
            _loaded[name] = load_dataset(name)
        except InputError:  # Fashion-MNIST or Adult not installed here
            _loaded[name] = None
    return _loaded[name]


def setting(index: int) -> dict:
    """Setting ``index``: every choice drawn from a generator seeded by the index alone."""
    r = random.Random(5000 + index)
    name = r.choice(DATASETS)
    images = name not in ("digits", "adult")
    arch = r.choice(["shallow", "mlp2", "mlplast", "cnn"] if images else ["shallow", "mlp2", "mlplast"])
    dtype = r.choice(["float64", "float32"])
    width = r.choice([128, 200, 300, 500])
    steps, b = r.choice([0, 100, 300]), r.randint(2, 14)
    normalize, seed = r.choice([True, False]), r.randrange(100, 10000)
    depth = 2 if arch == "mlp2" else r.choice([3, 4])
    return dict(
        index=index, dataset=name, arch=arch, dtype=dtype, m=width, steps=steps, b=b,
        normalize=normalize, seed=seed, depth=depth if arch in ("mlp2", "mlplast") else None,
    )  # fmt: skip


def _client(cfg: dict, data):
    dtype = getattr(torch, cfg["dtype"])
    seed, width = cfg["seed"], cfg["m"]
    if cfg["arch"] == "cnn":
        model = small_cnn(data.image_shape, hidden=width, classes=data.classes, seed=seed, dtype=dtype)
    elif cfg["arch"] == "shallow":
        model = shallow_mlp(data.features, width, data.classes, seed=seed, dtype=dtype)
    else:
        model = fully_connected(data.features, width, cfg["depth"], data.classes, seed=seed, dtype=dtype)
    if cfg["steps"]:
        pretrain(model, data, cfg["steps"], seed=seed)
    linears = [n for n, mod in model.named_children() if isinstance(mod, torch.nn.Linear)]
    layer = feature_layer(model) if cfg["arch"] == "cnn" else linears[-2]
    view, truth = simulate_fedsgd(model, data, cfg["b"], seed=seed, normalize=cfg["normalize"])
    return view, layer, layer_inputs(view.model, layer, truth.inputs)


def attack(view, layer: str, inputs: torch.Tensor, cfg: dict, budget: float) -> dict:
    start = time.perf_counter()
    try:
        rec = spear.attack_layer(view.model, layer, view.gradients, seed=cfg["seed"], time_budget=budget)
    except spear.SpearError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200], "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    error = relative_error(rec, inputs.to(rec.inputs.dtype)) if rec.inputs is not None else None
    rtol = 1e-6 if cfg["dtype"] == "float64" else 1e-3
    return {
        "verified": rec.verified,
        "exact": error is not None and error <= rtol,
        "relative_error": error,
        "returned": None if rec.inputs is None else rec.inputs.shape[0],
        "missing_samples": rec.missing_samples,
        "seconds": seconds,
        "proposals": rec.stats.proposals,
        "stop_reason": rec.stats.stop_reason,
    }


def _unpinned(U, B, masks, zero_rtol):
    """``pin_columns`` that pins nothing (the ablation ``--without pinning``)."""
    columns, ok = PIN_COLUMNS(U, B, masks, zero_rtol)
    return columns, torch.zeros_like(ok)


PIN_COLUMNS = masked_subspace.pin_columns


def one(index: int, ablate: bool, budget: float, without: str = "search") -> dict | None:
    """Setting ``index`` attacked as it is, and (``ablate``) without the head's pattern search
    (``without="search"``) or without its pattern-pinned columns (``"pinning"``)."""
    cfg = setting(index)
    data = _dataset(cfg["dataset"])
    if data is None:
        return None
    view, layer, inputs = _client(cfg, data)
    cfg["layer"] = layer
    cfg["with_search"] = attack(view, layer, inputs, cfg, budget)
    if ablate:
        owner, name = (
            (MaskedSubspaceProposer, "has_work") if without == "search" else (masked_subspace, "pin_columns")
        )
        original = getattr(owner, name)
        # only auto's small-b turn calls has_work; propose looks pin_columns up in its module
        setattr(owner, name, (lambda self, ctx: False) if without == "search" else _unpinned)
        try:
            cfg[f"without_{without}"] = attack(view, layer, inputs, cfg, budget)
        finally:
            setattr(owner, name, original)
    return cfg


def summary(records: list[dict], variant: str) -> dict:
    runs = [r[variant] for r in records if variant in r]
    ok = [r for r in runs if "error" not in r]
    return {
        "settings": len(runs),
        "verified": sum(r["verified"] for r in ok),
        "verified_and_exact": sum(r["verified"] and r["exact"] for r in ok),
        "verified_not_whole_batch": sum(
            r["verified"] and r["returned"] is not None and bool(r["missing_samples"]) for r in ok
        ),
        "errors": len(runs) - len(ok),
        "median_seconds": median([r["seconds"] for r in ok]) if ok else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--first", type=int, default=0, help="first setting index")
    parser.add_argument("--settings", type=int, default=60, help="how many settings")
    parser.add_argument("--budget", type=float, default=12.0, help="time budget per attack (seconds)")
    parser.add_argument(
        "--no-ablate", dest="ablate", action="store_false", help="skip the run without the search"
    )
    parser.add_argument(
        "--without",
        choices=["search", "pinning"],
        default="search",
        help="what the second run goes without: the head's pattern search, or only its "
        "pattern-pinned columns (README: 'Columns pinned by their pattern')",
    )
    parser.add_argument("--out", default="benchmarks/results/small_heads.json")
    args = parser.parse_args()
    records = []
    for index in range(args.first, args.first + args.settings):
        record = one(index, args.ablate, args.budget, args.without)
        if record is None:
            continue
        records.append(record)
        brief = {k: record[k] for k in ("dataset", "arch", "dtype", "b")}
        print(index, brief, record["with_search"], flush=True)
    payload = {
        "benchmark": "small_heads",
        "settings": run_settings(args),
        "machine": machine(),
        "summary": {v: summary(records, v) for v in ("with_search", f"without_{args.without}")},
        "records": records,
    }
    print(payload["summary"])
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
