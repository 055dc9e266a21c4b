"""kvplug: keep the attention KV cache an LLM engine computed, and load it back.

The public API. Importing ``kvplug`` does not import torch; the torch-facing names
(``CacheEngine``, ``ChunkStore``, ``KVLayout``, ``Serializer``, ``KVConnector``) load on
first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from kvplug.core.admission import (
    AdmissionConfig,
    AdmissionPolicy,
    AdmitAll,
    AdmitAllConfig,
    FrequencyAdmission,
    FrequencyAdmissionConfig,
    FrequencySketch,
    make_admission_policy,
)
from kvplug.core.background import BackgroundWorker
from kvplug.core.chunk_format import DTYPE_SIZES as CHUNK_DTYPE_SIZES
from kvplug.core.chunk_format import MAGIC as RAW_FRAME_MAGIC
from kvplug.core.chunk_format import dtype_name
from kvplug.core.components import ComponentConfig, EmptyConfig, EngineAdapter
from kvplug.core.config_types import (
    BackoffSeconds,
    Bounded,
    Concurrency,
    FailureCount,
    QueueItems,
    ThreadCount,
    TimeoutMilliseconds,
    TimeoutSeconds,
)
from kvplug.core.control_protocol import CONTROL_PROTOCOL_VERSION, ControlRequest
from kvplug.core.control_protocol import encode_request as encode_control_request
from kvplug.core.control_socket import (
    LOOKUP_DIR_ENV,
    check_socket_file,
    foreign_peer,
    private_socket_dir,
    remove_stale_sockets,
)
from kvplug.core.events import KVEvent
from kvplug.core.eviction import EvictionName, EvictionPolicy, LRUPolicy, S3FIFOPolicy, make_eviction_policy
from kvplug.core.guarded_eviction import GuardedEviction, PinOutcome
from kvplug.core.keys import KV_FORMAT_VERSION, ChunkKey, ExtraKey, Fingerprint, KeyBuilder, RequestInfo
from kvplug.core.locations import ChunkLocation, merge_locations
from kvplug.core.message_server import MessageServer, ServerLimits
from kvplug.core.metrics import EngineMetrics, MetricSample
from kvplug.core.pins import pin_keys, unpin_keys
from kvplug.core.queue_settings import OldQueueKey, QueueSettings
from kvplug.core.record import (
    RECORD_HEADER_SIZE,
    check_record_size,
    key_digest,
    pack_record,
    pack_record_header,
    unpack_record,
)
from kvplug.core.record_backend import SIZE_UNKNOWN, CallSizes, RecordBackend, RecordToWrite
from kvplug.core.record_index import RecordIndex
from kvplug.core.record_store import RecordCheck, RecordStore, StoredRecord, check_record
from kvplug.core.record_tier import RecordTier
from kvplug.core.remote import (
    LoopThread,
    RecordTierConfig,
    RemoteCalls,
    RemoteTierConfig,
    call_budget,
    remaining_budget_s,
)
from kvplug.core.retry import Absent, CircuitBreaker, FailureKind, RetryPolicy, classify_failure
from kvplug.core.tenancy import (
    OTHER_TENANTS,
    UNSALTED,
    NameTenants,
    PinBook,
    PinReport,
    PinSpec,
    Tenancy,
    TenancySettings,
    TenantBook,
)
from kvplug.core.tenants import TenancyConfig, TenantLabels
from kvplug.core.tier import (
    MEDIA,
    UNBOUNDED_BYTES,
    Buffer,
    MappedFile,
    Medium,
    StorageTier,
    TierConfig,
    TierContext,
    TierStats,
    is_mapped_file,
)
from kvplug.core.tier_chain import TierChain
from kvplug.core.version import KVPLUG_VERSION
from kvplug.hookspecs import hookimpl
from kvplug.redaction import SECRET_MASK, is_secret_name, redact, redact_text, redact_url

__version__ = KVPLUG_VERSION

_LAZY = {
    "CacheEngine": "kvplug.core.engine",
    "ChunkStore": "kvplug.core.chunk_store",
    "LoadedChunks": "kvplug.core.chunk_store",
    "LayerwiseRetrieve": "kvplug.core.layerwise_retrieve",
    "HeadRecords": "kvplug.core.head_shards",
    "HeadShard": "kvplug.core.head_shards",
    "RetrieveTimings": "kvplug.core.layerwise_retrieve",
    "TorchConnector": "kvplug.builtins.torch_connector",
    "KVLayout": "kvplug.core.layouts",
    "PagedFormat": "kvplug.core.layouts",
    "slots_from_block_ids": "kvplug.core.layouts",
    "Serializer": "kvplug.core.serializer",
    "make_serializer": "kvplug.core.serializer_factory",
    "KVConnector": "kvplug.core.connector",
    "KVPlugConfig": "kvplug.core.config",
    "load_config": "kvplug.core.config_loader",
    "get_registry": "kvplug.core.plugins",
    "ControlServer": "kvplug.core.control_server",
    "ControlIdentity": "kvplug.core.control_server",
    "control_socket_path": "kvplug.core.control_server",
    "ClearKeys": "kvplug.core.control_target",
    "ControlTarget": "kvplug.core.control_target",
    "EngineControl": "kvplug.core.control_target",
    "PluginRegistry": "kvplug.core.plugins",
}

if TYPE_CHECKING:
    from kvplug.builtins.torch_connector import TorchConnector
    from kvplug.core.chunk_store import ChunkStore, LoadedChunks
    from kvplug.core.config import KVPlugConfig
    from kvplug.core.config_loader import load_config
    from kvplug.core.connector import KVConnector
    from kvplug.core.control_server import ControlIdentity, ControlServer, control_socket_path
    from kvplug.core.control_target import ClearKeys, ControlTarget, EngineControl
    from kvplug.core.engine import CacheEngine
    from kvplug.core.head_shards import HeadRecords, HeadShard
    from kvplug.core.layerwise_retrieve import LayerwiseRetrieve, RetrieveTimings
    from kvplug.core.layouts import KVLayout, PagedFormat, slots_from_block_ids
    from kvplug.core.plugins import PluginRegistry, get_registry
    from kvplug.core.serializer import Serializer
    from kvplug.core.serializer_factory import make_serializer


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvplug' has no attribute {name!r}")
    return getattr(import_module(module), name)


__all__ = [
    "CHUNK_DTYPE_SIZES",
    "CONTROL_PROTOCOL_VERSION",
    "KV_FORMAT_VERSION",
    "LOOKUP_DIR_ENV",
    "MEDIA",
    "OTHER_TENANTS",
    "RAW_FRAME_MAGIC",
    "RECORD_HEADER_SIZE",
    "SECRET_MASK",
    "SIZE_UNKNOWN",
    "UNBOUNDED_BYTES",
    "UNSALTED",
    "Absent",
    "AdmissionConfig",
    "AdmissionPolicy",
    "AdmitAll",
    "AdmitAllConfig",
    "BackgroundWorker",
    "BackoffSeconds",
    "Bounded",
    "Buffer",
    "CacheEngine",
    "CallSizes",
    "ChunkKey",
    "ChunkLocation",
    "ChunkStore",
    "CircuitBreaker",
    "ClearKeys",
    "ComponentConfig",
    "Concurrency",
    "ControlIdentity",
    "ControlRequest",
    "ControlServer",
    "ControlTarget",
    "EmptyConfig",
    "EngineAdapter",
    "EngineControl",
    "EngineMetrics",
    "EvictionName",
    "EvictionPolicy",
    "ExtraKey",
    "FailureCount",
    "FailureKind",
    "Fingerprint",
    "FrequencyAdmission",
    "FrequencyAdmissionConfig",
    "FrequencySketch",
    "GuardedEviction",
    "HeadRecords",
    "HeadShard",
    "KVConnector",
    "KVEvent",
    "KVLayout",
    "KVPlugConfig",
    "KeyBuilder",
    "LRUPolicy",
    "LayerwiseRetrieve",
    "LoadedChunks",
    "LoopThread",
    "MappedFile",
    "Medium",
    "MessageServer",
    "MetricSample",
    "NameTenants",
    "OldQueueKey",
    "PagedFormat",
    "PinBook",
    "PinOutcome",
    "PinReport",
    "PinSpec",
    "PluginRegistry",
    "QueueItems",
    "QueueSettings",
    "RecordBackend",
    "RecordCheck",
    "RecordIndex",
    "RecordStore",
    "RecordTier",
    "RecordTierConfig",
    "RecordToWrite",
    "RemoteCalls",
    "RemoteTierConfig",
    "RequestInfo",
    "RetrieveTimings",
    "RetryPolicy",
    "S3FIFOPolicy",
    "Serializer",
    "ServerLimits",
    "StorageTier",
    "StoredRecord",
    "Tenancy",
    "TenancyConfig",
    "TenancySettings",
    "TenantBook",
    "TenantLabels",
    "ThreadCount",
    "TierChain",
    "TierConfig",
    "TierContext",
    "TierStats",
    "TimeoutMilliseconds",
    "TimeoutSeconds",
    "TorchConnector",
    "__version__",
    "call_budget",
    "check_record",
    "check_record_size",
    "check_socket_file",
    "classify_failure",
    "control_socket_path",
    "dtype_name",
    "encode_control_request",
    "foreign_peer",
    "get_registry",
    "hookimpl",
    "is_mapped_file",
    "is_secret_name",
    "key_digest",
    "load_config",
    "make_admission_policy",
    "make_eviction_policy",
    "make_serializer",
    "merge_locations",
    "pack_record",
    "pack_record_header",
    "pin_keys",
    "private_socket_dir",
    "redact",
    "redact_text",
    "redact_url",
    "remaining_budget_s",
    "remove_stale_sockets",
    "slots_from_block_ids",
    "unpack_record",
    "unpin_keys",
]
