"""Tiers below the device prefix cache: host memory, a disk directory, a remote store.

`base.Tier` is the one interface a replica talks to them through;
`config.KVConnectorConfig` (MAX's name: the connector is MAX's word for the
configuration of the tiers) configures the disk and remote tiers.
"""

from .base import PageToSave, PrefixQuery, SavePoint, Tier, TierMetrics, TierUsage
from .config import KVConnectorConfig
from .record import Rejection
from .remote import RemoteStoreError

__all__ = [
    "KVConnectorConfig",
    "PageToSave",
    "PrefixQuery",
    "Rejection",
    "RemoteStoreError",
    "SavePoint",
    "Tier",
    "TierMetrics",
    "TierUsage",
]
