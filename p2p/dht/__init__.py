"""The DHT: Kademlia over the Node's RPC, with expiring values, subkeys and owned records.

See :class:`DHT` for the API and ``docs/ARCHITECTURE.md`` for where it sits.
"""

from .dht import DHT, DHTBootstrapError, DHTConfig
from .events import DHTMode
from .records import (
    DHTError,
    DHTKey,
    DHTRecord,
    ExpirationTooFar,
    InvalidKey,
    InvalidSignature,
    MalformedRecord,
    RecordTooLarge,
    Schema,
    SchemaViolation,
    StoreFull,
    StoreQuotaExceeded,
    StoreRejected,
    ValueWithExpiration,
    owned,
    sign_record,
)

__all__ = [
    "DHT",
    "DHTBootstrapError",
    "DHTConfig",
    "DHTError",
    "DHTMode",
    "DHTKey",
    "DHTRecord",
    "ExpirationTooFar",
    "InvalidKey",
    "InvalidSignature",
    "MalformedRecord",
    "RecordTooLarge",
    "Schema",
    "SchemaViolation",
    "StoreFull",
    "StoreQuotaExceeded",
    "StoreRejected",
    "ValueWithExpiration",
    "owned",
    "sign_record",
]
