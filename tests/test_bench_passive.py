"""The passive benchmark script (benchmarks/bench_passive.py) at CI size: the seeds it is asked
for, its rate against the ground truth, and a JSON written after every attack."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spear.data import available_datasets

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not available_datasets().get("mnist", False), reason="MNIST not installed")


def run_bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "passive.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_passive.py"), "--datasets", "mnist"]
    subprocess.run([*cmd, *args, "--out", str(out)], check=True, env=env, cwd=ROOT, capture_output=True)
    return json.loads(out.read_text())


def test_bench_passive_runs_the_seeds_asked_and_scores_them(tmp_path):
    # the script takes a time budget per attack; an hour is never reached at b = 8
    seeds = ("--first-seed", "3", "--seeds", "2")
    payload = run_bench(tmp_path, "--batch-sizes", "8", *seeds, "--budget", "3600")
    (cell,) = payload["cells"]
    assert [run["seed"] for run in cell["runs"]] == [3, 4]
    assert cell["b"] == 8 and cell["mean_rate"] == 1.0 and cell["min_rate"] == 1.0
    assert all(run["recovered"] == 8 and run["verified"] for run in cell["runs"])
    assert payload["settings"]["first_seed"] == 3
    assert Path(tmp_path / "passive.png").exists()
