"""Experiments: one attack end to end, many batches with resumable JSONL results, reports."""

from spear.experiments.report import json_safe, save_grid, write_result_dir
from spear.experiments.run import ExperimentResult, ExperimentSettings, run_experiment
from spear.experiments.sweep import load_results, run_batches, summarize

__all__ = [
    "ExperimentResult",
    "ExperimentSettings",
    "json_safe",
    "load_results",
    "run_batches",
    "run_experiment",
    "save_grid",
    "summarize",
    "write_result_dir",
]
