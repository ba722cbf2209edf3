"""The DHT: Kademlia over the Node's RPC, with expiring values, subkeys and owned records.

See :class:`DHT` for the API and ``docs/ARCHITECTURE.md`` for where it sits.
"""

from typing import TYPE_CHECKING

from p2p.lazy import exports

if TYPE_CHECKING:
    from .dht import DHT, DHTBootstrapError, DHTConfig
    from .events import DHTMode
    from .records import (
        ContentMismatch,
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
        content_subkey,
        owned,
        sign_record,
    )

__all__ = [
    "ContentMismatch",
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
    "content_subkey",
    "owned",
    "sign_record",
]

__getattr__, __dir__ = exports(__name__, {
    "DHT": ".dht",
    "DHTBootstrapError": ".dht",
    "DHTConfig": ".dht",
    "DHTMode": ".events",
    "ContentMismatch": ".records",
    "DHTError": ".records",
    "DHTKey": ".records",
    "DHTRecord": ".records",
    "ExpirationTooFar": ".records",
    "InvalidKey": ".records",
    "InvalidSignature": ".records",
    "MalformedRecord": ".records",
    "RecordTooLarge": ".records",
    "Schema": ".records",
    "SchemaViolation": ".records",
    "StoreFull": ".records",
    "StoreQuotaExceeded": ".records",
    "StoreRejected": ".records",
    "ValueWithExpiration": ".records",
    "content_subkey": ".records",
    "owned": ".records",
    "sign_record": ".records",
})
