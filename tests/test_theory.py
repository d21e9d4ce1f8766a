import itertools
import math

import pytest
from scipy import stats

from spear import theory
from spear.errors import TheoryError


def test_tau_worked_example():
    # Section 4.1: m = 400, p_fr < 1e-5 gives tau = 0.395
    assert theory.sparsity_threshold(400, 1e-5) == pytest.approx(0.395)
    k = theory.sparsity_threshold_count(400, 1e-5)
    assert stats.binom.cdf(k - 1, 400, 0.5) < 1e-5 <= stats.binom.cdf(k, 400, 0.5)
    assert theory.false_rejection_rate(400, 0.395) < 1e-5


def test_lemma_5_2_worked_example():
    # Section 5.2: n*_total ~ 1.8e5 for b = 16
    assert theory.expected_proposals(16) == pytest.approx(1.8e5, rel=0.02)
    assert theory.expected_proposals_approx(16) == pytest.approx(theory.expected_proposals(16), rel=0.01)


def test_lemma_a_1_worked_example():
    # Appendix A: n ~ 4e4 for b = 10, p = 1e-8
    assert theory.proposals_for_confidence(10, 1e-8) == pytest.approx(4e4, rel=0.1)


def test_lemma_5_1_formula():
    b = 12
    assert theory.success_probability_lower_bound(b) == pytest.approx(
        b / 2 ** (b - 1) * (1 - 0.939 ** (b - 1))
    )


def test_more_proposals_for_larger_batches():
    values = [theory.expected_proposals(b) for b in range(2, 30)]
    assert all(a < c for a, c in itertools.pairwise(values))


def test_failure_bounds_order_and_range():
    for m, b in [(20, 4), (40, 8), (40, 10), (200, 20)]:
        ub = theory.failure_probability_upper_bound(m, b, 1e-5)
        approx = theory.failure_probability_approx(m, b, 1e-5)
        assert 0 <= approx <= ub
    # wider layers fail less often
    assert theory.failure_probability_approx(40, 10) > theory.failure_probability_approx(80, 10)


def test_failure_bound_is_false_rejection_term_for_wide_layers():
    b, p_fr = 20, 1e-5
    assert theory.failure_probability_upper_bound(2000, b, p_fr) == pytest.approx(
        1 - (1 - p_fr) ** b, rel=1e-6
    )


def test_confidence_needs_more_than_expectation():
    assert theory.proposals_for_confidence(16, 1e-3) > theory.expected_proposals(16) * 0.5
    assert theory.proposals_for_confidence(16, 1e-6) > theory.proposals_for_confidence(16, 1e-3)


@pytest.mark.parametrize(
    "call",
    [
        lambda: theory.sparsity_threshold(0, 1e-5),
        lambda: theory.sparsity_threshold(100, 0.0),
        lambda: theory.sparsity_threshold(100, 1.5),
        lambda: theory.expected_proposals(1),
        lambda: theory.failure_probability_upper_bound(10, 20),
        lambda: theory.proposals_for_confidence(20, 1e-6, p_fr=1e-3),
        lambda: theory.summarize(20, 20),
    ],
)
def test_invalid_parameters_raise(call):
    with pytest.raises(TheoryError):
        call()


def test_summary_fields():
    s = theory.summarize(20, 200)
    assert s.tau == pytest.approx(s.threshold_count / 200)
    assert math.isfinite(s.expected_proposals) and s.proposals_99 > 0
    assert set(s.as_dict()) >= {"tau", "expected_proposals", "failure_upper_bound"}
