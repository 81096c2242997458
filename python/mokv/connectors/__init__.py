"""Tiers below the device prefix cache: host memory, a disk directory, a remote store.

`base.KVConnector` is the one interface a replica talks to them through;
`config.KVConnectorConfig` configures the disk and remote tiers.
"""

from .base import BlockToSave, KVConnector, PrefixQuery, SavePoint, TierMetrics, TierUsage
from .config import KVConnectorConfig
from .record import Rejection
from .remote import RemoteStoreError

__all__ = [
    "BlockToSave",
    "KVConnector",
    "KVConnectorConfig",
    "PrefixQuery",
    "Rejection",
    "RemoteStoreError",
    "SavePoint",
    "TierMetrics",
    "TierUsage",
]
