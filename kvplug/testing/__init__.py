"""Test helpers for kvplug plugin authors: conformance suites and fixtures."""

from kvplug.testing.decode_bounds import DecodeCost, assert_bounded, cap_memory, measure_decode, run_fresh
from kvplug.testing.storage_contract import StorageTierContract, key_for, tier_context, value_for

__all__ = [
    "DecodeCost",
    "StorageTierContract",
    "assert_bounded",
    "cap_memory",
    "key_for",
    "measure_decode",
    "run_fresh",
    "tier_context",
    "value_for",
]
