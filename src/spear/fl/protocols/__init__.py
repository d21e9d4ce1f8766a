"""FL protocols: how a client turns its private batch into the update the server receives.

One class per protocol, all behind :class:`Protocol`; :func:`make_protocol` builds one from the
names and options the CLI and the experiment records use. Secure aggregation sums the updates
of several clients that run one of them (:func:`spear.fl.simulate_round`).
"""

from __future__ import annotations

from typing import Any

from spear.errors import InputError
from spear.fl.protocols.base import Protocol
from spear.fl.protocols.dpsgd import DPSGD, ClippedWeights, TrainingRun
from spear.fl.protocols.fedavg import FedAvg
from spear.fl.protocols.fedsgd import FedSGD

PROTOCOLS: dict[str, type[Protocol]] = {"fedsgd": FedSGD, "fedavg": FedAvg, "dpsgd": DPSGD}


def make_protocol(name: str, **options: Any) -> Protocol:
    """The protocol ``name`` ("fedsgd", "fedavg", "dpsgd") with its options."""
    if name not in PROTOCOLS:
        raise InputError(f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)}")
    try:
        return PROTOCOLS[name](**options)
    except TypeError as exc:
        raise InputError(f"bad options for protocol {name!r}: {exc}") from None


__all__ = [
    "DPSGD",
    "PROTOCOLS",
    "ClippedWeights",
    "FedAvg",
    "FedSGD",
    "Protocol",
    "TrainingRun",
    "make_protocol",
]
