"""kvplug: keep the attention KV cache an LLM engine computed, and load it back.

The plugin API (docs/api.md): every name a plugin or an engine adapter uses, and nothing
else; the rest of the package (``kvplug.core``, ``kvplug.builtins``, ``kvplug.cli``) is
internal. Importing ``kvplug`` imports none of it: each name loads on first use, so a
command that needs tiers alone never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.core.lazy_module import lazy_exports
from kvplug.core.version import KVPLUG_VERSION
from kvplug.hookspecs import hookimpl

__version__ = KVPLUG_VERSION

#: name -> (module, name there)
_LAZY: dict[str, tuple[str, str]] = {
    "Absent": ("kvplug.core.remote.retry", "Absent"),
    "BackoffSeconds": ("kvplug.core.config_types", "BackoffSeconds"),
    "Bounded": ("kvplug.core.config_types", "Bounded"),
    "Buffer": ("kvplug.core.tier", "Buffer"),
    "CHUNK_DTYPE_SIZES": ("kvplug.core.chunk_format", "DTYPE_SIZES"),
    "CacheEngine": ("kvplug.core.engine.cache_engine", "CacheEngine"),
    "CallSizes": ("kvplug.core.records.backend", "CallSizes"),
    "CircuitBreaker": ("kvplug.core.remote.retry", "CircuitBreaker"),
    "ChunkKey": ("kvplug.core.keys", "ChunkKey"),
    "ChunkStore": ("kvplug.core.engine.chunk_store", "ChunkStore"),
    "ClearKeys": ("kvplug.core.control.target", "ClearKeys"),
    "ComponentConfig": ("kvplug.core.components", "ComponentConfig"),
    "Concurrency": ("kvplug.core.config_types", "Concurrency"),
    "ControlIdentity": ("kvplug.core.control.server", "ControlIdentity"),
    "ControlRequest": ("kvplug.core.control.protocol", "ControlRequest"),
    "ControlServer": ("kvplug.core.control.server", "ControlServer"),
    "ControlTarget": ("kvplug.core.control.target", "ControlTarget"),
    "EmptyConfig": ("kvplug.core.components", "EmptyConfig"),
    "EngineAdapter": ("kvplug.core.components", "EngineAdapter"),
    "EngineControl": ("kvplug.core.control.target", "EngineControl"),
    "EvictionName": ("kvplug.core.policies.eviction", "EvictionName"),
    "ExtraKey": ("kvplug.core.keys", "ExtraKey"),
    "FailureCount": ("kvplug.core.config_types", "FailureCount"),
    "FailureKind": ("kvplug.core.remote.retry", "FailureKind"),
    "Fingerprint": ("kvplug.core.keys", "Fingerprint"),
    "GuardedEviction": ("kvplug.core.policies.guarded_eviction", "GuardedEviction"),
    "HeadShard": ("kvplug.core.engine.head_shards", "HeadShard"),
    "HeldChange": ("kvplug.core.held_chunks", "HeldChange"),
    "HeldChunks": ("kvplug.core.held_chunks", "HeldChunks"),
    "KVConnector": ("kvplug.core.connector", "KVConnector"),
    "KVEvent": ("kvplug.core.events", "KVEvent"),
    "KVLayout": ("kvplug.core.layouts", "KVLayout"),
    "KVPlugConfig": ("kvplug.core.config.model", "KVPlugConfig"),
    "LazyModule": ("kvplug.core.lazy_module", "LazyModule"),
    "LOOKUP_DIR_ENV": ("kvplug.core.control_socket", "LOOKUP_DIR_ENV"),
    "LayerwiseRetrieve": ("kvplug.core.engine.layerwise_retrieve", "LayerwiseRetrieve"),
    "MEDIA": ("kvplug.core.tier", "MEDIA"),
    "MappedFile": ("kvplug.core.tier", "MappedFile"),
    "Medium": ("kvplug.core.tier", "Medium"),
    "MessageServer": ("kvplug.core.control.message_server", "MessageServer"),
    "MetricSample": ("kvplug.core.metrics", "MetricSample"),
    "NameTenants": ("kvplug.core.tenancy", "NameTenants"),
    "FOLDER_PINNED_BYTES": ("kvplug.core.tenants", "FOLDER_PINNED_BYTES"),
    "FOLDER_TENANT_BYTES": ("kvplug.core.tenants", "FOLDER_TENANT_BYTES"),
    "OrderedEvents": ("kvplug.core.events", "OrderedEvents"),
    "PagedFormat": ("kvplug.core.layouts", "PagedFormat"),
    "PinOutcome": ("kvplug.core.policies.guarded_eviction", "PinOutcome"),
    "SharedPins": ("kvplug.core.pin_ledger", "SharedPins"),
    "PinReport": ("kvplug.core.tenancy", "PinReport"),
    "PluginRegistry": ("kvplug.core.plugins", "PluginRegistry"),
    "QueueItems": ("kvplug.core.config_types", "QueueItems"),
    "QueueSettings": ("kvplug.core.queue_settings", "QueueSettings"),
    "RAW_FRAME_MAGIC": ("kvplug.core.chunk_format", "MAGIC"),
    "RECORD_HEADER_SIZE": ("kvplug.core.records.frame", "RECORD_HEADER_SIZE"),
    "RecordBackend": ("kvplug.core.records.backend", "RecordBackend"),
    "RecordCheck": ("kvplug.core.records.store", "RecordCheck"),
    "RecordStore": ("kvplug.core.records.store", "RecordStore"),
    "RecordTier": ("kvplug.core.records.tier", "RecordTier"),
    "RecordTierConfig": ("kvplug.core.remote.calls", "RecordTierConfig"),
    "RecordToWrite": ("kvplug.core.records.backend", "RecordToWrite"),
    "RemoteTierConfig": ("kvplug.core.remote.calls", "RemoteTierConfig"),
    "RequestInfo": ("kvplug.core.keys", "RequestInfo"),
    "StoreKey": ("kvplug.core.keys", "StoreKey"),
    "ChunkLocation": ("kvplug.core.engine.locations", "ChunkLocation"),
    "merge_locations": ("kvplug.core.engine.locations", "merge_locations"),
    "hit_tokens": ("kvplug.core.engine.locations", "hit_tokens"),
    "control_socket_path": ("kvplug.core.control.server", "control_socket_path"),
    "encode_control_request": ("kvplug.core.control.protocol", "encode_request"),
    "control_request_fields": ("kvplug.core.control.protocol", "request_fields"),
    "exchange_control_request": ("kvplug.core.control.protocol", "exchange"),
    "KeyPrefix": ("kvplug.core.keys", "KeyPrefix"),
    "SECRET_MASK": ("kvplug.redaction", "SECRET_MASK"),
    "SIZE_UNKNOWN": ("kvplug.core.records.backend", "SIZE_UNKNOWN"),
    "Serializer": ("kvplug.core.serializer", "Serializer"),
    "ServerLimits": ("kvplug.core.control.message_server", "ServerLimits"),
    "StorageTier": ("kvplug.core.tier", "StorageTier"),
    "StoredRecord": ("kvplug.core.records.store", "StoredRecord"),
    "Tenancy": ("kvplug.core.tenancy", "Tenancy"),
    "TenancySettings": ("kvplug.core.tenancy_settings", "TenancySettings"),
    "ThreadCount": ("kvplug.core.config_types", "ThreadCount"),
    "TierChain": ("kvplug.core.chain.tier_chain", "TierChain"),
    "TierConfig": ("kvplug.core.tier", "TierConfig"),
    "TierContext": ("kvplug.core.tier", "TierContext"),
    "TierStats": ("kvplug.core.tier", "TierStats"),
    "TimeoutSeconds": ("kvplug.core.config_types", "TimeoutSeconds"),
    "TorchConnector": ("kvplug.builtins.torch_connector", "TorchConnector"),
    "UNBOUNDED_BYTES": ("kvplug.core.tier", "UNBOUNDED_BYTES"),
    "WriteRefusals": ("kvplug.core.remote.refusals", "WriteRefusals"),
    "OpeningWarnings": ("kvplug.core.remote.opening_warnings", "OpeningWarnings"),
    "bound_share": ("kvplug.core.tenancy_settings", "bound_share"),
    "check_record": ("kvplug.core.records.store", "check_record"),
    "check_record_size": ("kvplug.core.records.frame", "check_record_size"),
    "check_socket_file": ("kvplug.core.control_socket", "check_socket_file"),
    "classify_failure": ("kvplug.core.remote.retry", "classify_failure"),
    "did_you_mean": ("kvplug.core.config.problems", "did_you_mean"),
    "dtype_name": ("kvplug.core.chunk_format", "dtype_name"),
    "get_registry": ("kvplug.core.plugins", "get_registry"),
    "is_mapped_file": ("kvplug.core.tier", "is_mapped_file"),
    "is_secret_name": ("kvplug.redaction", "is_secret_name"),
    "key_digest": ("kvplug.core.records.frame", "key_digest"),
    "load_config": ("kvplug.core.config.loader", "load_config"),
    "parse_share": ("kvplug.core.tenancy_settings", "parse_share"),
    "pin_keys": ("kvplug.core.pins", "pin_keys"),
    "private_socket_dir": ("kvplug.core.control_socket", "private_socket_dir"),
    "redact": ("kvplug.redaction", "redact"),
    "redact_text": ("kvplug.redaction", "redact_text"),
    "redact_url": ("kvplug.redaction", "redact_url"),
    "remove_stale_sockets": ("kvplug.core.control_socket", "remove_stale_sockets"),
    "slots_from_block_ids": ("kvplug.core.layouts", "slots_from_block_ids"),
    "unpack_record": ("kvplug.core.records.frame", "unpack_record"),
    "unpin_keys": ("kvplug.core.pins", "unpin_keys"),
}

if TYPE_CHECKING:
    from kvplug.builtins.torch_connector import TorchConnector
    from kvplug.core.chain.tier_chain import TierChain
    from kvplug.core.chunk_format import DTYPE_SIZES as CHUNK_DTYPE_SIZES
    from kvplug.core.chunk_format import MAGIC as RAW_FRAME_MAGIC
    from kvplug.core.chunk_format import dtype_name
    from kvplug.core.components import ComponentConfig, EmptyConfig, EngineAdapter
    from kvplug.core.config.loader import load_config
    from kvplug.core.config.model import KVPlugConfig
    from kvplug.core.config.problems import did_you_mean
    from kvplug.core.config_types import (
        BackoffSeconds,
        Bounded,
        Concurrency,
        FailureCount,
        QueueItems,
        ThreadCount,
        TimeoutSeconds,
    )
    from kvplug.core.connector import KVConnector
    from kvplug.core.control.message_server import MessageServer, ServerLimits
    from kvplug.core.control.protocol import ControlRequest
    from kvplug.core.control.protocol import encode_request as encode_control_request
    from kvplug.core.control.protocol import exchange as exchange_control_request
    from kvplug.core.control.protocol import request_fields as control_request_fields
    from kvplug.core.control.server import ControlIdentity, ControlServer, control_socket_path
    from kvplug.core.control.target import ClearKeys, ControlTarget, EngineControl
    from kvplug.core.control_socket import LOOKUP_DIR_ENV, check_socket_file, private_socket_dir, remove_stale_sockets
    from kvplug.core.engine.cache_engine import CacheEngine
    from kvplug.core.engine.chunk_store import ChunkStore
    from kvplug.core.engine.head_shards import HeadShard
    from kvplug.core.engine.layerwise_retrieve import LayerwiseRetrieve
    from kvplug.core.engine.locations import ChunkLocation, hit_tokens, merge_locations
    from kvplug.core.events import KVEvent, OrderedEvents
    from kvplug.core.held_chunks import HeldChange, HeldChunks
    from kvplug.core.keys import ChunkKey, ExtraKey, Fingerprint, KeyPrefix, RequestInfo, StoreKey
    from kvplug.core.layouts import KVLayout, PagedFormat, slots_from_block_ids
    from kvplug.core.lazy_module import LazyModule
    from kvplug.core.metrics import MetricSample
    from kvplug.core.pin_ledger import SharedPins
    from kvplug.core.pins import pin_keys, unpin_keys
    from kvplug.core.plugins import PluginRegistry, get_registry
    from kvplug.core.policies.eviction import EvictionName
    from kvplug.core.policies.guarded_eviction import GuardedEviction, PinOutcome
    from kvplug.core.queue_settings import QueueSettings
    from kvplug.core.records.backend import SIZE_UNKNOWN, CallSizes, RecordBackend, RecordToWrite
    from kvplug.core.records.frame import RECORD_HEADER_SIZE, check_record_size, key_digest, unpack_record
    from kvplug.core.records.store import RecordCheck, RecordStore, StoredRecord, check_record
    from kvplug.core.records.tier import RecordTier
    from kvplug.core.remote.calls import RecordTierConfig, RemoteTierConfig
    from kvplug.core.remote.opening_warnings import OpeningWarnings
    from kvplug.core.remote.refusals import WriteRefusals
    from kvplug.core.remote.retry import Absent, CircuitBreaker, FailureKind, classify_failure
    from kvplug.core.serializer import Serializer
    from kvplug.core.tenancy import NameTenants, PinReport, Tenancy
    from kvplug.core.tenancy_settings import TenancySettings, bound_share, parse_share
    from kvplug.core.tenants import FOLDER_PINNED_BYTES, FOLDER_TENANT_BYTES
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
    from kvplug.redaction import SECRET_MASK, is_secret_name, redact, redact_text, redact_url


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "CHUNK_DTYPE_SIZES",
    "FOLDER_PINNED_BYTES",
    "FOLDER_TENANT_BYTES",
    "LOOKUP_DIR_ENV",
    "MEDIA",
    "RAW_FRAME_MAGIC",
    "RECORD_HEADER_SIZE",
    "SECRET_MASK",
    "SIZE_UNKNOWN",
    "UNBOUNDED_BYTES",
    "Absent",
    "BackoffSeconds",
    "Bounded",
    "Buffer",
    "CacheEngine",
    "CallSizes",
    "ChunkKey",
    "ChunkLocation",
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
    "EvictionName",
    "ExtraKey",
    "FailureCount",
    "FailureKind",
    "Fingerprint",
    "GuardedEviction",
    "HeadShard",
    "HeldChange",
    "HeldChunks",
    "KVConnector",
    "KVEvent",
    "KVLayout",
    "KVPlugConfig",
    "KeyPrefix",
    "LayerwiseRetrieve",
    "LazyModule",
    "MappedFile",
    "Medium",
    "MessageServer",
    "MetricSample",
    "NameTenants",
    "OpeningWarnings",
    "OrderedEvents",
    "PagedFormat",
    "PinOutcome",
    "PinReport",
    "PluginRegistry",
    "QueueItems",
    "QueueSettings",
    "RecordBackend",
    "RecordCheck",
    "RecordStore",
    "RecordTier",
    "RecordTierConfig",
    "RecordToWrite",
    "RemoteTierConfig",
    "RequestInfo",
    "Serializer",
    "ServerLimits",
    "SharedPins",
    "StorageTier",
    "StoreKey",
    "StoredRecord",
    "Tenancy",
    "TenancySettings",
    "ThreadCount",
    "TierChain",
    "TierConfig",
    "TierContext",
    "TierStats",
    "TimeoutSeconds",
    "TorchConnector",
    "WriteRefusals",
    "__version__",
    "bound_share",
    "check_record",
    "check_record_size",
    "check_socket_file",
    "classify_failure",
    "control_request_fields",
    "control_socket_path",
    "did_you_mean",
    "dtype_name",
    "encode_control_request",
    "exchange_control_request",
    "get_registry",
    "hit_tokens",
    "hookimpl",
    "is_mapped_file",
    "is_secret_name",
    "key_digest",
    "lazy_exports",
    "load_config",
    "merge_locations",
    "parse_share",
    "pin_keys",
    "private_socket_dir",
    "redact",
    "redact_text",
    "redact_url",
    "remove_stale_sockets",
    "slots_from_block_ids",
    "unpack_record",
    "unpin_keys",
]
