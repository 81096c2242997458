"""The verified prefix index and the chained page hashing, below both the
device page pool (`mokv.paged`) and the tiers (`mokv.tiers`), which share them."""

from .hashing import ROOT, PageHasher, salted_root
from .index import NO_UID, PageIndex

__all__ = ["NO_UID", "ROOT", "PageHasher", "PageIndex", "salted_root"]
