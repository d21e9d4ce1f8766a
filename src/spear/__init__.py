"""spear-fl: exact reconstruction of client batches from federated-learning gradients.

Public API::

    import spear
    rec = spear.reconstruct(W, b, dW, db)          # one linear layer followed by ReLU
    rec = spear.attack_layer(model, "0", grads)    # a layer of a torch model
    rec.inputs, rec.verified, rec.sigma, rec.stats
"""

from spear import fl, theory
from spear.api import attack_layer, build_options, reconstruct
from spear.core.result import AttackOptions, AttackStats, ProgressEvent, Reconstruction
from spear.errors import InputError, NoSparsityError, RankError, SpearError, TheoryError

__version__ = "0.1.0"

__all__ = [
    "AttackOptions",
    "AttackStats",
    "InputError",
    "NoSparsityError",
    "ProgressEvent",
    "RankError",
    "Reconstruction",
    "SpearError",
    "TheoryError",
    "__version__",
    "attack_layer",
    "build_options",
    "fl",
    "reconstruct",
    "theory",
]
