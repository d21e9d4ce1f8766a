"""Flower integration: the client that trains locally, and a server strategy that audits.

:class:`LocalTrainingClient` is the FedAvg client of :mod:`spear.fl.protocols.fedavg` as a Flower
``NumPyClient``. :class:`AuditingFedAvg` is Flower's ``FedAvg`` strategy that, before aggregating
a round, attacks every client's update with SPEAR and records what leaked, so an operator can
drop it into an existing Flower server and see, per round and client, which samples its
clients' updates give away.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Parameters,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager, SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg as FedAvgStrategy
from flwr.server.strategy import Strategy
from torch import nn

from spear.fl.protocols.fedavg import local_sgd, shuffled_batches
from spear.fl.replay import first_linear


class LocalTrainingClient(NumPyClient):
    """A Flower client holding one private batch; ``fit`` runs the local epochs the server's
    config asks for (``local_epochs``, ``batch_size``, ``lr``) and returns the new weights."""

    def __init__(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, seed: int = 0) -> None:
        self.model = copy.deepcopy(model)
        self.inputs, self.labels = inputs, labels
        self.generator = torch.Generator().manual_seed(seed)

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return [p.detach().cpu().numpy().copy() for p in self.model.parameters()]

    def set_parameters(self, parameters: list[np.ndarray]) -> None:
        with torch.no_grad():
            for param, value in zip(self.model.parameters(), parameters, strict=True):
                param.copy_(torch.from_numpy(np.asarray(value)).to(param))

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        self.set_parameters(parameters)
        b = self.inputs.shape[0]
        size = min(int(config.get("batch_size", b)), b)
        steps = shuffled_batches(b, int(config["local_epochs"]), size, self.generator)
        local_sgd(self.model, self.inputs, self.labels, steps, float(config["lr"]))
        return self.get_parameters({}), b, {}


class InProcessClientProxy(ClientProxy):
    """A Flower ``ClientProxy`` that calls a ``NumPyClient`` in this process (no network): the
    server side of Flower's own messages (``FitIns`` in, ``FitRes`` out) without a transport."""

    def __init__(self, cid: str, client: NumPyClient) -> None:
        super().__init__(cid)
        self.client = client

    def fit(self, ins: FitIns, timeout: float | None, group_id: int | None) -> FitRes:
        weights, examples, metrics = self.client.fit(parameters_to_ndarrays(ins.parameters), dict(ins.config))
        return FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters(weights), examples, metrics)

    def get_parameters(self, ins, timeout, group_id):  # pragma: no cover - not used by fit rounds
        raise NotImplementedError

    def get_properties(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError

    def evaluate(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError


def run_fit_rounds(strategy: Strategy, clients: list[NumPyClient], parameters: Parameters, rounds: int = 1):
    """Flower's server loop for training only, in process: each round the strategy configures
    the clients (``configure_fit``), they fit, and it aggregates (``aggregate_fit``). Returns
    the final global parameters."""
    manager = SimpleClientManager()
    for index, client in enumerate(clients):
        manager.register(InProcessClientProxy(str(index), client))
    for server_round in range(1, rounds + 1):
        instructions = strategy.configure_fit(server_round, parameters, manager)
        results = [(proxy, proxy.fit(ins, None, None)) for proxy, ins in instructions]
        aggregated, _ = strategy.aggregate_fit(server_round, results, [])
        if aggregated is not None:
            parameters = aggregated
    return parameters


@dataclass
class AuditRecord:
    """What one client's update in one round gave away (one row of ``AuditingFedAvg.records``)."""

    server_round: int
    client: str
    num_examples: int
    recovered: int  # samples recovered (the batch, or those certified one by one)
    verified: bool
    verified_by: str | None
    certified_samples: int
    seconds: float
    message: str
    inputs: torch.Tensor | None = field(default=None, repr=False)  # kept only with keep_inputs
    labels: torch.Tensor | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("inputs", "labels")}
        out["labels"] = None if self.labels is None else self.labels.tolist()
        return out


def _check_data_layer(model: nn.Module) -> None:
    """A clear error unless the model's first Linear takes the data (only pass-through modules
    before it): the audit counts what it recovers there as the clients' samples."""
    from spear.inversion.base import check_takes_the_data

    layer = first_linear(model)
    check_takes_the_data(
        model,
        layer,
        f"the audit attacks the model's first Linear ({layer!r}) and counts its inputs as the clients' data",
        "Audit an MLP (or tabular model) whose first Linear takes the data, or use spear.attack_layer "
        "and spear.inversion on the updates",
    )


class AuditingFedAvg(FedAvgStrategy):
    """Flower's ``FedAvg`` that attacks every client update before aggregating it.

    Drop it into a Flower server in place of ``FedAvg``: it needs the global model's
    architecture (``model``; its weights are overwritten by the ones each round sends), and it
    reads the local training (``local_epochs``, ``batch_size``, ``lr``) from the fit config the
    server sends (``on_fit_config_fn``), so the replay certificate (:mod:`spear.fl.replay`) uses
    what the clients were told. Each (round, client) pair adds an :class:`AuditRecord` to
    ``records`` (and a line to ``log_path`` when given); aggregation is Flower's own.

    Args:
        model: the global model (an ``nn.Sequential`` whose first module is the attacked Linear).
        attack_options: options for :func:`spear.attack_layer` (e.g. ``max_proposals``).
        keep_inputs: keep the recovered inputs and labels in the records (they are the clients'
            private data: off by default).
        log_path: a JSONL file that receives one line per record.
        **fedavg: Flower ``FedAvg`` arguments.
    """

    def __init__(
        self,
        model: nn.Module,
        attack_options: dict[str, Any] | None = None,
        keep_inputs: bool = False,
        log_path: str | None = None,
        **fedavg: Any,
    ) -> None:
        super().__init__(**fedavg)
        _check_data_layer(model)
        self.model = copy.deepcopy(model)
        self.attack_options = dict(attack_options or {})
        self.keep_inputs = keep_inputs
        self.log_path = log_path
        self.records: list[AuditRecord] = []
        self._sent: dict[int, tuple[list[np.ndarray], dict[str, Any]]] = {}

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        instructions = super().configure_fit(server_round, parameters, client_manager)
        config = dict(instructions[0][1].config) if instructions else {}
        self._sent[server_round] = (parameters_to_ndarrays(parameters), config)
        return instructions

    def aggregate_fit(self, server_round: int, results, failures):
        sent = self._sent.pop(server_round, None)
        if sent is not None:
            for proxy, fit_res in results:
                record = self.audit(server_round, proxy.cid, sent[0], sent[1], fit_res)
                self.records.append(record)
                self._log(record)
        return super().aggregate_fit(server_round, results, failures)

    def audit(
        self,
        server_round: int,
        client: str,
        before: list[np.ndarray],
        config: dict[str, Any],
        fit_res: FitRes,
    ) -> AuditRecord:
        """Attack one client's update (``before`` the global weights it received)."""
        import spear
        from spear.errors import SpearError

        start = time.perf_counter()
        model = copy.deepcopy(self.model)
        with torch.no_grad():
            for param, value in zip(model.parameters(), before, strict=True):
                param.copy_(torch.from_numpy(np.asarray(value)).to(param))
        try:
            protocol = _local_training(config)
            update = _weight_update(model, before, parameters_to_ndarrays(fit_res.parameters), protocol.lr)
            options = {**protocol.attack_options(model, update), **self.attack_options}
            rec = spear.attack_layer(model, first_linear(model), update, **options)
            rec = protocol.certify(model, update, rec.to(next(model.parameters()).device))
        except SpearError as exc:
            seconds = time.perf_counter() - start
            return AuditRecord(
                server_round, client, fit_res.num_examples, 0, False, None, 0, seconds, f"not attacked: {exc}"
            )
        certified = 0 if rec.certified_inputs is None else int(rec.certified_inputs.shape[0])
        recovered = rec.batch_size if rec.inputs is not None else certified
        return AuditRecord(
            server_round,
            client,
            fit_res.num_examples,
            recovered,
            rec.verified,
            rec.verified_by,
            certified,
            time.perf_counter() - start,
            rec.message,
            rec.inputs if self.keep_inputs else None,
            rec.labels if self.keep_inputs else None,
        )

    def _log(self, record: AuditRecord) -> None:
        if self.log_path is None:
            return
        with open(self.log_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record.as_dict()) + "\n")


def _local_training(config: dict[str, Any]):
    """The FedAvg settings a fit config told the clients (``local_epochs``, ``batch_size``, ``lr``)."""
    from spear.errors import InputError
    from spear.fl.protocols import FedAvg

    if "lr" not in config:
        raise InputError(
            "the fit config carries no 'lr': the audit needs the clients' learning rate (and "
            "'local_epochs', 'batch_size') from on_fit_config_fn to replay their training"
        )
    size = int(config["batch_size"]) if "batch_size" in config else None
    return FedAvg(int(config.get("local_epochs", 1)), size, float(config["lr"]))


def _weight_update(
    model: nn.Module, before: list[np.ndarray], after: list[np.ndarray], lr: float
) -> dict[str, torch.Tensor]:
    """``(W_before - W_after) / lr`` by parameter name."""
    names = [name for name, _ in model.named_parameters()]
    return {
        name: torch.from_numpy(np.asarray(b) - np.asarray(a)) / lr
        for name, b, a in zip(names, before, after, strict=True)
    }
