"""Test helpers for kvplug plugin authors: conformance suites and fixtures."""

from kvplug.testing.storage_contract import StorageTierContract, key_for, tier_context, value_for

__all__ = ["StorageTierContract", "key_for", "tier_context", "value_for"]
