"""The ``spear`` command: thin, it parses, calls the library and prints (rich)."""

from __future__ import annotations

import dataclasses
import json
import sys
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from spear import theory as theory_module
from spear.checks import MAX_SEED
from spear.core.result import ProgressEvent
from spear.errors import SpearError

app = typer.Typer(
    help="spear-fl: exact reconstruction of federated-learning client batches (SPEAR).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DEFAULT_DATASET = "mnist"
DEFAULT_BATCH = 12
DEFAULT_DEPTH = 6


def _fail(message: str) -> None:
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(2)


class _ProgressDisplay:
    """Renders ProgressEvents: proposals drawn, directions found k/b, sigma."""

    def __init__(self, console: Console, label: str = "attack") -> None:
        self.progress = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.task = None

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def __call__(self, event: ProgressEvent) -> None:
        sigma = "-" if event.sigma is None else f"{event.sigma:.4f}"
        info = (
            f"{event.proposals:,} proposals | {event.candidates} candidates | "
            f"directions {event.consistent_directions}/{event.batch_size} | sigma {sigma}"
        )
        if event.certified:
            info += f" | certified samples {event.certified}/{event.batch_size}"
        if self.task is None:
            self.task = self.progress.add_task("attack", total=event.max_proposals, info=info)
        self.progress.update(self.task, completed=event.proposals, info=info)


def _experiment_options(arguments: dict) -> dict:
    """The command's arguments that are experiment settings."""
    from spear.experiments import ExperimentSettings

    names = {f.name for f in dataclasses.fields(ExperimentSettings)}
    return {k: v for k, v in arguments.items() if k in names}


def _settings(**options):
    """Validated experiment settings from the command's options (exits with a clear error)."""
    from spear.core.proposers import PROPOSERS
    from spear.data import DATASETS
    from spear.experiments import ExperimentSettings
    from spear.experiments.run import DTYPES
    from spear.fl import MODELS
    from spear.fl.protocols.fedsgd import AUTOCAST

    dataset, batch_size, width = options["dataset"].lower(), options["batch_size"], options["width"]
    if dataset not in DATASETS:
        _fail(f"unknown data set {dataset!r}; choose one of {', '.join(sorted(DATASETS))}")
    if batch_size < 1:
        _fail("--batch-size must be >= 1")
    if width is not None and width < 2:
        _fail("--width must be >= 2")
    if options["model"] not in MODELS:
        _fail(f"unknown --model {options['model']!r}; choose one of {', '.join(MODELS)}")
    if options["depth"] < 2:
        _fail("--depth must be >= 2")
    if options["proposer"] not in PROPOSERS:
        _fail(f"unknown proposer {options['proposer']!r}; choose one of {', '.join(sorted(PROPOSERS))}")
    dp_given = options.get("dp_noise_multiplier") is not None or options.get("dp_max_grad_norm") is not None
    local = ("local_epochs", "local_batch_size", "local_lr")
    local_given = any(options.get(key) is not None for key in local)
    implied = "dpsgd" if dp_given else "fedavg" if local_given else "fedsgd"
    protocol = options.get("protocol") or implied
    if dp_given and protocol != "dpsgd":
        _fail(f"--dp-noise-multiplier / --dp-max-grad-norm apply to DP-SGD, not --protocol {protocol}")
    if local_given and protocol != "fedavg":
        _fail(f"--local-epochs / --local-batch-size / --local-lr apply to FedAvg, not --protocol {protocol}")
    options["protocol"] = protocol
    for key, default in (("local_epochs", 1), ("local_lr", 0.1)):
        if options.get(key) is None:
            options[key] = default
    autocast = options.get("autocast")
    realistic = protocol != "fedsgd" or options.get("clients", 1) > 1 or autocast is not None
    options["dtype"] = options.get("dtype") or ("float32" if realistic else "float64")
    if options["dtype"] not in DTYPES:
        _fail(f"unknown --dtype {options['dtype']!r}; choose one of {', '.join(DTYPES)}")
    if autocast is not None and autocast not in AUTOCAST:
        _fail(f"unknown --autocast {autocast!r}; choose one of {', '.join(AUTOCAST)}")
    if autocast is not None and (protocol != "fedsgd" or options["dtype"] != "float32"):
        _fail(
            "--autocast applies to FedSGD clients of a float32 model (autocast leaves float64 alone), "
            f"not --protocol {protocol} --dtype {options['dtype']}"
        )
    for key, default in (("dp_noise_multiplier", 0.0), ("dp_max_grad_norm", 1.0)):
        if options.get(key) is None:
            options[key] = default
    options["dataset"] = dataset
    if options.get("seed", 0) > MAX_SEED:
        _fail(f"--seed must be at most {MAX_SEED} (torch's generators take 64-bit signed seeds)")
    settings = ExperimentSettings(**options)
    try:
        settings.make_protocol().check_batch(batch_size)
    except SpearError as exc:
        _fail(str(exc))
    if options.get("clients", 1) < 1:
        _fail("--clients must be >= 1")
    return settings


def _fmt(value, digits=4) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-3 or abs(value) >= 1e4 else f"{value:.{digits}f}"
    return str(value)


DatasetOpt = Annotated[
    str,
    typer.Option("--dataset", "-d", help="mnist, fashion-mnist, digits, photos32/64/256, adult (tabular)"),
]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", help="client batch size")]
WidthOpt = Annotated[
    int | None, typer.Option(help="hidden width m: the MLP's layers (default 200), the CNN's head (512)")
]
ModelOpt = Annotated[
    str, typer.Option(help="client model: mlp (fully connected ReLU) or cnn (small VGG, trained briefly)")
]
LayerOpt = Annotated[
    str | None,
    typer.Option(
        help="attack this Linear layer (module name, e.g. 2 or 4 of the MLP); default: the first "
        "Linear (the CNN's feature layer). Hidden inputs are taken back to the data"
    ),
]
DepthOpt = Annotated[int, typer.Option(help="number of linear layers")]
SeedOpt = Annotated[int, typer.Option(help="seed of network, batch and attack")]
DeviceOpt = Annotated[str, typer.Option(help="cpu or cuda")]
MaxPropOpt = Annotated[int | None, typer.Option(help="proposal budget N (default: 20x Lemma 5.2)")]
TimeOpt = Annotated[float | None, typer.Option(help="seconds per attack before returning the best result")]
InitOpt = Annotated[str, typer.Option(help="weight init: default, kaiming, xavier, normal")]
PretrainOpt = Annotated[
    int | None,
    typer.Option(help="train the network this many SGD steps first (Fig. 7; default: mlp 0, cnn 300)"),
]
SingleOpt = Annotated[bool, typer.Option(help="all samples of one label (heterogeneous client)")]
PfrOpt = Annotated[float, typer.Option(help="false-rejection rate p_fr (sets tau)")]
ProposerOpt = Annotated[
    str,
    typer.Option(
        help="direction proposer: auto, sampling, irls, guided, neurons, next_layer, subspace, noisy"
    ),
]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        help="client precision: float32 or float64 (default: float32 for fedavg, dpsgd and --clients)"
    ),
]
AutocastOpt = Annotated[
    str | None,
    typer.Option(help="client mixed precision: float16 or bfloat16 (FedSGD under torch.autocast, float32)"),
]
ProtocolOpt = Annotated[
    str | None, typer.Option(help="what the client sends: fedsgd (default), fedavg, dpsgd")
]
EpochsOpt = Annotated[int | None, typer.Option(help="FedAvg: local epochs E (default 1)")]
LocalBatchOpt = Annotated[
    int | None, typer.Option(help="FedAvg: local mini-batch size (default: the whole batch)")
]
LocalLrOpt = Annotated[float | None, typer.Option(help="FedAvg: local SGD learning rate (default 0.1)")]
NoiseOpt = Annotated[
    float | None, typer.Option(help="DP-SGD (Opacus): noise multiplier sigma (0: clipping only)")
]
ClipOpt = Annotated[float | None, typer.Option(help="DP-SGD (Opacus): per-sample clipping norm C")]
ClientsOpt = Annotated[
    int, typer.Option(help="secure aggregation: the server sees the sum of K clients' updates")
]


@app.command()
def attack(
    dataset: DatasetOpt = DEFAULT_DATASET,
    batch_size: BatchOpt = DEFAULT_BATCH,
    width: WidthOpt = None,
    depth: DepthOpt = DEFAULT_DEPTH,
    seed: SeedOpt = 0,
    device: DeviceOpt = "cpu",
    max_proposals: MaxPropOpt = None,
    time_budget: TimeOpt = None,
    init: InitOpt = "default",
    pretrain_steps: PretrainOpt = None,
    single_label: SingleOpt = False,
    p_fr: PfrOpt = 1e-5,
    proposer: ProposerOpt = "auto",
    dtype: DtypeOpt = None,
    autocast: AutocastOpt = None,
    protocol: ProtocolOpt = None,
    local_epochs: EpochsOpt = None,
    local_batch_size: LocalBatchOpt = None,
    local_lr: LocalLrOpt = None,
    dp_noise_multiplier: NoiseOpt = None,
    dp_max_grad_norm: ClipOpt = None,
    clients: ClientsOpt = 1,
    model: ModelOpt = "mlp",
    layer: LayerOpt = None,
    out: Annotated[Path | None, typer.Option(help="write result.json, grid.png, per_sample.csv here")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="print the result as JSON on stdout")] = False,
) -> None:
    """Simulate a FedSGD client on real data, reconstruct its batch from the server's view, and
    report the field's metrics. With no options: MNIST, b=12, 6 x 200 ReLU network."""
    from spear.experiments import run_experiment, write_result_dir
    from spear.experiments.report import json_safe

    settings = _settings(**_experiment_options(locals()))
    _check_out_dir(out, ("result.json", "grid.png", "per_sample.csv"))
    console = Console(stderr=json_output)
    try:
        with _ProgressDisplay(console) as display:
            result = run_experiment(settings, progress=display)
    except SpearError as exc:
        _fail(str(exc))
    record = result.record
    if out is not None:
        with _writing_to(out):
            paths = write_result_dir(out, record, result.reconstruction_images, result.true_images)
        console.print(f"wrote {', '.join(str(p) for p in paths)}")
    if json_output:
        sys.stdout.write(json.dumps(json_safe(record), indent=2, allow_nan=False) + "\n")
        return
    shape = f"{settings.depth}x{settings.width}" if settings.model == "mlp" else f"head {settings.width}"
    table = Table(
        title=f"SPEAR on {settings.dataset}, b={settings.batch_size}, {settings.model} {shape}, "
        f"layer {record['layer']}"
    )
    table.add_column("quantity")
    table.add_column("value", justify="right")
    features = record.get("features")
    if features:
        for name, value in features["metrics"].items():
            if name != "accuracy":
                table.add_row(f"{name} (layer inputs)", _fmt(value))
        table.add_row("exact layer inputs", f"{features['exact_samples']}/{settings.batch_size}")
    inversion = record.get("inversion")
    if inversion:
        proven = "verified" if inversion["verified"] else "not verified"
        table.add_row("back to the data", f"by {inversion['method']} ({proven})")
    m = record["metrics"]
    for name, value in m.items():
        if name not in ("accuracy", "label_accuracy"):
            table.add_row(name.upper() if len(name) <= 5 else name, _fmt(value))
    ceiling = record.get("ceiling")
    if ceiling:
        table.add_row("PSNR from the true features", _fmt(ceiling.get("psnr")))
    table.add_row("exact batch", "yes" if m["accuracy"] == 1.0 else "no")
    table.add_row("label accuracy", _fmt(m.get("label_accuracy")))
    verified_by = f" (by the {record['verified_by']})" if record.get("verified_by") else ""
    if features:
        table.add_row("layer inputs verified", f"{record['verified']}{verified_by}")
        table.add_row("data verified", str(record["data_verified"]))
    else:
        table.add_row("verified", f"{record['verified']}{verified_by}")
    table.add_row("sigma", _fmt(record["sigma"], 6))
    table.add_row("residual", f"{record['residual']:.2e}")
    precision = _precision_summary(record.get("input_precision"))
    if precision:
        table.add_row("layer-input precision (estimated)", precision)
    certified_precision = _precision_summary(record.get("certified_precision"))
    if certified_precision and not record["verified"]:
        table.add_row("certified-sample precision (estimated)", certified_precision)
    st = record["stats"]
    table.add_row("proposals", f"{st['proposals']:,}")
    table.add_row("candidates", str(st["candidates"]))
    if st.get("certified"):
        table.add_row("certified samples", f"{st['certified']}/{record['recovered_batch_size']}")
        table.add_row("exact samples", str(record["exact_samples"]))
    table.add_row("seconds", f"{st['seconds']:.2f}")
    console.print(table)
    console.print(record["message"])
    for note in record.get("notes", []):
        console.print(f"note: {note}")


def _precision_summary(values: list | None) -> str | None:
    """Per-sample precision estimates (relative) as "median m, worst w", counting those without
    one (None or NaN: a sample reported as peeled, not as a consistent batch's)."""
    if not values:
        return None
    known = sorted(v for v in values if v is not None and v == v)
    missing = len(values) - len(known)
    if not known:
        return f"not estimated ({missing} solved one by one)"
    summary = f"median {known[len(known) // 2]:.1e}, worst {known[-1]:.1e}"
    return summary + (f"; {missing} solved one by one, not estimated" if missing else "")


@app.command()
def cascade(
    dataset: DatasetOpt = DEFAULT_DATASET,
    batch_size: BatchOpt = DEFAULT_BATCH,
    width: WidthOpt = None,
    depth: DepthOpt = DEFAULT_DEPTH,
    seed: SeedOpt = 0,
    device: DeviceOpt = "cpu",
    max_proposals: Annotated[
        int | None, typer.Option(help="proposal budget of each attack in the first pass (doubles each pass)")
    ] = None,
    time_budget: Annotated[float | None, typer.Option(help="seconds for the whole cascade")] = None,
    attack_budget: Annotated[
        float | None,
        typer.Option(
            help="seconds per attack in the first pass, doubled each pass (default: budget / 2 layers)"
        ),
    ] = None,
    layers: Annotated[
        str | None, typer.Option(help="comma-separated Linear layers in attack order (default: middle first)")
    ] = None,
    rounds: Annotated[int, typer.Option(help="passes over the layers at most")] = 4,
    proposer: ProposerOpt = "auto",
    init: InitOpt = "default",
    pretrain_steps: PretrainOpt = None,
    dtype: DtypeOpt = None,
    autocast: AutocastOpt = None,
    json_output: Annotated[bool, typer.Option("--json", help="print the result as JSON on stdout")] = False,
) -> None:
    """Attack an MLP's layers in turn, taking every certified sample out of every layer's gradient
    before the next attack (spear.cascade.attack_model), and count the exact samples."""
    from spear.experiments.cascade import run_cascade_experiment
    from spear.experiments.report import json_safe

    settings = _settings(model="mlp", **_experiment_options(locals()))
    if rounds < 1:
        _fail("--rounds must be >= 1")
    console = Console(stderr=json_output)

    def show(step) -> None:
        console.print(
            f"layer {step.layer}: +{step.added} samples (b' = {step.remaining}, {step.seconds:.1f} s, "
            f"{step.stop_reason})"
        )

    order = None if layers is None else _split(layers, "layers")
    try:
        record = run_cascade_experiment(settings, order, attack_budget, rounds, progress=show)
    except SpearError as exc:
        _fail(str(exc))
    if json_output:
        sys.stdout.write(json.dumps(json_safe(record), indent=2, allow_nan=False) + "\n")
        return
    summary = record["cascade"]
    console.print(
        f"{summary['found']} of {settings.batch_size} samples found ({record['exact_samples']} exact), "
        f"{'complete' if summary['complete'] else 'not complete'} ({summary['stop_reason']}), "
        f"{record['seconds']:.1f} s"
    )


@app.command()
def evaluate(
    batches: Annotated[int, typer.Option(help="number of batches K")] = 10,
    results: Annotated[Path, typer.Option(help="JSONL file; existing batches are resumed")] = Path(
        "runs/evaluate.jsonl"
    ),
    dataset: DatasetOpt = DEFAULT_DATASET,
    batch_size: BatchOpt = DEFAULT_BATCH,
    width: WidthOpt = None,
    depth: DepthOpt = DEFAULT_DEPTH,
    seed: SeedOpt = 0,
    device: DeviceOpt = "cpu",
    max_proposals: MaxPropOpt = None,
    time_budget: TimeOpt = None,
    init: InitOpt = "default",
    pretrain_steps: PretrainOpt = None,
    single_label: SingleOpt = False,
    p_fr: PfrOpt = 1e-5,
    proposer: ProposerOpt = "auto",
    dtype: DtypeOpt = None,
    autocast: AutocastOpt = None,
    protocol: ProtocolOpt = None,
    local_epochs: EpochsOpt = None,
    local_batch_size: LocalBatchOpt = None,
    local_lr: LocalLrOpt = None,
    dp_noise_multiplier: NoiseOpt = None,
    dp_max_grad_norm: ClipOpt = None,
    clients: ClientsOpt = 1,
    model: ModelOpt = "mlp",
    layer: LayerOpt = None,
    json_output: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
) -> None:
    """Attack K batches (seeds seed..seed+K-1) and report paper Table 1: mean and 95% CI of each
    metric, accuracy = fraction of exactly recovered batches. Each batch is appended to the JSONL
    file when done, so an interrupted run resumes where it stopped."""
    from spear.experiments import run_batches, summarize
    from spear.experiments.report import json_safe

    if batches < 1:
        _fail("--batches must be >= 1")
    if seed + batches - 1 > MAX_SEED:
        _fail(f"--seed + --batches - 1 must be at most {MAX_SEED} (the batches' seeds)")
    _check_results_file(results)
    settings = _settings(**_experiment_options(locals()))
    console = Console(stderr=json_output)

    def report(i: int, record: dict) -> None:
        mark = "exact" if record["metrics"]["accuracy"] == 1.0 else "NOT exact"
        console.print(
            f"batch {i + 1}/{batches}: {mark}, {record['stats']['seconds']:.1f}s, "
            f"{record['stats']['proposals']:,} proposals"
        )

    try:
        records = run_batches(settings, batches, results, on_result=report)
    except SpearError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot write --results {results}: {exc}")
    except KeyboardInterrupt:
        console.print(f"interrupted; finished batches are kept in {results} (rerun to resume)")
        raise typer.Exit(130) from None
    summary = summarize(records)
    if json_output:
        sys.stdout.write(json.dumps(json_safe(summary), indent=2, allow_nan=False) + "\n")
        return
    table = Table(title=f"{len(records)} batches of {settings.dataset}, b={settings.batch_size} ({results})")
    table.add_column("metric")
    table.add_column("mean", justify="right")
    table.add_column("95% CI", justify="right")
    for name, s in summary.items():
        if isinstance(s, dict) and "ci95" in s:
            table.add_row(name, _fmt(s["mean"]), "n/a" if s["ci95"] is None else f"± {_fmt(s['ci95'])}")
    acc = summary["accuracy"]
    table.add_row("accuracy", f"{acc['mean']:.0%}", f"[{acc['low']:.2f}, {acc['high']:.2f}]")
    table.add_row("verified (data)", f"{summary['data_verified']}/{len(records)}", "")
    console.print(table)


def _writable(path: Path, kind: str, option: str, files: tuple[str, ...] = ()) -> None:
    """Before the run: ``path`` can be written as a ``kind`` ("directory", holding ``files``, or
    "file"), tried for real (an attack's result must not be lost to a path that fails only at
    the end). The directory and its missing parents are created, a file or a directory's file is
    opened for appending (an existing one is left as it is), and what was new is removed again:
    a run that fails later leaves nothing behind. ``os.access`` alone said yes to root and to
    /proc, and never looked at the files written inside a directory."""
    if path.exists() and (path.is_dir() != (kind == "directory")):
        _fail(f"{option} {path} exists and is not a {kind}; name a {kind} (new or existing)")
    folder = path if kind == "directory" else path.parent
    created = [d for d in (folder, *folder.parents) if not d.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        targets = [path / name for name in files] if kind == "directory" else [path]
        for target in targets:
            target = target.resolve()  # a symlink's target is what gets written, not the link
            if target.is_dir():
                _fail(
                    f"cannot write {option} {path}: {target} is a directory; remove it or name another {kind}"
                )
            if target.exists() and not target.is_file():  # a pipe or a device would block or take it
                _fail(f"cannot write {option} {path}: {target} is not a regular file")
            new = not target.exists()
            with open(target, "a"):
                pass
            if new:
                target.unlink()
    except OSError as exc:
        _fail(f"cannot write {option} {path}: {exc}")
    finally:
        for directory in created:
            with suppress(OSError):  # one that something else wrote into meanwhile stays
                directory.rmdir()


def _check_out_dir(out: Path | None, files: tuple[str, ...]) -> None:
    if out is not None:
        _writable(out, "directory", "--out", files)


def _check_results_file(results: Path) -> None:
    _writable(results, "file", "--results")


@contextmanager
def _writing_to(out: Path):
    """Create ``out`` and write into it; a path that cannot be written ends with a clear error."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        yield out
    except OSError as exc:
        _fail(f"cannot write the results to {out}: {exc}")


def _split(value: str, what: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        _fail(f"--{what} names nothing; give a comma-separated list")
    return names


def _baseline_options(iterations: int | None) -> dict[str, dict]:
    """``--iterations`` caps every optimization baseline (Geiping's Adam steps, DLG's L-BFGS
    steps); None keeps the authors' defaults."""
    if iterations is None:
        return {}
    if iterations < 1:
        _fail("--iterations must be >= 1")
    from spear.baselines import GeipingAttack

    prior = {"prior": GeipingAttack(iterations=iterations)}
    return {"geiping": {"iterations": iterations}, "dlg": {"iterations": iterations}, "spear+prior": prior}


IterationsOpt = Annotated[
    int | None,
    typer.Option(help="cap the optimization baselines' iterations (default: the authors' 4000 / 300)"),
]


@app.command()
def compare(
    methods: Annotated[
        str, typer.Option(help="comma-separated: spear, spear+prior, geiping, dlg, cpa")
    ] = "spear,geiping,dlg,cpa",
    labels: Annotated[
        str, typer.Option(help="baselines' labels: recovered (from the output layer) or given (the truth)")
    ] = "recovered",
    iterations: IterationsOpt = None,
    dataset: DatasetOpt = DEFAULT_DATASET,
    batch_size: BatchOpt = 4,
    width: WidthOpt = None,
    depth: DepthOpt = DEFAULT_DEPTH,
    seed: SeedOpt = 0,
    max_proposals: MaxPropOpt = None,
    time_budget: TimeOpt = None,
    init: InitOpt = "default",
    pretrain_steps: PretrainOpt = None,
    dtype: DtypeOpt = None,
    autocast: AutocastOpt = None,
    model: ModelOpt = "mlp",
    layer: LayerOpt = None,
    out: Annotated[Path | None, typer.Option(help="write comparison.json and grid.png here")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="print the records as JSON on stdout")] = False,
) -> None:
    """Run SPEAR and the baselines on the same simulated FedSGD batch: PSNR, SSIM, LPIPS, exact
    batch, seconds per method (paper Table 1), and one image grid with a row per method."""
    from spear.baselines import ATTACKS
    from spear.experiments.compare import run_comparison
    from spear.experiments.report import json_safe, save_comparison_grid

    names = _split(methods, "methods")
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        _fail(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(ATTACKS)}")
    settings = _settings(**_experiment_options(locals()), device="cpu", proposer="auto")
    _check_out_dir(out, ("comparison.json", "grid.png"))
    console = Console(stderr=json_output)

    def report(record: dict) -> None:
        psnr = _fmt(record["metrics"].get("psnr"))
        console.print(f"{record['method']}: {record['seconds']:.1f} s, PSNR {psnr}")

    try:
        result = run_comparison(settings, names, _baseline_options(iterations), labels, on_result=report)
    except SpearError as exc:
        _fail(str(exc))
    if out is not None:
        with _writing_to(out):
            text = json.dumps(json_safe(result.records), indent=2, allow_nan=False)
            (out / "comparison.json").write_text(text)
            if result.truth is not None:
                save_comparison_grid(out / "grid.png", result.images, result.truth)
        console.print(f"wrote {out}")
    if json_output:
        sys.stdout.write(json.dumps(json_safe(result.records), indent=2, allow_nan=False) + "\n")
        return
    table = Table(title=f"{settings.dataset}, b={settings.batch_size}, {settings.model} (labels {labels})")
    for col in ("method", "PSNR", "SSIM", "LPIPS", "exact batch", "exact samples", "verified", "seconds"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in result.records:
        m = r["metrics"]
        table.add_row(
            r["method"],
            _fmt(m.get("psnr"), 3),
            _fmt(m.get("ssim"), 3),
            _fmt(m.get("lpips"), 3),
            "yes" if m["accuracy"] == 1.0 else "no",
            f"{r['exact_samples']}/{r['batch_size']}",
            str(r["verified"]),
            f"{r['seconds']:.1f}",
        )
    console.print(table)


@app.command()
def vulnerability(
    proxies: Annotated[
        str | None, typer.Option(help="comma-separated proxies (default all): grad_norm, lavp_l2_max, ...")
    ] = None,
    evaluate_proxies: Annotated[
        bool,
        typer.Option(
            "--evaluate",
            help="also attack each sample (DLG for L2, Geiping for cosine) and SPEAR the batch, and "
            "report Spearman's rho of each proxy against what they reached",
        ),
    ] = False,
    iterations: IterationsOpt = None,
    dataset: DatasetOpt = DEFAULT_DATASET,
    batch_size: BatchOpt = 8,
    width: WidthOpt = None,
    depth: DepthOpt = DEFAULT_DEPTH,
    seed: SeedOpt = 0,
    init: InitOpt = "default",
    pretrain_steps: PretrainOpt = None,
    dtype: DtypeOpt = None,
    autocast: AutocastOpt = None,
    model: ModelOpt = "mlp",
    out: Annotated[Path | None, typer.Option(help="write vulnerability.json here")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="print the records as JSON on stdout")] = False,
) -> None:
    """Rank a client batch's samples by each vulnerability proxy (gradient norm, LAVP's Hessian
    eigenvalues for the L2 and cosine matching losses, I2F): which samples leak first. Run it on
    a model before deployment."""
    from spear.experiments.report import json_safe
    from spear.experiments.vulnerability import ATTACK_FOR_LOSS, ClientCase, proxy_correlations
    from spear.vulnerability import PROXIES

    names = None if proxies is None else _split(proxies, "proxies")
    unknown = [n for n in names or [] if n not in PROXIES]
    if unknown:
        _fail(f"unknown prox(ies) {', '.join(unknown)}; choose from {', '.join(PROXIES)}")
    settings = _settings(**_experiment_options(locals()), device="cpu", proposer="auto")
    _check_out_dir(out, ("vulnerability.json",))
    options = _baseline_options(iterations) if evaluate_proxies else {}  # before the proxies' minutes
    console = Console(stderr=json_output)
    try:
        case = ClientCase.draw(settings)
        if evaluate_proxies:
            case.check_scorable()
        ranked = case.proxies(names, progress=lambda i, b: console.print(f"proxies: sample {i}/{b}"))
        output: dict = {"settings": settings.as_dict(), "samples": ranked.records()}
        output["ranking"] = ranked.ranking
        if evaluate_proxies:
            scores = {
                method: case.attack_each_sample(method, options.get(method))
                for method in ATTACK_FOR_LOSS.values()
            }
            output["attack_scores"] = scores
            output["spear_order"] = case.spear_order()
            output["correlations"] = proxy_correlations(ranked.values, scores, output["spear_order"])
    except SpearError as exc:
        _fail(str(exc))
    if out is not None:
        with _writing_to(out):
            (out / "vulnerability.json").write_text(json.dumps(json_safe(output), indent=2, allow_nan=False))
        console.print(f"wrote {out / 'vulnerability.json'}")
    if json_output:
        sys.stdout.write(json.dumps(json_safe(output), indent=2, allow_nan=False) + "\n")
        return
    title = f"vulnerability proxies, {settings.dataset}, b={settings.batch_size}, {settings.model}"
    table = Table(title=title)
    columns = list(ranked.values)
    for col in ("sample", "label", *columns):
        table.add_column(col, justify="right")
    for record in ranked.records():
        table.add_row(str(record["sample"]), str(record["label"]), *(f"{record[c]:.3e}" for c in columns))
    console.print(table)
    for name, order in ranked.ranking.items():
        console.print(f"{name}: most vulnerable first {order}")
    for row in output.get("correlations", []):
        console.print(
            f"rho({row['proxy']}, {row['attack']} {row['score']}) = {_fmt(row['rho'], 3)} "
            f"[{_fmt(row['ci95'][0], 3)}, {_fmt(row['ci95'][1], 3)}], n = {row['n']}"
        )


@app.command()
def theory(
    batch_size: BatchOpt = 20,
    width: Annotated[int, typer.Option(help="layer width m")] = 200,
    p_fr: PfrOpt = 1e-5,
    json_output: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Section 5.2 numbers: tau, Lemma 5.1 q, Lemma 5.2 expected proposals, Lemma A.1, Lemma 5.3."""
    try:
        s = theory_module.summarize(batch_size, width, p_fr)
    except SpearError as exc:
        _fail(str(exc))
    if json_output:
        sys.stdout.write(json.dumps(s.as_dict()) + "\n")
        return
    table = Table(title=f"SPEAR theory for b={batch_size}, m={width}, p_fr={p_fr:g}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [
        ("tau (Section 4.1)", f"{s.tau:.4f}  (>= {s.threshold_count} zeros of {width})"),
        ("q lower bound (Lemma 5.1)", f"{s.q_lower_bound:.3e}"),
        ("expected proposals n*_total (Lemma 5.2)", f"{s.expected_proposals:.3e}"),
        ("proposals for 99% success (Lemma A.1)", f"{s.proposals_99:.3e}"),
        ("failure prob. upper bound (Lemma 5.3)", f"{s.failure_upper_bound:.3e}"),
        ("failure prob. approximation (Lemma 5.3)", f"{s.failure_approx:.3e}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


@app.command()
def datasets() -> None:
    """List the built-in data sets and whether they load on this machine."""
    from spear.data import available_datasets, load_dataset

    table = Table(title="built-in data sets")
    for col in ("name", "available", "shape", "note"):
        table.add_column(col)
    for name, ok in available_datasets().items():
        if ok:
            ds = load_dataset(name)
            table.add_row(name, "yes", "x".join(map(str, ds.input_shape)), ds.note)
        else:
            table.add_row(name, "no", "", "")
    Console().print(table)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
