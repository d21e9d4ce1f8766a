"""The client side of federated learning: models, the updates clients send, what the server sees.

The attack only ever receives a :class:`ServerView`; the private batch stays in :class:`ClientBatch`,
which only evaluation code touches.
"""

from spear.fl.client import (
    ClientBatch,
    ServerView,
    fedsgd_gradients,
    layer_inputs,
    pretrain,
    simulate_fedsgd,
    simulate_round,
)
from spear.fl.models import (
    INITS,
    MODELS,
    attackable_layers,
    build_model,
    feature_layer,
    fully_connected,
    shallow_mlp,
    small_cnn,
    small_vgg,
    vgg,
)
from spear.fl.protocols import DPSGD, PROTOCOLS, FedAvg, FedSGD, Protocol, make_protocol

__all__ = [
    "DPSGD",
    "INITS",
    "MODELS",
    "PROTOCOLS",
    "ClientBatch",
    "FedAvg",
    "FedSGD",
    "Protocol",
    "ServerView",
    "attackable_layers",
    "build_model",
    "feature_layer",
    "fedsgd_gradients",
    "fully_connected",
    "layer_inputs",
    "make_protocol",
    "pretrain",
    "shallow_mlp",
    "simulate_fedsgd",
    "simulate_round",
    "small_cnn",
    "small_vgg",
    "vgg",
]
