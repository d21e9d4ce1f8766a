"""Scale recovery (Theorem 3.6) and assembly of X and dL/dZ from a disaggregation matrix.

The attack finds unscaled directions ``Qbar``. The bias gradient fixes their scales:
``dL/db = dL/dZ 1`` (Lemma 3.5), hence ``c = Qbar^-1 L^+ dL/db`` (Theorem 3.6), ``Q = Qbar diag(c)``,
``X^T = Q^-1 R`` and ``dL/dZ = L Q`` (Theorem 3.2).

In *input-sparsity* mode (Section 3.2: the layer is preceded by a ReLU, so X is sparse) the roles
of the factors swap: sparse directions live in ``R^T``, ``X = R^T Qbar diag(c)`` and
``dL/dZ = L Qbar^-T diag(1/c)``; the bias gradient then gives ``1/c = Qbar^T L^+ dL/db``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from spear.core.linalg import lstsq, solve_ex

SparsityMode = Literal["output", "input"]

#: a disaggregation matrix whose singular values spread more than this is treated as singular
SINGULAR_RTOL = 1e-10


@dataclass(frozen=True)
class LayerProblem:
    """Everything the server sees about one linear layer, in the working dtype.

    Attributes:
        weight: W (m x n). bias: b (m,). grad_bias: dL/db (m,).
        L, R: the low-rank split of dL/dW (m x b, b x n).
        mode: which side of the layer is ReLU-sparse.
        next_grad_weight: the next linear layer's weight gradient, when the server has it.
        next_weight: the next linear layer's weight, when known.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    grad_bias: torch.Tensor
    L: torch.Tensor
    R: torch.Tensor
    mode: SparsityMode = "output"
    #: optional: dL/dW' of the next linear layer (k x m), whose exact zeros are intersections of
    #: the samples' ReLU patterns (used by the next-layer proposer only)
    next_grad_weight: torch.Tensor | None = None
    #: optional: W' of that next layer (k x m), for peeling's step 5 (spear.core.peeling)
    next_weight: torch.Tensor | None = None
    #: derived: L^+ dL/db (any left inverse works, Theorem 3.6) and R W^T, reused by every score
    pinv_grad_bias: torch.Tensor = field(init=False, repr=False)
    R_Wt: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        pinv_db = lstsq(self.L, self.grad_bias[:, None])[:, 0]
        object.__setattr__(self, "pinv_grad_bias", pinv_db)
        object.__setattr__(self, "R_Wt", self.R @ self.weight.T)

    def input_coefficients(self, p: torch.Tensor, rtol: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Directions p (k, b) of samples' inputs ``x = R^T p`` scaled to the true inputs' ``r``:
        every sample has ``r . L^+ dL/db = 1`` (Theorem 3.6 with ``u_j . r_k = delta_jk``,
        :mod:`spear.core.peeling` step 2). Returns r (k, b) and which scales are determined
        (``|p . L^+ dL/db|`` above ``rtol`` of the norms; r is p itself where not)."""
        dot = p @ self.pinv_grad_bias
        tiny = torch.finfo(p.dtype).tiny
        r = p / torch.where(dot.abs() > tiny, dot, torch.ones_like(dot)).unsqueeze(-1)
        return r, dot.abs() > rtol * p.norm(dim=1) * self.pinv_grad_bias.norm()

    @property
    def batch_size(self) -> int:
        return int(self.L.shape[1])

    @property
    def sparse_factor(self) -> torch.Tensor:
        """The factor whose columns' products with true directions are sparse (rows x b)."""
        return self.L if self.mode == "output" else self.R.T

    def scales(self, Qbar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales c for a batch of unscaled matrices (S, b, b) (columns = directions), and a mask
        of the matrices that are well conditioned and give finite, nonzero scales."""
        sv = torch.linalg.svdvals(Qbar)
        valid = sv[:, -1] > SINGULAR_RTOL * sv[:, 0]
        rhs = self.pinv_grad_bias.expand(Qbar.shape[0], -1)
        if self.mode == "output":
            c, info = solve_ex(Qbar, rhs)
        else:
            inv_c = (Qbar.transpose(1, 2) @ rhs.unsqueeze(-1)).squeeze(-1)
            c, info = 1.0 / inv_c, torch.zeros(Qbar.shape[0], dtype=torch.int32, device=Qbar.device)
        magnitude = c.abs()
        valid &= (info == 0) & torch.isfinite(c).all(dim=1)
        valid &= magnitude.amin(dim=1) > 1e-12 * magnitude.amax(dim=1).clamp_min(1e-300)
        return c, valid

    def assemble(self, Qbar: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs X (b x n) and dL/dZ (m x b) for one unscaled matrix and its scales."""
        if self.mode == "output":
            Q = Qbar * c[None, :]
            inputs = torch.linalg.solve(Q, self.R)
            grad_outputs = self.L @ Q
        else:
            inputs = c[:, None] * (Qbar.T @ self.R)
            grad_outputs = torch.linalg.solve(Qbar, self.L.T).T / c[None, :]
        return inputs, grad_outputs

    def pre_activations_t(self, Qbar: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Z^T = X W^T + b for a batch (S, b, b) of output-mode matrices: (S, b, m)."""
        solved, _ = solve_ex(Qbar, self.R_Wt.expand(Qbar.shape[0], -1, -1))
        return solved / c.unsqueeze(-1) + self.bias
