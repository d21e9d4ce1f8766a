"""The client side of federated learning: models, the updates clients send, what the server sees.

The attack only ever receives a :class:`ServerView`; the private batch stays in :class:`ClientBatch`,
which only evaluation code touches.
"""

from spear.fl.client import ClientBatch, ServerView, fedsgd_gradients, pretrain, simulate_fedsgd
from spear.fl.models import INITS, fully_connected, shallow_mlp

__all__ = [
    "INITS",
    "ClientBatch",
    "ServerView",
    "fedsgd_gradients",
    "fully_connected",
    "pretrain",
    "shallow_mlp",
    "simulate_fedsgd",
]
