"""The public entry points: :func:`reconstruct` (one layer) and :func:`attack_layer` (a model).

These validate and convert what users pass (numpy arrays or tensors, any float dtype), then call
the pure core (:mod:`spear.core.reconstruct`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from spear import checks
from spear.certify import (
    ModelCertifier,
    SampleWeights,
    WeightedCertifier,
    check_sparsity_side,
    model_tail,
)
from spear.core.certificate import SampleCertifier
from spear.core.consistency import Tolerances
from spear.core.proposers import PROPOSERS, DirectionProposer
from spear.core.reconstruct import run_attack
from spear.core.result import AttackOptions, Reconstruction
from spear.errors import InputError, NoSparsityError, OversubscribedWarning
from spear.inversion.base import acting_layers_below, check_takes_the_data

_OPTION_NAMES = {f.name for f in dataclasses.fields(AttackOptions)}
#: a sample is saturated when its gradient changes by at most this many eps (of the gradient's
#: dtype) per relative change of its pre-activations (see spear.certify.ModelCertifier)
SATURATION_EPS = 1e3


#: a private option: when the call began (``time.perf_counter()``), for the time budget
_CLOCK = "_clock_start"


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    """A dense, strided, floating-point tensor holding data (numpy arrays of any byte order or
    strides are copied as needed); otherwise an InputError naming what to pass."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.layout != torch.strided:
            raise InputError(f"{name} is a {tensor.layout} tensor; pass a dense one (tensor.to_dense())")
        if tensor.is_meta:
            raise InputError(f"{name} is on the meta device (shapes only, no values); pass the real tensor")
    elif isinstance(value, np.ndarray):
        if value.dtype.kind != "f" or value.dtype.itemsize > 8:
            raise InputError(
                f"{name} must hold float16, float32 or float64 numbers, got numpy dtype {value.dtype}"
            )
        tensor = torch.from_numpy(np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("=")))
    else:
        raise InputError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
    if not (tensor.is_floating_point()):
        raise InputError(f"{name} must hold floating-point numbers, got dtype {tensor.dtype}")
    return tensor


def _resolve_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"unknown device {device!r}; use 'cpu' or 'cuda'") from exc
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"unknown device {device!r}; use 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device='cuda' was requested but CUDA is not available here; use device='cpu'")
    return dev


def _fraction(name: str, value: Any) -> float | None:
    """None, or a real number strictly between 0 and 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < 1:
        raise InputError(f"{name} must be a number in (0, 1) or None, got {value!r}")
    return float(value)


def check_seconds(name: str, value: Any) -> None:
    """A clear error unless ``value`` is None or a positive, finite number of seconds."""
    if value is not None and (not checks.finite_real(value) or value <= 0):
        raise InputError(f"{name} must be a positive, finite number of seconds or None, got {value!r}")


def _oversubscribed() -> tuple[float, int] | None:
    """The machine's load and cores where more threads are runnable than cores while torch
    runs several OpenMP threads that spin-wait (None otherwise, or where the load is unknown)."""
    if not hasattr(os, "getloadavg") or torch.get_num_threads() < 2:
        return None
    if os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive":
        return None
    try:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        load = os.getloadavg()[0]
    except OSError:  # no load figures here (e.g. no /proc): nothing to act on
        return None
    return (load, cores) if load >= cores + 1 else None


def warn_if_oversubscribed(time_budget: float | None) -> None:
    """Warn (once per process) when a time budget meets an oversubscribed machine
    (:class:`~spear.errors.OversubscribedWarning`): spear-fl then runs the attack on one
    thread (:func:`budget_threads`), which the user may want to know and can avoid."""
    global _warned_oversubscribed
    if time_budget is None or _warned_oversubscribed:
        return
    found = _oversubscribed()
    if found is None:
        return
    load, cores = found
    _warned_oversubscribed = True
    warnings.warn(
        f"the machine's load ({load:.1f}) exceeds its {cores} cores while torch runs "
        f"{torch.get_num_threads()} spin-waiting OpenMP threads: single linear-algebra calls "
        "would take 10-100x longer and overrun the time budget, so spear-fl runs attacks with a "
        "time budget on one thread while the load lasts (torch.set_num_threads(1), set back "
        "after each; the last bits may differ from an idle run's). To keep your threads, set "
        "OMP_WAIT_POLICY=PASSIVE before importing torch; max_proposals is a work budget, the "
        "same result under any load",
        OversubscribedWarning,
        stacklevel=_caller_level(),
    )


@contextlib.contextmanager
def budget_threads(time_budget: float | None) -> Iterator[None]:
    """Run the enclosed attack on one torch thread when it has a time budget and the machine is
    oversubscribed (:func:`_oversubscribed`); torch's thread count is set back after.

    There OpenMP's spin-waiting threads wait on each other: one step of a float32 CNN head
    (b = 64) took 7 s instead of 0.1 s, and a 10 s budget ended at 16.4 s. On one thread there
    is no barrier to wait at, and the same budgets held within 0.1 s (see "On a loaded
    machine" under "Options" in the README). Without a time budget nothing changes: a work
    budget's result is then the same bits under any load."""
    if time_budget is None or _oversubscribed() is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside spear-fl (the user's call), as seen from
    the function that calls this one."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "spear":
        frame, level = frame.f_back, level + 1
    return level


_warned_oversubscribed = False


#: prefixes that wrappers add to parameter names: DistributedDataParallel and DataParallel
#: ("module."), Opacus' GradSampleModule ("_module."), torch.compile ("_orig_mod.")
WRAPPER_PREFIXES = ("module.", "_module.", "_orig_mod.")


def named_gradients(model: torch.nn.Module, gradients: Mapping[str, Any] | Sequence[Any]) -> dict[str, Any]:
    """The update as a dict parameter-name -> gradient: a dict as given, or a list in
    ``model.parameters()`` order (a clear error when its length does not match). A dict keyed by
    a wrapped model's names (every key with one of ``WRAPPER_PREFIXES``) is read with the
    prefix removed when that gives the model's own names. A ``None`` gradient (a frozen
    parameter's ``p.grad``) is one the update does not hold: it is left out."""
    if isinstance(gradients, Mapping):
        odd = [key for key in gradients if not isinstance(key, str)]
        if odd:
            raise InputError(
                f"gradients must be keyed by parameter name (model.named_parameters()), got keys "
                f"{odd[:3]!r}; a list in model.parameters() order works too"
            )
        return _unwrapped(model, {k: v for k, v in gradients.items() if v is not None})
    if gradients is None or isinstance(gradients, torch.Tensor) or not isinstance(gradients, Iterable):
        raise InputError(
            f"gradients must be a dict parameter-name -> gradient or a list in model.parameters() "
            f"order, got {type(gradients).__name__}; for gradients left on a model by backward(), "
            "pass {name: p.grad for name, p in model.named_parameters()}"
        )
    names = [name for name, _ in model.named_parameters()]
    listed = list(gradients)
    if len(listed) != len(names):
        raise InputError(
            f"got {len(listed)} gradients but the model has {len(names)} parameters; pass one "
            "per parameter in model.parameters() order, or a dict name -> gradient"
        )
    return {name: value for name, value in zip(names, listed, strict=True) if value is not None}


def _unwrapped(model: torch.nn.Module, grads: dict[str, Any]) -> dict[str, Any]:
    """``grads`` with a wrapper's prefix removed from every key, where the model's own names
    then cover them all and the keys as given name none of its parameters."""
    names = {name for name, _ in model.named_parameters()}
    if not grads or names & set(grads):
        return grads
    for prefix in WRAPPER_PREFIXES:
        if all(key.startswith(prefix) for key in grads):
            stripped = {key[len(prefix) :]: value for key, value in grads.items()}
            if set(stripped) <= names:
                return stripped
    return grads


def build_options(options: Mapping[str, Any]) -> AttackOptions:
    """Turn keyword options into :class:`AttackOptions`, naming any unknown or invalid one."""
    unknown = set(options) - _OPTION_NAMES
    if unknown:
        raise InputError(f"unknown option(s) {sorted(unknown)}; valid options are {sorted(_OPTION_NAMES)}")
    opts = AttackOptions(**options)
    fixed = {
        "seed": checks.seed(opts.seed),
        "max_proposals": checks.integer("max_proposals", opts.max_proposals, 0, allow_none=True),
        "chunk_size": checks.integer("chunk_size", opts.chunk_size, 1),
        "batch_size": checks.integer("batch_size", opts.batch_size, 1, allow_none=True),
        "clients": checks.integer("clients", opts.clients, 1),
        "p_fr": _fraction("p_fr", opts.p_fr),
        "rank_rtol": _fraction("rank_rtol", opts.rank_rtol),
        "zero_rtol": _fraction("zero_rtol", opts.zero_rtol),
        "verify_rtol": _fraction("verify_rtol", opts.verify_rtol),
    }
    if fixed["p_fr"] is None:
        raise InputError("p_fr must be a number in (0, 1), got None")
    if opts.sparsity not in ("output", "input"):
        raise InputError(f"sparsity must be 'output' or 'input', got {opts.sparsity!r}")
    check_seconds("time_budget", opts.time_budget)
    warn_if_oversubscribed(opts.time_budget)
    for name in ("dtype", "proposal_dtype"):
        if getattr(opts, name) not in (torch.float32, torch.float64):
            raise InputError(
                f"{name} must be torch.float64 or torch.float32 (the linear algebra needs them), "
                f"got {getattr(opts, name)!r}"
            )
    if opts.client_dtype is not None and opts.client_dtype not in SIGNIFICAND_BITS:
        raise InputError(
            f"client_dtype must be one of {', '.join(str(d) for d in SIGNIFICAND_BITS)} or None (read "
            f"off the gradient), got {opts.client_dtype!r}"
        )
    for name in ("early_stop", "peel"):
        if not isinstance(getattr(opts, name), bool):
            raise InputError(f"{name} must be True or False, got {getattr(opts, name)!r}")
    if opts.progress is not None and not callable(opts.progress):
        raise InputError("progress must be a callable receiving ProgressEvent, or None")
    if not isinstance(opts.proposer, (str, DirectionProposer)):
        raise InputError(
            f"proposer must be a name or a DirectionProposer, got {type(opts.proposer).__name__}"
        )
    if isinstance(opts.proposer, str) and opts.proposer not in {"auto", *PROPOSERS}:
        raise InputError(
            f"unknown proposer {opts.proposer!r}; use one of {sorted({'auto', *PROPOSERS})} or pass a "
            "DirectionProposer instance"
        )
    return dataclasses.replace(opts, **fixed)


def source_precision(*tensors: torch.Tensor) -> torch.dtype:
    """The least precise dtype the gradient was computed in, read from the tensors it came in
    (:func:`stored_precision`): the rounding noise every threshold must tolerate (float16 and
    bfloat16 are upcast, with their own tolerances and the gap rank rule)."""
    return max((stored_precision(t) for t in tensors), key=lambda d: torch.finfo(d).eps)


#: the significand widths (with the implicit bit) of the dtypes a client computes in, narrowest
#: first
SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}
#: nonzero entries a tensor needs for its significands to tell the precision it was computed
#: in: a float32 entry fits float16's 11 bits by chance with probability 2^-13
FEWEST_TELLING_ENTRIES = 64
#: entries read of a larger tensor (evenly spaced): where reading all of an m = 4000 MLP's
#: gradients took a second, and 2^20 of each 24 ms (read ~9 times per attack), 2^16 take 0.9 ms;
#: a float32 tensor passes for float16 with probability 2^-13 per nonzero entry read
MOST_READ_ENTRIES = 2**16


def stored_precision(t: torch.Tensor) -> torch.dtype:
    """The narrowest floating dtype whose significand holds every entry of ``t``: the precision
    ``t`` was computed in, which its dtype may overstate. A client under ``torch.autocast``
    computes each layer's gradient in float16 or bfloat16 and stores it in its float32
    parameter's ``.grad`` (loss scaling and unscaling multiply by powers of 2, which keep the
    significands); a float32 update may have been upcast to float64 before the attack. Their
    tolerances must be those of the arithmetic, not of the container. A tensor with fewer than
    ``FEWEST_TELLING_ENTRIES`` nonzero entries keeps its dtype; of a larger one,
    ``MOST_READ_ENTRIES`` evenly spaced entries are read."""
    own = SIGNIFICAND_BITS.get(t.dtype)
    flat = t.detach().reshape(-1)
    flat = flat[:: max(1, flat.numel() // MOST_READ_ENTRIES)]
    values = flat[flat != 0] if own is not None else t.new_empty(0)
    if values.numel() < FEWEST_TELLING_ENTRIES:
        return t.dtype
    mantissa, _ = torch.frexp(values.to(torch.float64))  # exact: in [0.5, 1)
    for dtype, bits in SIGNIFICAND_BITS.items():
        if bits >= own:
            break
        scaled = mantissa * 2.0**bits  # a power of 2: exact
        if bool((scaled == scaled.round()).all()):
            return dtype
    return t.dtype


@checks.outside_inference_mode
def reconstruct(
    weight: Any,
    bias: Any,
    grad_weight: Any,
    grad_bias: Any,
    *,
    next_grad_weight: Any = None,
    next_weight: Any = None,
    certifier: SampleCertifier | None = None,
    **options: Any,
) -> Reconstruction:
    """Recover the input batch of a linear layer ``Z = W X + b`` followed by a ReLU.

    Args:
        weight: W, shape (m, n). bias: b, shape (m,).
        grad_weight: dL/dW as the server received it, shape (m, n).
        grad_bias: dL/db, shape (m,).
        next_grad_weight: optional, the weight gradient of the linear layer that follows the
            ReLU, shape (k, m). Its exact zeros reveal intersections of the samples' activation
            patterns, which the ``auto`` and ``next_layer`` proposers use for large batches, and
            its row space lets each found direction be turned into its sample on its own
            (peeling, :mod:`spear.core.peeling`; ``peel=False`` turns that off): the attack then
            continues on the smaller problem of the samples not yet recovered.
        next_weight: optional, that next layer's weight W', shape (k, m). With it, peeling
            also removes the recovered samples from ``next_grad_weight``, whose zero sets then
            get larger (they are intersections over fewer samples).
        certifier: optional, checks samples one by one from outside the layer
            (:class:`spear.core.certificate.SampleCertifier`); :func:`attack_layer` builds the
            model's (:class:`spear.certify.ModelCertifier`).
        **options: see :class:`spear.AttackOptions` (``max_proposals``, ``seed``, ``p_fr``,
            ``time_budget``, ``sparsity``, ``device``, ``progress``, ...).

    Returns:
        A :class:`Reconstruction`; ``inputs`` is the batch (b, n) in arbitrary order.
        ``verified`` is True only when the batch is proven: here, with the layer alone, when
        the recomputed gradients match, the ReLU pattern matches both ways and every sample is
        pinned by its zero set (``verified_by == "layer"``); otherwise ``ambiguous`` names the
        samples this gradient cannot tell apart.

    Raises:
        InputError: wrong types, shapes, NaN/Inf, all-zero gradients, unknown options.
        RankError: the batch is not smaller than the layer (rank(dL/dW) = min(m, n)).
        NoSparsityError: the gradient shows no ReLU sparsity.

    Example:
        >>> rec = spear.reconstruct(layer.weight, layer.bias, layer.weight.grad, layer.bias.grad)
        >>> rec.verified, rec.inputs.shape
    """
    started = options.pop(_CLOCK, None)
    if started is not None and not (isinstance(started, numbers.Real) and started <= time.perf_counter()):
        raise InputError(f"{_CLOCK} must be a time.perf_counter() reading not in the future, got {started!r}")
    started = time.perf_counter() if started is None else float(started)  # the budget counts from here
    opts = build_options(options)
    device = _resolve_device(opts.device)
    W = _as_tensor("weight", weight)
    bvec = _as_tensor("bias", bias)
    GW = _as_tensor("grad_weight", grad_weight)
    Gb = _as_tensor("grad_bias", grad_bias)
    if W.ndim != 2:
        raise InputError(f"weight must be 2-D (m, n), got shape {tuple(W.shape)}")
    m, n = W.shape
    if m < 2 or n < 2:
        raise InputError(f"weight of shape {(m, n)} is too small: SPEAR needs m >= 2 and n >= 2")
    if tuple(GW.shape) != (m, n):
        raise InputError(
            f"grad_weight has shape {tuple(GW.shape)} but weight has shape {(m, n)}; they must match"
        )
    for name, vec in (("bias", bvec), ("grad_bias", Gb)):
        if tuple(vec.shape) != (m,):
            raise InputError(
                f"{name} must have shape ({m},) to match weight (m={m}), got {tuple(vec.shape)}. "
                "SPEAR needs the layer's bias gradient to recover each sample's scale (Theorem 3.6)."
            )
    for name, t in (("weight", W), ("bias", bvec), ("grad_weight", GW), ("grad_bias", Gb)):
        if not checks.all_finite(t):
            raise InputError(f"{name} contains NaN or Inf; pass the finite tensors the server received")
    size = checks.largest_magnitude(GW)
    if not size > 0:
        raise InputError("grad_weight is all zeros: the update carries no information about the batch")
    if not bool(Gb.abs().amax() > 0):
        raise InputError("grad_bias is all zeros: the scale of each sample cannot be recovered (Theorem 3.6)")
    # the factorization forms sums of squares of the entries: they must neither all underflow to
    # zero nor overflow (float64: 2e-162 .. 1e151; float32: 4e-23 .. 2e16)
    working = torch.finfo(opts.dtype)
    if not math.sqrt(working.tiny * working.eps) <= size <= math.sqrt(working.max) / 1e3:
        raise InputError(
            f"grad_weight's largest entry is {size:.1e}: products of such numbers leave {opts.dtype}'s "
            "range in the factorization; rescale the update (e.g. by a power of 2 for its entries to be "
            "~1; the samples' weights then read scaled by the same factor)"
        )
    if opts.row_noise is not None:
        noise = _as_tensor("row_noise", opts.row_noise)
        if tuple(noise.shape) != (m,) or not bool(torch.isfinite(noise).all()) or bool((noise < 0).any()):
            lowest = float(noise.min()) if noise.numel() else float("nan")
            raise InputError(
                f"row_noise must be ({m},): each row of dL/dW's noise (a norm, finite and >= 0), got "
                f"shape {tuple(noise.shape)} with smallest value {lowest:g}"
            )
        opts = dataclasses.replace(opts, row_noise=noise.to(device=device, dtype=opts.dtype))
    if certifier is not None and not callable(certifier):
        raise InputError(
            "certifier must be a spear.core.certificate.SampleCertifier (e.g. spear.certify.ModelCertifier; "
            f"attack_layer builds the model's) or None, got {type(certifier).__name__}"
        )
    # the attack's precision is the least of the gradient's and its own working dtype
    shown = [GW, Gb] if opts.client_dtype is None else [torch.empty(0, dtype=opts.client_dtype)]
    source_dtype = source_precision(*shown, torch.empty(0, dtype=opts.dtype))
    cast = {"dtype": opts.dtype, "device": device}
    next_gw = None
    if next_grad_weight is not None:
        next_gw = _as_tensor("next_grad_weight", next_grad_weight)
        if next_gw.ndim != 2 or next_gw.shape[1] != m:
            raise InputError(
                f"next_grad_weight must be (k, {m}): the next layer's weight gradient, whose inputs are "
                f"this layer's {m} outputs; got shape {tuple(next_gw.shape)}"
            )
        if not checks.all_finite(next_gw):
            raise InputError("next_grad_weight contains NaN or Inf")
        next_gw = next_gw.to(**cast)
    next_w = None
    if next_weight is not None:
        next_w = _as_tensor("next_weight", next_weight)
        if next_gw is None or tuple(next_w.shape) != tuple(next_gw.shape):
            raise InputError(
                "next_weight must come with next_grad_weight and have its shape (k, m): it is the "
                f"weight of the layer whose gradient that is; got shape {tuple(next_w.shape)}"
            )
        if not checks.all_finite(next_w):
            raise InputError("next_weight contains NaN or Inf")
        next_w = next_w.to(**cast)
    with budget_threads(opts.time_budget):
        return run_attack(
            W.to(**cast),
            bvec.to(**cast),
            GW.to(**cast),
            Gb.to(**cast),
            opts,
            source_dtype,
            next_gw,
            next_w,
            certifier,
            started,
        )


def half_precision(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` rounds coarser than float32 (float16, bfloat16: autocast's)."""
    return torch.finfo(dtype).eps > torch.finfo(torch.float32).eps


def certificate_rtol(tail: torch.nn.Module, dtype: torch.dtype) -> float:
    """The model certificate's misfit tolerance for a client that computed in ``dtype``: the
    dtype's verification tolerance, and for float16 and bfloat16 that many times the weighted
    layers of the tail (at least one). Under autocast every layer of the tail's backward
    rounds its weights, inputs and output to the half dtype, and the errors add up layer by
    layer: a bfloat16 client of the 6-layer MLP (MNIST, width 500) sent columns 0.1 to 0.2
    off the float64 model's, 13 to 27 eps, where the next best label missed by 0.96 or more."""
    rtol = Tolerances.for_dtype(dtype).verify_rtol
    if not half_precision(dtype):
        return rtol
    weighted = sum(isinstance(m, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)) for m in tail.modules())
    return rtol * max(1, weighted)


def _client_precision(
    model: torch.nn.Module,
    tail: torch.nn.Module,
    grads: Mapping[str, Any],
    own: Any,
    working: torch.Tensor,
    told: torch.dtype | None = None,
) -> torch.dtype:
    """The precision of the columns of dL/dZ the model certificate checks: the least precise
    of the layer's weight gradient ``own``, the attack's working dtype and the gradients of
    every layer after it (:func:`stored_precision`). A client that ran only those under
    autocast sends the layer a gradient of float32's precision whose columns were rounded to
    float16's: the layer's own tolerances stay float32's, the certificate's must be float16's.
    ``told``: the option ``client_dtype``, which replaces what the layer's own entries show."""
    if told in SIGNIFICAND_BITS:
        own = torch.empty(0, dtype=told)
    names = {id(p): name for name, p in model.named_parameters()}
    later = [names.get(id(p)) for p in tail.parameters()]
    tensors = [_as_tensor(name, grads[name]) for name in later if name is not None and name in grads]
    return source_precision(_as_tensor("gradient", own), working, *tensors)


@checks.outside_inference_mode
def attack_layer(
    model: torch.nn.Module,
    layer: str,
    gradients: Mapping[str, Any] | Sequence[Any],
    *,
    certify: bool = True,
    loss: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = "cross_entropy",
    sample_weights: SampleWeights | None = None,
    precision_audit: bool = True,
    **options: Any,
) -> Reconstruction:
    """Attack one ``nn.Linear`` layer of ``model`` from the gradients the server received.

    Args:
        model: the global model the server sent (its weights are the ones the gradient was
            computed at).
        layer: the module name of the linear layer, as in ``model.named_modules()``, e.g. "0" or
            "features.fc1".
        gradients: a dict parameter-name -> gradient (``model.named_parameters()`` names), or a
            list in ``model.parameters()`` order.
        certify: check every recovered sample on its own through the rest of the model, which
            also recovers its label (:mod:`spear.certify`; needs a (nested) ``nn.Sequential``
            model, otherwise the result is verified at the layer level only).
        loss: the client's per-sample loss for that check: "cross_entropy" or a callable
            ``loss(logits, labels) -> per-sample losses``.
        sample_weights: for protocols that weight each sample on their own (DP-SGD's clipping:
            ``spear.fl.protocols.ClippedWeights(C)``), ``f(model, inputs, labels) -> (k,)`` the
            weight of each sample up to the common 1/B; the certificate divides it out
            (:class:`spear.certify.WeightedCertifier`). Needs ``layer`` to be the model's first.
        precision_audit: audit a model-verified batch at the precision its data and the
            client's arithmetic give each sample (:func:`spear.core.verdict.audit_precision`).
            Its model of the client assumes it computed in the precision its gradients' entries
            show (:func:`stored_precision`: autocast's float16 or bfloat16 shows): turn it off
            for clients that ran in less and left no trace (TF32 matmuls), whose correct
            batches it refuses.
            A ``verify_rtol`` you set turns it off too (the tolerance is then yours). Without
            the model certificate (``certify=False``, or a ``certifier`` of your own) there is
            no audit.
        **options: as for :func:`reconstruct`.

    Returns:
        The :class:`Reconstruction` of that layer's inputs (the data itself for the first layer,
        hidden activations for deeper ones, and masked data behind a Dropout in training mode:
        see :func:`spear.inversion.base.changes_data`), with ``labels`` when the model
        certified them.

    Raises:
        NoSparsityError: the model shows a non-ReLU activation right after the layer.
    """
    options.setdefault(_CLOCK, time.perf_counter())  # building the model's certifier counts too
    # on one thread where the machine is oversubscribed from the start: the checks of the update
    # and the certifier's construction count in the budget too (review 46b: 0.7 s of checks on
    # 2 spinning threads against a 0.1 s budget, 0.18 s on one)
    with budget_threads(options.get("time_budget")):
        return _attack_prepared(
            model, layer, gradients, certify, loss, sample_weights, precision_audit, options
        )


def _attack_prepared(
    model: torch.nn.Module,
    layer: str,
    gradients: Mapping[str, Any] | Sequence[Any],
    certify: bool,
    loss: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    sample_weights: SampleWeights | None,
    precision_audit: bool,
    options: dict[str, Any],
) -> Reconstruction:
    """:func:`attack_layer`'s checks, certifier and attack."""
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model must be a torch.nn.Module (the global model), got {type(model).__name__}")
    if not (loss == "cross_entropy" or (callable(loss) and not isinstance(loss, str))):
        raise InputError(
            "loss must be 'cross_entropy' or a callable loss(logits, labels) -> per-sample losses, "
            f"got {loss!r:.60}"
        )
    if sample_weights is not None and not callable(sample_weights):
        raise InputError(
            "sample_weights must be a callable f(model, inputs, labels) -> (k,) weights, or None"
        )
    modules = dict(model.named_modules())
    if layer not in modules:
        linear = [name for name, mod in modules.items() if isinstance(mod, torch.nn.Linear)]
        raise InputError(f"model has no module named {layer!r}; its linear layers are {linear}")
    module = modules[layer]
    if not isinstance(module, torch.nn.Linear):
        raise InputError(f"module {layer!r} is a {type(module).__name__}, not torch.nn.Linear")
    if module.bias is None:
        raise InputError(
            f"layer {layer!r} has no bias (bias=False): without dL/db the scale of each sample is not "
            "determined (Theorem 3.6), so spear-fl cannot recover its inputs exactly. Attack a layer "
            "with a bias (one whose bias is zero works: dL/db is still sent)"
        )
    grads = named_gradients(model, gradients)
    prefix = f"{layer}." if layer else ""
    missing = [k for k in (prefix + "weight", prefix + "bias") if k not in grads]
    if missing:
        raise InputError(
            f"gradients lack {missing} (a None gradient counts as missing: did backward() run, and "
            f"does the layer require grad?); available: {sorted(grads)[:10]}"
        )
    if "next_grad_weight" not in options:
        following = _next_linear(model, layer, module, grads)
        if following is not None:
            options["next_grad_weight"] = following[1]
            options.setdefault("next_weight", following[0].weight)
    tail = model_tail(model, layer)
    check_sparsity_side(tail, layer, options.get("sparsity", "output"))
    if certify and tail is not None and "certifier" not in options:
        working_dtype = options.get("dtype", torch.float64)
        working = torch.empty(0, dtype=working_dtype if isinstance(working_dtype, torch.dtype) else None)
        told = options.get("client_dtype")
        dtype = _client_precision(model, tail, grads, grads[prefix + "weight"], working, told)
        rtol = options.get("verify_rtol") or certificate_rtol(tail, dtype)
        saturation = SATURATION_EPS * torch.finfo(dtype).eps
        # a tolerance the user set is theirs: the verdict's precision audit then stays off
        client_dtype = dtype if precision_audit and not options.get("verify_rtol") else None
        half = half_precision(dtype)
        certifier = ModelCertifier(
            tail, module.weight, module.bias, rtol, loss, saturation, client_dtype, half_precision=half
        )
        if sample_weights is not None:
            _check_first_layer(model, layer, "sample_weights")
            certifier = WeightedCertifier(certifier, model, sample_weights)
        options["certifier"] = certifier
    try:
        rec = reconstruct(
            module.weight, module.bias, grads[prefix + "weight"], grads[prefix + "bias"], **options
        )
    except NoSparsityError as exc:
        norms = (
            [] if tail is None else [m for m in tail.modules() if isinstance(m, _BatchNorm) and m.training]
        )
        if not norms:
            raise
        raise NoSparsityError(
            f"{str(exc).rstrip('.')}. The model has {type(norms[0]).__name__} after layer {layer!r}: in "
            "training mode its batch statistics couple the samples, so dL/dZ is dense even with a "
            "ReLU; a client that ran the model in eval mode (and the model passed here in eval mode) "
            "is attacked as usual"
        ) from exc
    below = _linear_below(model, layer)
    attackable = below is not None and modules[below].bias is not None and f"{below}.weight" in grads
    if options.get("sparsity") == "input" and not rec.verified and attackable:
        hint = (
            f"layer {layer!r} takes ReLU outputs of the Linear {below!r}, which output mode attacks "
            f"with the next layer's help: spear.attack_layer(model, {below!r}, gradients) recovers "
            f"that layer's inputs, and a forward pass gives this layer's"
        )
        rec = dataclasses.replace(rec, notes=(*rec.notes, hint))
    return rec


def _linear_below(model: torch.nn.Module, layer: str) -> str | None:
    """The ``nn.Linear`` whose ReLU outputs ``layer`` takes (pass-through modules aside)."""
    below = acting_layers_below(model, layer)
    if len(below) < 2 or not isinstance(below[-1][1], torch.nn.ReLU):
        return None
    return below[-2][0] if isinstance(below[-2][1], torch.nn.Linear) else None


def _check_first_layer(model: torch.nn.Module, layer: str, what: str) -> None:
    """A clear error unless ``layer`` takes the model's inputs: only pass-through modules
    (``Flatten``, ``Identity``, an eval-mode ``Dropout``) run before it."""
    check_takes_the_data(
        model,
        layer,
        f"{what} needs the model's inputs, so it applies to the first layer only",
        "Attack the model's first layer",
    )


def _next_linear(
    model: torch.nn.Module, layer: str, module: torch.nn.Linear, grads: Mapping[str, Any]
) -> tuple[torch.nn.Linear, Any] | None:
    """The next ``nn.Linear`` after ``layer`` (in module order) that takes this layer's outputs
    and its weight gradient, if only ReLUs stand between them and the server has it."""
    modules = list(model.named_modules())
    after = [name for name, _ in modules].index(layer) + 1
    for name, mod in modules[after:]:
        if next(mod.children(), None) is not None:
            continue  # a container: its children follow
        if isinstance(mod, torch.nn.Linear):
            key = f"{name}.weight" if name else "weight"
            fits = mod.in_features == module.out_features and key in grads
            return (mod, grads[key]) if fits else None
        if not isinstance(mod, torch.nn.ReLU):
            return None
    return None
