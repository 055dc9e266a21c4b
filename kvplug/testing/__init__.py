"""Test helpers for kvplug plugin authors: conformance suites and fixtures."""

from kvplug.testing.connector_copies import gather_chunk, scatter_chunk
from kvplug.testing.control_cli import run_ctl
from kvplug.testing.decode_bounds import DecodeCost, assert_bounded, cap_memory, measure_decode, run_fresh
from kvplug.testing.kv_oracle import (
    KVComparison,
    KVMismatch,
    KVSlots,
    LossyBound,
    assert_kv_matches,
    compare_kv,
    load_slots,
    save_slots,
)
from kvplug.testing.other_user import send_as_other_user
from kvplug.testing.storage_contract import StorageTierContract, key_for, tier_context, value_for

__all__ = [
    "DecodeCost",
    "KVComparison",
    "KVMismatch",
    "KVSlots",
    "LossyBound",
    "StorageTierContract",
    "assert_bounded",
    "assert_kv_matches",
    "cap_memory",
    "compare_kv",
    "gather_chunk",
    "key_for",
    "load_slots",
    "measure_decode",
    "run_ctl",
    "run_fresh",
    "save_slots",
    "scatter_chunk",
    "send_as_other_user",
    "tier_context",
    "value_for",
]
