"""kvplug.testing's KV oracle on synthetic captures: what it compares, what it names, and that
it never passes vacuously. Real engines' captures are checked in the vllm session
(plugins/kvplug_vllm/tests/test_kv_oracle.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvplug.testing import KVSlots, LossyBound, assert_kv_matches, compare_kv, load_slots, save_slots

UNITS, HEADS, WIDTH = 12, 4, 64


def capture(
    *, heads: int = HEADS, first: int = 0, rank: int = 0, layers: int = 3, dtype: torch.dtype = torch.bfloat16
) -> list[KVSlots]:
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(2, UNITS, HEADS, WIDTH, generator=generator).to(dtype) for _ in range(layers)]
    return [
        KVSlots(
            group=0,
            rank=rank,
            first_head=first,
            unit_tokens=1,
            kv_names=("K", "V"),
            layers=[t[:, :, first : first + heads].clone() for t in full],
            valid=torch.ones(UNITS, dtype=torch.bool),
            layout="test",
        )
    ]


def test_a_capture_matches_itself_and_counts_what_it_compared() -> None:
    result = assert_kv_matches(capture(), capture(), UNITS)
    assert result.elements == 3 * 2 * UNITS * HEADS * WIDTH
    assert result.compared == [(0, 0)]


def test_nothing_to_compare_fails() -> None:
    with pytest.raises(AssertionError, match="compared nothing"):
        assert_kv_matches(capture(), capture(), 0)


def test_a_difference_is_named_by_layer_kv_tokens_and_heads() -> None:
    loaded = capture()
    loaded[0].layers[2][1, 5:7, 3, 10] += 1
    with pytest.raises(AssertionError) as failure:
        assert_kv_matches(loaded, capture(), UNITS)
    assert "group 0, layer 2, rank 0, V: tokens 5-7, heads 3-4: 2 elements differ" in str(failure.value)


def test_bits_are_compared_not_values() -> None:
    """-0.0 == 0.0 and NaN != NaN as floats; the oracle compares the stored bits."""
    reference, loaded = capture(), capture()
    reference[0].layers[0][0, 0, 0, 0] = 0.0
    loaded[0].layers[0][0, 0, 0, 0] = -0.0
    reference[0].layers[0][0, 1, 0, 0] = float("nan")
    loaded[0].layers[0][0, 1, 0, 0] = float("nan")
    mismatches = compare_kv(loaded, reference, UNITS).mismatches
    assert [(m.layer, m.kv, m.tokens, m.elements) for m in mismatches] == [(0, "K", (0, 1), 1)]


def test_units_out_of_range_or_without_a_block_are_not_read() -> None:
    loaded, reference = capture(), capture()
    loaded[0].layers[0][0, 9] += 1  # past the load
    loaded[0].layers[1][0, 2] += 1  # a unit the engine gave no block (the null block)
    loaded = [replace(loaded[0], valid=torch.arange(UNITS) != 2)]
    assert compare_kv(loaded, reference, 8).equal


def test_ranks_of_another_tp_size_are_compared_by_model_head() -> None:
    """A TP=2 load against a TP=1 reference and the reverse; a rank's heads swapped are caught."""
    whole = capture()
    halves = capture(heads=2, first=0, rank=0) + capture(heads=2, first=2, rank=1)
    assert_kv_matches(halves, whole, UNITS)
    assert_kv_matches(whole, halves, UNITS)
    swapped = [replace(s, first_head=2 - s.first_head, rank=1 - s.rank) for s in halves]
    assert {m.rank for m in compare_kv(swapped, whole, UNITS).mismatches} == {0, 1}


def test_replicated_heads_are_joined_once() -> None:
    """MLA's latent (one head on every rank) or TP above the KV heads: each rank holds head 0."""
    latent = capture(heads=1)
    both_ranks = capture(heads=1, rank=0) + capture(heads=1, rank=1)
    assert_kv_matches(both_ranks, latent, UNITS)
    assert_kv_matches(latent, both_ranks, UNITS)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_lossy_load_is_held_to_its_bound(kind: str) -> None:
    """float32 captures: the errors added are exactly the ones compared (no rounding on top)."""
    bound = LossyBound(kind)  # type: ignore[arg-type]
    reference = capture(dtype=torch.float32)
    allowed = bound.allowed(reference[0].layers[0][0])
    within, past = capture(dtype=torch.float32), capture(dtype=torch.float32)
    within[0].layers[0][0] += allowed * 0.9
    past[0].layers[0][0] += allowed * 3
    assert_kv_matches(within, reference, UNITS, bound=bound)
    with pytest.raises(AssertionError, match=f"within the {kind} bound"):
        assert_kv_matches(past, reference, UNITS, bound=bound)
    with pytest.raises(AssertionError, match="bit for bit"):
        assert_kv_matches(within, reference, UNITS)


def test_a_packed_layout_is_compared_block_by_block() -> None:
    packed = [replace(s, unit_tokens=32) for s in capture()]
    assert_kv_matches(packed, packed, 64)
    with pytest.raises(ValueError, match="not whole units of 32 tokens"):
        compare_kv(packed, packed, 48)


def test_captures_round_trip_through_a_file_read_without_pickle(tmp_path: Path) -> None:
    slots = capture(heads=2, first=2, rank=1)
    save_slots(slots, tmp_path / "kv")
    back = load_slots(tmp_path / "kv")
    assert [(s.group, s.rank, s.first_head, s.unit_tokens, s.kv_names, s.layout) for s in back] == [
        (0, 1, 2, 1, ("K", "V"), "test")
    ]
    assert_kv_matches(back, slots, UNITS)
