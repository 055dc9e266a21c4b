"""Test helpers for kvplug plugin authors: conformance suites and fixtures.

The KV oracle (:mod:`kvplug.testing.kv_oracle`) is imported on first use: it needs torch,
and a storage tier's tests (which import this package) must run without it.
"""

from typing import TYPE_CHECKING, Any

from kvplug.testing.adapters import write_lora_adapter
from kvplug.testing.connector_copies import gather_chunk, scatter_chunk
from kvplug.testing.control_cli import run_ctl
from kvplug.testing.decode_bounds import DecodeCost, assert_bounded, cap_memory, measure_decode, run_fresh
from kvplug.testing.other_user import send_as_other_user
from kvplug.testing.pins_contract import PinsAndQuotasContract, pins_context
from kvplug.testing.ports import (
    PortTaken,
    free_port,
    free_ports,
    held_port,
    listening_addresses,
    ports_in_use,
    says_address_in_use,
    start_on_free_ports,
)
from kvplug.testing.storage_contract import StorageTierContract, key_for, tier_context, value_for

if TYPE_CHECKING:
    from kvplug.testing.engine_round_trip import TierRoundTripContract
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

_KV_ORACLE = {
    "KVComparison",
    "KVMismatch",
    "KVSlots",
    "LossyBound",
    "assert_kv_matches",
    "compare_kv",
    "load_slots",
    "save_slots",
}


def __getattr__(name: str) -> Any:
    if name in _KV_ORACLE:
        from kvplug.testing import kv_oracle

        return getattr(kv_oracle, name)
    if name == "TierRoundTripContract":  # an engine's: torch
        from kvplug.testing import engine_round_trip

        return engine_round_trip.TierRoundTripContract
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DecodeCost",
    "KVComparison",
    "KVMismatch",
    "KVSlots",
    "LossyBound",
    "PinsAndQuotasContract",
    "PortTaken",
    "StorageTierContract",
    "TierRoundTripContract",
    "assert_bounded",
    "assert_kv_matches",
    "cap_memory",
    "compare_kv",
    "free_port",
    "free_ports",
    "gather_chunk",
    "held_port",
    "key_for",
    "listening_addresses",
    "load_slots",
    "measure_decode",
    "pins_context",
    "ports_in_use",
    "run_ctl",
    "run_fresh",
    "save_slots",
    "says_address_in_use",
    "scatter_chunk",
    "send_as_other_user",
    "start_on_free_ports",
    "tier_context",
    "value_for",
    "write_lora_adapter",
]
