"""Attacks side by side: SPEAR and the baselines the field compares it with, behind one interface
(:class:`Attack`: an :class:`AttackTarget`, the server's view, in; an :class:`AttackOutput` out).

==============  ==========================================================================
``spear``       the exact attack (:class:`SpearAttack`)
``spear+prior`` SPEAR with guided sampling around Geiping's approximate batch (paper Table 5)
``geiping``     Inverting Gradients: cosine matching, TV, signed Adam, box (Geiping et al. 2020)
``dlg``         Deep Leakage from Gradients: L2 matching, L-BFGS; iDLG's label at b = 1
``cpa``         Cocktail Party Attack: ICA on the FC gradient (Kariyappa et al. 2023)
==============  ==========================================================================

A new attack is one new file with one :class:`Attack` subclass, registered in :data:`ATTACKS`.
"""

from __future__ import annotations

from typing import Any

from spear.baselines.base import Attack, AttackOutput, AttackTarget, DataDomain
from spear.baselines.cpa import CocktailPartyAttack, CPAConfig
from spear.baselines.dlg import DLGAttack, DLGConfig
from spear.baselines.geiping import GeipingAttack, GeipingConfig
from spear.baselines.labels import recover_labels
from spear.baselines.matching import MATCHING, cosine_distance, l2_distance, parameter_gradients
from spear.baselines.spear_attack import SpearAttack, SpearWithPrior
from spear.errors import InputError

#: attacks by name
ATTACKS: dict[str, type[Attack]] = {
    "spear": SpearAttack,
    "spear+prior": SpearWithPrior,
    "geiping": GeipingAttack,
    "dlg": DLGAttack,
    "cpa": CocktailPartyAttack,
}


def make_attack(name: str, **options: Any) -> Attack:
    """The attack ``name`` built with ``options`` (its config fields, or SPEAR's options)."""
    if name not in ATTACKS:
        raise InputError(f"unknown attack {name!r}; choose from {', '.join(ATTACKS)}")
    try:
        return ATTACKS[name](**options)
    except TypeError as exc:
        raise InputError(f"invalid options for {name}: {exc}") from exc


__all__ = [
    "ATTACKS",
    "MATCHING",
    "Attack",
    "AttackOutput",
    "AttackTarget",
    "CPAConfig",
    "CocktailPartyAttack",
    "DLGAttack",
    "DLGConfig",
    "DataDomain",
    "GeipingAttack",
    "GeipingConfig",
    "SpearAttack",
    "SpearWithPrior",
    "cosine_distance",
    "l2_distance",
    "make_attack",
    "parameter_gradients",
    "recover_labels",
]
