"""Files an experiment writes: result.json, grid.png, per_sample.csv."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import torch


def json_safe(value: Any) -> Any:
    """NaN -> null, +-inf -> "inf"/"-inf", tensors -> lists, recursively (strict JSON)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, torch.Tensor):
        return json_safe(value.tolist())
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    return value


def dumps(record: dict) -> str:
    return json.dumps(json_safe(record), allow_nan=False)


def _show(ax, image: torch.Tensor) -> None:
    """One (C, H, W) image in [0, 1] on a matplotlib axis (grayscale for one channel)."""
    img = image.detach().cpu().clamp(0, 1).permute(1, 2, 0).numpy()
    gray = img.shape[-1] == 1
    ax.imshow(img[..., 0] if gray else img, cmap="gray" if gray else None, vmin=0, vmax=1)


def save_grid(
    path: Path, reconstruction: torch.Tensor | None, truth: torch.Tensor, max_images: int = 16
) -> Path:
    """Three rows: reconstruction, ground truth, |difference| (scaled so tiny errors show)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = min(max_images, truth.shape[0])
    rows = ["reconstruction", "ground truth", "|difference|"]
    fig, axes = plt.subplots(3, k, figsize=(1.2 * k + 1.5, 4.2), squeeze=False)
    diff = (reconstruction - truth).abs() if reconstruction is not None else None
    scale = float(diff.max()) if diff is not None and float(diff.max()) > 0 else 1.0
    for j in range(k):
        panels = [reconstruction, truth, diff / scale if diff is not None else None]
        for i, panel in enumerate(panels):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if panel is None:
                ax.text(0.5, 0.5, "n/a", ha="center", va="center")
                continue
            _show(ax, panel[j])
            if j == 0:
                ax.set_ylabel(rows[i], fontsize=8)
    fig.suptitle(f"SPEAR reconstruction; bottom row: |difference| / {scale:.1e} (its maximum)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_comparison_grid(
    path: Path, images: dict[str, torch.Tensor | None], truth: torch.Tensor, max_images: int = 12
) -> Path:
    """One row per method (its reconstruction in the truth's order; "n/a" where it gave none),
    and the ground truth on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = min(max_images, truth.shape[0])
    rows = [("ground truth", truth), *images.items()]
    fig, axes = plt.subplots(len(rows), k, figsize=(1.1 * k + 1.6, 1.15 * len(rows) + 0.4), squeeze=False)
    for i, (label, panel) in enumerate(rows):
        for j in range(k):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0:
                ax.set_ylabel(label, fontsize=8)
            if panel is None:
                ax.text(0.5, 0.5, "n/a", ha="center", va="center", fontsize=8)
                continue
            _show(ax, panel[j])
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_result_dir(
    out: Path, record: dict, reconstruction: torch.Tensor | None, truth: torch.Tensor | None
) -> list[Path]:
    """result.json, grid.png (image data only: ``truth`` None skips it; tabular records are in
    result.json's ``decoded``) and per_sample.csv."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    (out / "result.json").write_text(json.dumps(json_safe(record), indent=2, allow_nan=False))
    written.append(out / "result.json")
    if truth is not None:
        written.append(save_grid(out / "grid.png", reconstruction, truth))
    per_sample = record.get("per_sample") or {}
    with open(out / "per_sample.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        names = list(per_sample)
        writer.writerow(["sample", *names])
        for i in range(len(next(iter(per_sample.values()), []))):
            writer.writerow([i, *[per_sample[n][i] for n in names]])
    written.append(out / "per_sample.csv")
    return written
