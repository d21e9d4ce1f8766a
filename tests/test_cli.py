"""The `spear` command through typer's runner, on tiny settings."""

import json
import os

import pytest
from typer.testing import CliRunner

from spear.cli import app

runner = CliRunner()
TINY = ["--batch-size", "5", "--width", "60", "--depth", "3"]


def test_attack_json_end_to_end_exact(tmp_path):
    result = runner.invoke(app, ["attack", *TINY, "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout[result.stdout.index("{") :])
    assert payload["verified"] is True and payload["metrics"]["accuracy"] == 1.0
    # every sample certified through the model, with its label
    assert payload["verified_by"] == "model" and payload["metrics"]["label_accuracy"] == 1.0
    assert len(payload["labels"]) == 5 and payload["reduction"] == "mean"
    for key in ("psnr", "ssim", "mse", "lpips"):
        assert key in payload["metrics"]
    assert payload["metrics"]["psnr"] > 150 and payload["metrics"]["ssim"] > 0.9999
    assert payload["stats"]["proposals"] > 0 and payload["stats"]["seconds"] >= 0
    assert payload["settings"]["batch_size"] == 5 and "torch" in payload["versions"]
    assert {p.name for p in tmp_path.iterdir()} == {"result.json", "grid.png", "per_sample.csv"}
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["verified"] is True
    rows = (tmp_path / "per_sample.csv").read_text().splitlines()
    assert rows[0].startswith("sample,") and len(rows) == 6


def test_attack_table_output():
    result = runner.invoke(app, ["attack", *TINY, "--dataset", "digits"])
    assert result.exit_code == 0, result.output
    assert "exact batch" in result.output and "verified" in result.output
    assert "label accuracy" in result.output and "by the model" in result.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["attack", "--dataset", "cifar-100"], "unknown data set"),
        (["attack", "--batch-size", "300"], "SPEAR needs b < 200"),
        (["attack", "--layer", "1"], "cannot be attacked: choose a Linear layer"),
        (["attack", "--layer", "10", "-b", "12"], "rank <= 10"),
        (["attack", "--model", "resnet"], "unknown --model"),
        (["attack", "--dataset", "adult", "--model", "cnn"], "needs image data"),
        (["attack", "--layer", "2", "--protocol", "fedavg"], "hidden layer"),
        (["attack", "--model", "cnn", "--protocol", "fedavg", "-b", "4"], "replay certificate"),
        (["attack", "--depth", "1"], "--depth must be >= 2"),
        (["theory", "--batch-size", "30", "--width", "20"], "below the layer width"),
        (["evaluate", "--batches", "0"], "--batches must be >= 1"),
        (["attack", "--proposer", "magic"], "unknown proposer"),
        (["cascade", "-b", "4", "--width", "30", "--depth", "3", "--device", "gpu"], "unknown device"),
        # review 26: tracebacks from torch and the standard library
        (["attack", "--device", "meta"], "unknown device 'meta'"),
        (["attack", "--seed", str(2**64)], "--seed must be at most"),
        (["evaluate", "--batches", "2", "--seed", str(2**63 - 1)], "--seed + --batches - 1"),
    ],
)
def test_bad_arguments_exit_with_one_line(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_theory_command():
    result = runner.invoke(app, ["theory", "--batch-size", "16", "--width", "400", "--json"])
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["tau"] == pytest.approx(0.395)
    assert data["expected_proposals"] == pytest.approx(1.8e5, rel=0.02)
    table = runner.invoke(app, ["theory"])
    assert "Lemma 5.2" in table.output


def test_evaluate_resumes(tmp_path, monkeypatch):
    path = tmp_path / "runs.jsonl"
    first = runner.invoke(app, ["evaluate", "--batches", "2", "--results", str(path), *TINY, "--json"])
    assert first.exit_code == 0, first.output
    assert len(path.read_text().splitlines()) == 2
    # a torn line from an interrupted write is ignored and that batch re-run
    with open(path, "a") as fh:
        fh.write('{"batch_index": 2, "sett')
    import spear.experiments.sweep as sweep

    calls = []
    original = sweep.run_experiment

    def counting(settings, progress=None):
        calls.append(settings.seed)
        return original(settings, progress)

    monkeypatch.setattr(sweep, "run_experiment", counting)
    second = runner.invoke(app, ["evaluate", "--batches", "3", "--results", str(path), *TINY, "--json"])
    assert second.exit_code == 0, second.output
    assert calls == [2]  # only the missing batch ran
    summary = json.loads(second.stdout[second.stdout.index("{") :])
    assert summary["batches"] == 3 and summary["accuracy"]["mean"] == 1.0
    assert summary["psnr"]["mean"] > 150 and summary["psnr"]["ci95"] is not None
    assert summary["label_accuracy"]["mean"] == 1.0 and summary["verified"] == 3
    # review 46: another --seed in the same file reused its batches 0 and 1 as seeds 100 and 101
    calls.clear()
    other = ["evaluate", "--seed", "1", "--batches", "4", "--results", str(path), *TINY, "--json"]
    third = runner.invoke(app, other)
    assert third.exit_code == 0, third.output
    assert calls == [3, 4]  # seeds 1 and 2 are in the file already, 3 and 4 are not
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    assert sorted(rec["settings"]["seed"] for rec in lines) == [0, 1, 2, 3, 4]
    assert json.loads(third.stdout[third.stdout.index("{") :])["batches"] == 4


def test_datasets_command():
    result = runner.invoke(app, ["datasets"])
    assert result.exit_code == 0 and "mnist" in result.output


def test_attack_with_each_proposer():
    for proposer in ("sampling", "irls", "auto"):
        result = runner.invoke(app, ["attack", *TINY, "--proposer", proposer, "--json"])
        assert result.exit_code == 0, result.output
        payload = json.loads(result.stdout[result.stdout.index("{") :])
        assert payload["verified"] is True and payload["stats"]["proposer"] == proposer
        assert payload["settings"]["proposer"] == proposer


def test_attack_reports_samples_certified_before_the_batch_is_complete():
    # the budget ends long before all 100 directions are found; the peeled ones are still exact
    args = ["attack", "--batch-size", "100", "--width", "500", "--depth", "3", "--seed", "1"]
    result = runner.invoke(app, [*args, "--max-proposals", "300", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout[result.stdout.index("{") :])
    assert payload["verified"] is False and payload["metrics"]["accuracy"] == 0.0
    assert 0 < payload["stats"]["certified"] < 100
    assert payload["exact_samples"] == payload["stats"]["certified"]


def test_compare_json_every_method_on_one_batch(tmp_path):
    args = ["compare", "--methods", "spear,geiping,dlg,cpa", "-b", "3", "--width", "60", "--depth", "3"]
    result = runner.invoke(app, [*args, "--iterations", "10", "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout[result.stdout.index("[") :])
    assert [r["method"] for r in records] == ["spear", "geiping", "dlg", "cpa"]
    spear_record = records[0]
    assert spear_record["verified"] is True and spear_record["metrics"]["accuracy"] == 1.0
    for r in records:
        assert {"psnr", "ssim", "lpips", "mse", "accuracy"} <= set(r["metrics"]) and r["seconds"] >= 0
        assert r["batch_size"] == 3 and r["settings"]["seed"] == 0
    assert all(not r["verified"] for r in records[1:])
    assert records[1]["method_settings"]["iterations"] == 10
    assert {p.name for p in tmp_path.iterdir()} == {"comparison.json", "grid.png"}


def test_compare_refuses_unknown_methods_and_protocols():
    result = runner.invoke(app, ["compare", "--methods", "spear,magic"])
    assert result.exit_code == 2 and "unknown method" in result.output
    args = ["compare", "--labels", "psychic", "-b", "2", "--width", "30", "--depth", "2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "labels must be one of" in result.output


def test_vulnerability_json_ranks_samples_by_every_proxy():
    args = ["vulnerability", "-b", "3", "--width", "20", "--depth", "2", "--dataset", "digits", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout[result.stdout.index("{") :])
    assert len(payload["samples"]) == 3
    for name in ("grad_norm", "lavp_l2_max", "lavp_l2_min", "lavp_cos_max", "lavp_cos_min", "i2f"):
        assert sorted(payload["ranking"][name]) == [0, 1, 2]
        assert all(s[name] > 0 for s in payload["samples"])
    result = runner.invoke(app, ["vulnerability", "--proxies", "lavp_l2_max,nope"])
    assert result.exit_code == 2 and "unknown prox" in result.output


def test_vulnerability_evaluate_correlates_with_attacks():
    args = ["vulnerability", "-b", "4", "--width", "20", "--depth", "2", "--dataset", "digits"]
    proxies = ["--proxies", "grad_norm,lavp_cos_max"]
    result = runner.invoke(app, [*args, *proxies, "--evaluate", "--iterations", "5"])
    assert result.exit_code == 0, result.output
    assert "rho(grad_norm, dlg psnr)" in result.output and "rho(lavp_cos_max, geiping psnr)" in result.output
    assert "rho(lavp_cos_max, dlg" not in result.output and "certified_order" in result.output


def test_vulnerability_evaluate_needs_images():
    args = ["vulnerability", "-b", "3", "--width", "20", "--depth", "2", "--dataset", "adult", "--evaluate"]
    result = runner.invoke(app, args)
    if "not found" in result.output or "install" in result.output:
        pytest.skip("UCI Adult is not installed here")
    assert result.exit_code == 2 and "need image data" in result.output


def test_compare_keeps_the_other_methods_when_spear_fails(monkeypatch):
    import spear.baselines
    from spear.errors import NoSparsityError
    from spear.experiments import ExperimentSettings
    from spear.experiments.compare import run_comparison

    class Failing(spear.baselines.SpearAttack):
        def run(self, target):
            raise NoSparsityError("dL/dZ is dense")

    monkeypatch.setitem(spear.baselines.ATTACKS, "spear", Failing)
    settings = ExperimentSettings(dataset="digits", batch_size=3, width=20, depth=3)
    result = run_comparison(settings, ["spear", "cpa"])
    spear_record, cpa_record = result.records
    assert spear_record["metrics"]["accuracy"] == 0.0 and not spear_record["verified"]
    assert "NoSparsityError: dL/dZ is dense" in spear_record["notes"][0]
    assert cpa_record["method"] == "cpa" and cpa_record["metrics"]["psnr"] == cpa_record["metrics"]["psnr"]
    args = ["compare", "--methods", "cpa,cpa", "-b", "2", "--width", "30", "--depth", "2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "each method once" in result.output


def test_evaluate_inputs_ignores_certified_hidden_features():
    """A hidden-layer attack that certified some features but no batch: no crash, NaN metrics."""
    from types import SimpleNamespace

    import torch

    from spear.data import load_dataset
    from spear.experiments.evaluation import evaluate_inputs
    from spear.fl import ClientBatch

    digits = load_dataset("digits")
    images = digits.images[:2]
    secret = ClientBatch(images, digits.normalize(images), digits.labels[:2])
    partial = SimpleNamespace(inputs=None, certified_inputs=torch.rand(1, 20, dtype=torch.float64))
    record = evaluate_inputs(digits, None, None, secret, 1e-6, partial).record
    assert record["exact_samples"] == 0 and record["metrics"]["accuracy"] == 0.0


def test_vulnerability_unwritable_out_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    args = ["vulnerability", "-b", "2", "--width", "20", "--depth", "2", "--dataset", "digits"]
    result = runner.invoke(app, [*args, "--proxies", "grad_norm", "--out", str(blocker / "x")])
    assert result.exit_code == 2 and "cannot write" in result.output  # before the run (review 26)


def test_cascade_json_recovers_the_batch_exactly():
    result = runner.invoke(app, ["cascade", "--batch-size", "12", "--width", "60", "--depth", "4", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout[result.stdout.index("{") :])
    cascade = payload["cascade"]
    assert cascade["complete"] is True and cascade["found"] == 12 and cascade["missing"] == 0
    assert payload["exact_samples"] == 12 and payload["metrics"]["label_accuracy"] == 1.0
    assert cascade["steps"] and {s["layer"] for s in cascade["steps"]} <= {"0", "2", "4"}


def test_cascade_table_output_and_bad_layers():
    result = runner.invoke(app, ["cascade", "--batch-size", "8", "--width", "60", "--depth", "3"])
    assert result.exit_code == 0, result.output
    assert "8 of 8 samples found (8 exact), complete" in result.output
    bad = runner.invoke(app, ["cascade", "--batch-size", "8", "--width", "60", "--layers", "0,9"])
    assert bad.exit_code == 2 and "cannot be used by the cascade" in bad.output
    rounds = runner.invoke(app, ["cascade", "--batch-size", "8", "--width", "60", "--rounds", "0"])
    assert rounds.exit_code == 2 and "--rounds must be >= 1" in rounds.output


def test_precision_rows_summarize_the_estimates_and_count_those_without():
    from spear.cli import _precision_summary

    assert _precision_summary(None) is None and _precision_summary([]) is None
    assert _precision_summary([3e-9, 1e-12, 4e-5]) == "median 3.0e-09, worst 4.0e-05"
    mixed = _precision_summary([2e-10, float("nan"), None, 5e-11])
    assert mixed == "median 2.0e-10, worst 2.0e-10; 2 solved one by one, not estimated"
    assert _precision_summary([float("nan")] * 3) == "not estimated (3 solved one by one)"


def test_output_paths_that_cannot_be_written_fail_before_the_attack(tmp_path, monkeypatch):
    """Review 26: ``attack --out FILE`` ran the whole attack and then raised FileExistsError (the
    result lost); ``evaluate --results DIR`` raised IsADirectoryError. Checked first now."""
    import spear.experiments

    def never(*args, **kwargs):
        raise AssertionError("the attack ran although its output could not be written")

    monkeypatch.setattr(spear.experiments, "run_experiment", never)
    monkeypatch.setattr(spear.experiments, "run_batches", never)
    taken = tmp_path / "a_file"
    taken.write_text("")
    proc = os.path.isdir("/proc/self")  # Linux: root may not create files there
    pipe = tmp_path / "fifo" if hasattr(os, "mkfifo") else None  # opening it for writing blocked
    if pipe:
        os.mkfifo(pipe)
    blocked = tmp_path / "out"
    (blocked / "result.json").mkdir(parents=True)
    for args, message in (
        (["attack", *TINY, "--out", str(taken)], "exists and is not a directory"),
        (["evaluate", *TINY, "--batches", "1", "--results", str(tmp_path)], "exists and is not a file"),
        (["attack", *TINY, "--out", str(taken / "below")], "cannot write --out"),
        # review 45: checked with os.access, which says yes to root and /proc, and never looked
        # at the files written inside --out (a result.json that is a directory)
        (["attack", *TINY, "--out", str(blocked)], "result.json is a directory"),
        (
            ["evaluate", *TINY, "--batches", "1", "--results", str(taken / "r.jsonl")],
            "cannot write --results",
        ),
        *([(["attack", *TINY, "--out", "/proc/spear-out"], "cannot write --out")] if proc else []),
        *([(["evaluate", *TINY, "--results", str(pipe)], "is not a regular file")] if pipe else []),
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split())  # rich wraps long paths
        assert message in text and "Traceback" not in text
    # review 45b: a dangling symlink lost its link and got an empty file at its target
    link, target = tmp_path / "link.jsonl", tmp_path / "elsewhere" / "r.jsonl"
    target.parent.mkdir()
    link.symlink_to(target)
    from spear.cli import _check_results_file

    _check_results_file(link)
    assert link.is_symlink() and not target.exists()


def test_a_run_that_fails_after_the_output_check_leaves_no_directories(tmp_path, monkeypatch):
    """The output check creates ``--out`` and its parents to try them for real; a run that
    failed later left them behind, empty (the roadmap of session 45). They are removed again
    by the check; writing the results creates them."""
    import spear.experiments
    from spear.errors import SpearError

    def fails(*args, **kwargs):
        raise SpearError("the attack failed")

    monkeypatch.setattr(spear.experiments, "run_experiment", fails)
    out = tmp_path / "new" / "deeper" / "out"
    result = runner.invoke(app, ["attack", *TINY, "--out", str(out)])
    assert result.exit_code == 2 and "the attack failed" in result.output
    assert not (tmp_path / "new").exists()
    results = tmp_path / "fresh" / "r.jsonl"
    monkeypatch.setattr(spear.experiments, "run_batches", fails)
    result = runner.invoke(app, ["evaluate", *TINY, "--batches", "1", "--results", str(results)])
    assert result.exit_code == 2 and not (tmp_path / "fresh").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    result = runner.invoke(app, ["attack", *TINY, "--out", str(kept)])
    assert result.exit_code == 2 and kept.is_dir()  # an existing directory stays


def test_errors_known_from_the_arguments_come_before_the_work(monkeypatch):
    """Review 46: vulnerability --evaluate on tabular data and --iterations 0 failed only after
    every sample's proxies (~3 s a sample); CNN + DP-SGD failed after the Opacus client ran,
    naming an option the user never gave (sample_weights)."""
    import spear.experiments.vulnerability as vulnerability

    def never(*args, **kwargs):
        raise AssertionError("the work ran before the arguments were refused")

    monkeypatch.setattr(vulnerability.ClientCase, "proxies", never)
    args = ["vulnerability", "-b", "2", "--width", "20", "--depth", "2", "--evaluate"]
    tabular = runner.invoke(app, [*args, "-d", "adult"])
    assert tabular.exit_code == 2 and "need image data" in tabular.output
    zero = runner.invoke(app, [*args, "--iterations", "0"])
    assert zero.exit_code == 2 and "--iterations must be >= 1" in zero.output
    import spear.experiments.run as run

    monkeypatch.setattr(run, "simulate_round", never)
    dp = runner.invoke(app, ["attack", "-b", "2", "--model", "cnn", "--protocol", "dpsgd"])
    text = " ".join(dp.output.split())
    assert dp.exit_code == 2 and "--protocol dpsgd is attacked through the layer that takes the data" in text
    assert "sample_weights" not in text


def test_theory_beyond_float_range_reads_infinite():
    result = runner.invoke(app, ["theory", "--batch-size", "1100", "--width", "1200", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["expected_proposals"] == float("inf")
    import warnings

    with warnings.catch_warnings():  # review 45: numpy's overflow warnings printed above the table
        warnings.simplefilter("error", RuntimeWarning)
        huge = runner.invoke(app, ["theory", "--batch-size", "100000", "--width", "1000000", "--json"])
    assert huge.exit_code == 0, huge.output
