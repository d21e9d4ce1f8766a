"""spear-fl: exact reconstruction of client batches from federated-learning gradients.

Public API::

    import spear
    rec = spear.reconstruct(W, b, dW, db)          # one linear layer followed by ReLU
    rec = spear.attack_layer(model, "0", grads)    # a layer of a torch model
    res = spear.attack_model(model, grads)         # every layer, certified samples subtracted
    rec.inputs, rec.verified, rec.sigma, rec.stats
"""

import os

# Reproducible MKL: by default its results depend on memory alignment, so the same gradient and
# seed could give different attacks run to run (float32 cases sit near decision thresholds).
# STRICT: "AUTO" alone left the last bits free run to run (a float32 CNN head trained 200
# steps, b = 64, seed 2, 100,000 proposals: three distinct results in five single-thread runs,
# and with two threads one run in six ended another way; with STRICT, bit for bit the same).
# MKL reads this when it first computes, so it applies unless the process already ran a BLAS
# call before importing spear; a user's own MKL_CBWR setting wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from spear import fl, theory
from spear.api import attack_layer, build_options, reconstruct
from spear.cascade import CascadeResult, attack_model
from spear.core.result import AttackOptions, AttackStats, ProgressEvent, Reconstruction
from spear.errors import (
    InputError,
    NoSparsityError,
    OversubscribedWarning,
    RankError,
    SpearError,
    SpearWarning,
    TheoryError,
)

__version__ = "0.1.0"

__all__ = [
    "AttackOptions",
    "AttackStats",
    "CascadeResult",
    "InputError",
    "NoSparsityError",
    "OversubscribedWarning",
    "ProgressEvent",
    "RankError",
    "Reconstruction",
    "SpearError",
    "SpearWarning",
    "TheoryError",
    "__version__",
    "attack_layer",
    "attack_model",
    "build_options",
    "fl",
    "reconstruct",
    "theory",
]
