"""Many batches (paper Table 1): resumable JSONL results and mean / 95% CI summaries."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
from scipy import stats

from spear.experiments.report import dumps
from spear.experiments.run import ExperimentSettings, run_experiment

#: the data-level metrics summarized, by modality (whichever the records carry)
SUMMARY_METRICS = ("psnr", "ssim", "mse", "lpips", "categorical_accuracy", "numeric_accuracy")
#: the feature-level metrics of a hidden or CNN feature layer
FEATURE_METRICS = ("feature_cosine", "feature_error")


def load_results(path: Path, settings_key: str | None = None) -> list[dict]:
    """Records of a JSONL file (optionally of one configuration); a torn last line is ignored."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # an interrupted write: that batch is simply run again
        if settings_key is None or rec.get("settings_key") == settings_key:
            records.append(rec)
    return records


def _append_line(path: Path, line: str) -> None:
    """Append one JSON line, first closing a torn last line left by an interrupted write."""
    torn = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with open(path, "a") as fh:
        fh.write(("\n" if torn else "") + line + "\n")
        fh.flush()


def run_batches(
    base: ExperimentSettings,
    batches: int,
    path: Path,
    on_result: Callable[[int, dict], None] | None = None,
    progress_factory: Callable[[int], Callable | None] | None = None,
) -> list[dict]:
    """Run batches ``0..batches-1`` (seed = base.seed + i), appending each result to ``path`` as
    soon as it is done; batches already in the file (same configuration, same seed) are
    skipped, so an interrupted run resumes where it stopped. A batch is its seed: one file can
    hold runs from several ``--seed`` values (review 46: batch 0 of ``--seed 100`` was taken
    for batch 0 of an earlier ``--seed 0``, and the old numbers came back as the new ones)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    seeds = [base.seed + i for i in range(batches)]
    done = {_seed_of(rec) for rec in load_results(path, base.key())}
    for i, seed in enumerate(seeds):
        if seed in done:
            continue
        settings = dataclasses.replace(base, seed=seed)
        result = run_experiment(settings, progress_factory(i) if progress_factory else None)
        record = {"batch_index": i, **result.record}
        _append_line(path, dumps(record))
        if on_result:
            on_result(i, record)
        done.add(seed)
    first: dict[int, dict] = {}
    for rec in load_results(path, base.key()):
        first.setdefault(_seed_of(rec), rec)  # one record per batch, even if a file repeats one
    return [first[seed] for seed in seeds if seed in first]


def _seed_of(record: dict) -> int | None:
    """The seed a record's batch was drawn with."""
    settings = record.get("settings")
    return settings.get("seed") if isinstance(settings, dict) else None


def _mean_ci(values: list[float]) -> dict[str, float | None]:
    arr = np.array(
        [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))], dtype=float
    )
    arr = arr[np.isfinite(arr)]
    if arr.size == 0:
        return {"mean": None, "ci95": None, "n": 0}
    mean = float(arr.mean())
    if arr.size < 2:
        return {"mean": mean, "ci95": None, "n": int(arr.size)}
    half = float(stats.t.ppf(0.975, arr.size - 1) * arr.std(ddof=1) / math.sqrt(arr.size))
    return {"mean": mean, "ci95": half, "n": int(arr.size)}


def summarize(records: list[dict]) -> dict:
    """Paper Table 1: mean and 95% t-interval of each metric; accuracy = fraction of exactly
    recovered batches with its 95% Clopper-Pearson interval."""
    out: dict = {"batches": len(records)}
    for name in SUMMARY_METRICS:
        if any(name in r["metrics"] for r in records):
            out[name] = _mean_ci([r["metrics"].get(name) for r in records])
    for name in FEATURE_METRICS:
        if any(r.get("features") for r in records):
            out[name] = _mean_ci([(r.get("features") or {}).get("metrics", {}).get(name) for r in records])
    exact = sum(1 for r in records if r["metrics"].get("accuracy") == 1.0)
    if records:
        ci = stats.binomtest(exact, len(records)).proportion_ci(0.95, method="exact")
        out["accuracy"] = {"mean": exact / len(records), "low": ci.low, "high": ci.high, "n": len(records)}
    out["label_accuracy"] = _mean_ci([r["metrics"].get("label_accuracy") for r in records])
    out["verified"] = sum(1 for r in records if r.get("verified"))
    out["data_verified"] = sum(1 for r in records if r.get("data_verified", r.get("verified")))
    out["seconds"] = _mean_ci([r["stats"]["seconds"] for r in records])
    out["proposals"] = _mean_ci([r["stats"]["proposals"] for r in records])
    return out
