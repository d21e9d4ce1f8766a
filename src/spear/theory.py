"""SPEAR's theory (Section 5.2 and Appendix A of Dimitrov et al., 2024) as plain functions.

All functions assume, as the paper does, that every entry of dL/dZ is zero independently with
probability 1/2 (ReLU at initialisation). They are exact evaluations of the printed formulas;
no function here touches gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import special, stats

from spear.errors import TheoryError

#: Tao & Vu (2005) bound used by the paper: P(random b x b Bernoulli matrix singular) <= 0.939^b.
SINGULARITY_BASE_BOUND = 0.939
#: Euler-Mascheroni constant, in the approximation of Lemma 5.2.
EULER_GAMMA = 0.5772156649015329


def _check_int(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise TheoryError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_prob(name: str, value: float, *, allow_zero: bool = False) -> None:
    low_ok = value >= 0 if allow_zero else value > 0
    if not (isinstance(value, (float, int)) and low_ok and value < 1):
        bound = "[0, 1)" if allow_zero else "(0, 1)"
        raise TheoryError(f"{name} must be a probability in {bound}, got {value!r}")


def sparsity_threshold_count(m: int, p_fr: float) -> int:
    """Smallest zero count a correct direction must have to be accepted (Section 4.1).

    Algorithm 1 accepts a proposal when ``sparsity(L q) >= tau * m``. A correct column of dL/dZ
    has Binomial(m, 1/2) zeros, so it is falsely rejected with probability
    ``P[Bin(m, 1/2) <= tau*m - 1]``. We return the largest count ``k`` with
    ``P[Bin(m, 1/2) <= k - 1] < p_fr``. (The paper prints the sum up to ``floor(m tau)``; its
    worked example ``tau = 0.395`` for ``m = 400``, ``p_fr < 1e-5`` follows the acceptance rule
    of Algorithm 1, which is what we implement.)
    """
    _check_int("m", m, 1)
    _check_prob("p_fr", p_fr)
    # cdf(k - 1) is increasing in k: find the largest k with cdf(k - 1) < p_fr.
    ks = np.arange(0, m + 1)
    cdf_below = stats.binom.cdf(ks - 1, m, 0.5)
    admissible = ks[cdf_below < p_fr]
    return int(admissible.max())


def sparsity_threshold(m: int, p_fr: float = 1e-5) -> float:
    """The paper's tau for a layer of width ``m`` and false-rejection rate ``p_fr`` (Section 4.1).

    >>> sparsity_threshold(400, 1e-5)
    0.395
    """
    return sparsity_threshold_count(m, p_fr) / m


def false_rejection_rate(m: int, tau: float) -> float:
    """Probability that a correct direction has fewer than ``tau * m`` zeros (Section 4.1)."""
    _check_int("m", m, 1)
    k = math.ceil(tau * m - 1e-12)
    return float(stats.binom.cdf(k - 1, m, 0.5))


def success_probability_lower_bound(b: int) -> float:
    """Lemma 5.1: lower bound on q, the probability that one random (b-1)-row submatrix of
    dL/dZ has exactly one all-zero column and full rank: ``q >= b / 2^(b-1) (1 - 0.939^(b-1))``.
    """
    _check_int("b", b, 2)
    return b / 2 ** (b - 1) * (1 - SINGULARITY_BASE_BOUND ** (b - 1))


def expected_proposals(b: int) -> float:
    """Lemma 5.2: expected number of sampled submatrices until all b directions are found,
    ``n*_total = b H_b / q`` (coupon collector), with q from Lemma 5.1.

    >>> round(expected_proposals(16), -4)
    180000.0
    """
    q = success_probability_lower_bound(b)
    if q == 0.0:  # below float64's range (b >~ 1075): the count is beyond it too
        return math.inf
    harmonic = sum(1.0 / k for k in range(1, b + 1))
    return b * harmonic / q


def expected_proposals_approx(b: int) -> float:
    """Lemma 5.2's approximation ``(b log b + gamma b + 1/2) / q``."""
    q = success_probability_lower_bound(b)
    if q == 0.0:
        return math.inf
    return (b * math.log(b) + EULER_GAMMA * b + 0.5) / q


def _log_binom_pmf_half(m: int) -> np.ndarray:
    ks = np.arange(0, m + 1)
    return stats.binom.logpmf(ks, m, 0.5)


def _exists_probability(m: int, b: int, base: float) -> float:
    """P[dL/dZ holds a full-rank (b-1)-row submatrix with column i all zero] (proof of 5.3)."""
    ks = np.arange(b - 1, m + 1)
    log_pmf = _log_binom_pmf_half(m)[b - 1 :]
    # number of (b-1)-subsets of the k zero rows; 1 - base^((b-1) C(k, b-1))
    log_subsets = special.gammaln(ks + 1) - special.gammaln(b) - special.gammaln(ks - b + 2)
    with np.errstate(over="ignore"):  # C(k, b-1) beyond float range: -inf, as intended
        exponent = (b - 1) * np.exp(log_subsets) * math.log(base)  # <= 0, may be -inf
    all_singular = np.exp(exponent)
    return float(np.sum(np.exp(log_pmf) * (1.0 - all_singular)))


def failure_probability_upper_bound(m: int, b: int, p_fr: float = 1e-5) -> float:
    """Lemma 5.3, upper bound on the failure probability of exhaustive SPEAR:
    ``b (1 - sum_k C(m,k) 2^-m (1 - 0.939^((b-1) C(k,b-1)))) + 1 - (1 - p_fr)^b``.
    """
    _check_int("m", m, 2)
    _check_int("b", b, 2)
    _check_prob("p_fr", p_fr, allow_zero=True)
    if b > m:
        raise TheoryError(f"batch size b={b} must not exceed the layer width m={m}")
    exists = _exists_probability(m, b, SINGULARITY_BASE_BOUND)
    return b * (1.0 - exists) + 1.0 - (1.0 - p_fr) ** b


def failure_probability_approx(m: int, b: int, p_fr: float = 1e-5) -> float:
    """Lemma 5.3, approximation (independent full-rankness with probability 1 - 0.5^(b-1)):
    ``1 - (sum_k C(m,k) 2^-m (1 - 0.5^((b-1) C(k,b-1))))^b + 1 - (1 - p_fr)^b``.
    """
    _check_int("m", m, 2)
    _check_int("b", b, 2)
    _check_prob("p_fr", p_fr, allow_zero=True)
    if b > m:
        raise TheoryError(f"batch size b={b} must not exceed the layer width m={m}")
    exists = _exists_probability(m, b, 0.5)
    return 1.0 - exists**b + 1.0 - (1.0 - p_fr) ** b


def proposals_for_confidence(b: int, p: float, p_fr: float = 0.0) -> float:
    """Lemma A.1: number of proposals after which all b directions are found with probability
    at least ``1 - p``. Solves ``p*/2 = Phi((c - n q) / sqrt(n q (1 - q)))`` for n, with
    ``c = b log(2b / p*)`` and ``p* = p - 1 + (1 - p_fr)^b``.

    >>> round(proposals_for_confidence(10, 1e-8), -4)
    40000.0
    """
    _check_int("b", b, 2)
    _check_prob("p", p)
    _check_prob("p_fr", p_fr, allow_zero=True)
    p_star = p - 1.0 + (1.0 - p_fr) ** b
    if p_star <= 0:
        raise TheoryError(
            f"p={p} is below the failure probability {1 - (1 - p_fr) ** b:.3g} caused by false "
            f"rejections alone (p_fr={p_fr}, b={b}); choose a larger p or a smaller p_fr"
        )
    q = success_probability_lower_bound(b)
    c = b * math.log(2 * b / p_star)
    z = abs(float(stats.norm.ppf(p_star / 2)))
    spread = math.sqrt(q * (1 - q))
    # n q - c = z sqrt(n q (1-q)): a quadratic in s = sqrt(n)
    s = (z * spread + math.sqrt(z * z * q * (1 - q) + 4 * q * c)) / (2 * q)
    return s * s


@dataclass(frozen=True)
class TheorySummary:
    """All of Section 5.2's numbers for one (batch size, width) pair."""

    batch_size: int
    width: int
    p_fr: float
    tau: float
    threshold_count: int
    q_lower_bound: float
    expected_proposals: float
    proposals_99: float
    failure_upper_bound: float
    failure_approx: float

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def summarize(b: int, m: int, p_fr: float = 1e-5) -> TheorySummary:
    """Every bound of Section 5.2 and Appendix A for batch size ``b`` and width ``m``."""
    _check_int("b", b, 2)
    _check_int("m", m, 2)
    if b >= m:
        raise TheoryError(f"SPEAR needs batch size b={b} below the layer width m={m}")
    return TheorySummary(
        batch_size=b,
        width=m,
        p_fr=p_fr,
        tau=sparsity_threshold(m, p_fr),
        threshold_count=sparsity_threshold_count(m, p_fr),
        q_lower_bound=success_probability_lower_bound(b),
        expected_proposals=expected_proposals(b),
        proposals_99=proposals_for_confidence(b, 1e-2, p_fr) if (1 - p_fr) ** b > 0.99 else math.inf,
        failure_upper_bound=min(1.0, failure_probability_upper_bound(m, b, p_fr)),
        failure_approx=min(1.0, failure_probability_approx(m, b, p_fr)),
    )
