"""Direction proposers: every way of proposing candidate columns of the disaggregation matrix.

A proposer yields rough directions ``q`` (length b) for which ``L q`` should be sparse. The core
snaps and checks every proposal exactly (:mod:`spear.core.filtering`), so a proposer never has to
be right, only often right. A new strategy is one new file with one :class:`DirectionProposer`.
"""

from spear.core.proposers.base import DirectionProposer, ProposalBatch, ProposalContext
from spear.core.proposers.sampling import RandomSubmatrixSampler

__all__ = ["DirectionProposer", "ProposalBatch", "ProposalContext", "RandomSubmatrixSampler"]
