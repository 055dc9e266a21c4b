"""Records per range of KV heads, keyed independently of the writer's tensor-parallel size.

With tensor parallelism each rank's paged cache holds a contiguous range of the model's
KV heads: rank ``r`` of ``T`` holds heads ``[r * H/T, (r + 1) * H/T)``. A chunk of a
rank is stored as one record per *group* of ``heads_per_record`` heads, under a
fingerprint that names the group's head range of the model (``kv_heads``, e.g.
``"2-4/4"``) and the layout of a ``heads_per_record``-head cache, never the rank or
the TP size. An engine of another TP size whose ranks hold whole groups reads the same
records: with 4 KV heads and ``heads_per_record: 2``, a TP=1 engine writes and reads
records ``0-2/4`` and ``2-4/4`` per chunk, a TP=2 engine's rank 0 the first, rank 1
the second.

Replicated heads (a TP size above the model's KV heads, where several ranks hold the
same head, and MLA's latent cache, identical on every rank) are one record for all
the ranks that hold it, written by one of them (:attr:`HeadShard.writer`); the others
read it and keep a copy only in their process-private tiers (``trusted_reads``).

A group's record holds the chunk tensor of a ``heads_per_record``-head cache: the
rank's chunk ``[layers, kv, tokens, heads * head_dim]`` sliced along its heads (for
packed, ``whole_blocks_only`` formats whose blocks are head-major (the usual CPU paged layout),
the slice is taken per block; a packed format whose blocks are token-major cannot be cut
by head, so its records hold a rank's heads and are read only by engines holding the same).
:class:`HeadRecords` does the slicing with one strided copy per record.

Readers of another TP size need no option (``heads_per_record: auto``, one record per
rank, works across TP sizes): a reader looks for its own records first, and where the
prompt's first chunk has none, for those of every other split of the model's heads
(:class:`OtherSplit`): records of fewer heads than it holds are joined, a record of more
heads is sliced to its own. The other splits' records of the first chunk are asked for in
the same batched ``contains`` per tier as the engine's own records
(:mod:`kvplug.core.engine.split_lookup`), so a reader of the writer's TP size, and a
miss, cost no extra round trip.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvplug.core.keys import Fingerprint, RequestInfo
from kvplug.core.layouts import KVLayout
from kvplug.errors import ConfigError, ConfigProblem


@dataclass(frozen=True)
class HeadShard:
    """Which of the model's KV heads an engine's cache holds, and how its records split them.

    ``first`` is the model's index of the first head the cache holds (its
    ``num_kv_heads`` heads follow), ``total`` the model's KV heads (1 for a latent
    cache), ``group`` the heads per record (it divides the cache's heads).
    ``writer`` False: another engine holding the same heads writes the shared tiers.
    """

    first: int
    total: int
    group: int
    writer: bool = True

    @classmethod
    def for_rank(
        cls,
        *,
        total_heads: int,
        tp_rank: int,
        tp_size: int,
        heads_per_record: int | str = "auto",
        latent: bool = False,
    ) -> HeadShard:
        """The shard of tensor-parallel rank ``tp_rank`` of ``tp_size``, as the engines
        split KV heads (a TP size above the head count replicates each head over
        ``tp_size / total_heads`` consecutive ranks; a latent cache is on every rank).

        ``heads_per_record`` ``"auto"``: one record per chunk per rank (the rank's heads).
        An int must divide the rank's heads: a :class:`~kvplug.errors.ConfigError` otherwise.
        """
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        if latent:
            return cls(0, 1, 1, writer=tp_rank == 0)
        if total_heads <= 0 or (total_heads % tp_size and tp_size % total_heads):
            # The engines refuse such sizes; a shard made anyway would name heads the rank does not hold.
            raise ValueError(
                f"{total_heads} KV heads do not split evenly over tensor-parallel size {tp_size}: "
                "the head count must be a multiple of the TP size, or the TP size a multiple of it"
            )
        if tp_size >= total_heads:
            replicas = tp_size // total_heads
            return cls(tp_rank // replicas, total_heads, 1, writer=tp_rank % replicas == 0)
        held = total_heads // tp_size
        group = held if heads_per_record == "auto" else int(heads_per_record)
        if group <= 0 or held % group:
            raise ConfigError(
                [
                    ConfigProblem(
                        "heads_per_record",
                        heads_per_record,
                        f"must divide the {held} KV heads a rank holds at tensor-parallel size {tp_size} "
                        f"({total_heads} KV heads in all): e.g. {total_heads} // the largest TP size sharing the store",
                    )
                ]
            )
        return cls(tp_rank * held, total_heads, group)

    def label(self, index: int) -> str:
        """The ``kv_heads`` fingerprint field of record ``index``: ``"<first>-<end>/<total>"``."""
        return head_range(self.first + index * self.group, self.group, self.total)


def head_range(start: int, count: int, total: int) -> str:
    """The ``kv_heads`` fingerprint field of a record of heads ``start .. start + count`` of ``total``."""
    return f"{start}-{start + count}/{total}"


#: The engine variant's mark of records keyed by their writer's TP size (``tp_sharing: same``).
SAME_TP_SIZE = "tp_sharing=same"

#: cache_salt/LoRA isolations whose record keys :meth:`HeadRecords.all_records` can name.
_MAX_ISOLATIONS = 4096


class RecordSplit:
    """A split of the heads as an engine reads it (its own, or another TP size's writer's):
    ``count`` records per chunk, each of ``record_layout``, assembled into a chunk of the
    engine's ``chunk_layout``."""

    count: int
    record_layout: KVLayout
    chunk_layout: KVLayout

    def record_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return self.record_layout.chunk_shape(num_tokens)

    def chunk_tiers(self, located: Sequence[str], tier_order: Sequence[str]) -> list[str]:
        """Per chunk, the slowest (latest in ``tier_order``) of the tiers that hold its records,
        from one tier name per leading record."""
        return slowest_per_chunk(located, self.count, tier_order)

    def joined(self, records: Sequence[torch.Tensor], token_counts: Sequence[int]) -> list[torch.Tensor]:
        """Chunk tensors of the leading whole chunks of ``records`` (``count`` per chunk, chunk
        ``i`` of ``token_counts[i]`` tokens), each assembled from its records (a record of
        every head the engine holds is its chunk as it is)."""
        if self.record_layout == self.chunk_layout:
            return list(records)
        chunks = []
        for index in range(len(records) // self.count):
            chunk = torch.empty(self.chunk_layout.chunk_shape(token_counts[index]), dtype=self.chunk_layout.dtype)
            self._assemble(records[index * self.count : (index + 1) * self.count], chunk)
            chunks.append(chunk)
        return chunks

    def _assemble(self, records: Sequence[torch.Tensor], chunk: torch.Tensor) -> None:
        raise NotImplementedError


class HeadRecords(RecordSplit):
    """The records of an engine's chunks: one per head group of its :class:`HeadShard`.

    ``any_tp_size`` False (``tp_sharing: same``): the records are keyed by the writer's TP
    size too, and no other split is read.

    ``fingerprints[i]`` keys record ``i`` of every chunk; :meth:`record_keys` names them,
    :meth:`split` copies a chunk's head groups into record tensors and :meth:`join`
    copies them back.
    """

    def __init__(
        self, layout: KVLayout, fingerprint: Fingerprint, shard: HeadShard | None, *, any_tp_size: bool = True
    ) -> None:
        self.layout = self.chunk_layout = layout
        # A packed block is cut by head only where its bytes are head-major (_grouped): the
        # records of a token-major one are read only by engines holding the same heads.
        sliceable = heads_are_block_runs(layout)
        readable_split = shard is not None and shard.total > 1 and any_tp_size and sliceable
        if shard is None:  # one record, keyed as the adapter's fingerprint says
            shard = HeadShard(0, layout.num_kv_heads, layout.num_kv_heads)
            self.labels = [fingerprint.kv_heads]
        else:
            if layout.num_kv_heads % shard.group or shard.first + layout.num_kv_heads > shard.total:
                raise ValueError(
                    f"a cache of {layout.num_kv_heads} KV heads from head {shard.first} does not fit "
                    f"{shard.total} heads in records of {shard.group}"
                )
            if not sliceable and shard.group != layout.num_kv_heads:
                raise ConfigError(
                    [
                        ConfigProblem(
                            "heads_per_record",
                            shard.group,
                            f"{layout.format.name} packs each block token-major ({', '.join(layout.format.axes)}): "
                            f"a record holds all {layout.num_kv_heads} KV heads of a rank (heads_per_record: auto)",
                        )
                    ]
                )
            self.labels = [shard.label(i) for i in range(layout.num_kv_heads // shard.group)]
            # The head range replaces the rank in the key: any TP size reads these records
            # (tp_sharing: same keeps the TP size, marked apart from "any", so only engines of
            # this size do; marked once: an engine builds its records twice).
            if any_tp_size:
                fingerprint = replace(fingerprint, tp_rank=0, tp_size=1)
            elif SAME_TP_SIZE not in fingerprint.engine_variant.split("+"):
                variant = "+".join(filter(None, [fingerprint.engine_variant, SAME_TP_SIZE]))
                fingerprint = replace(fingerprint, tp_rank=0, engine_variant=variant)
        self.shard = shard
        self.count = len(self.labels)
        #: The layout of one record: a cache of ``shard.group`` heads.
        self.record_layout = replace(layout, num_kv_heads=shard.group)
        self.fingerprints = [
            replace(fingerprint, kv_heads=label, kv_layout=self.record_layout.describe()) for label in self.labels
        ]
        self.prefixes = [f.key_prefix() for f in self.fingerprints]
        #: How other writers may have split the heads this cache holds, tried in order where
        #: this engine's own records miss: joins of smaller records first (they read only
        #: these heads), then larger records to slice. None for one record of every head.
        self.others = (
            [
                OtherSplit(self, fingerprint, size)
                for size in _other_group_sizes(shard.total, layout.num_kv_heads, shard.group)
            ]
            if readable_split
            else []
        )
        # Record 0's key prefix -> every record's, per cache_salt/LoRA seen lately, so that
        # a chunk known by its record-0 key (events, journals) can be removed whole.
        self._isolations: OrderedDict[str, list[str]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def writer(self) -> bool:
        return self.shard.writer

    def largest_chunk_read(self, num_tokens: int) -> int:
        """Bytes of the largest chunk of ``num_tokens`` tokens in one record this cache
        reads: of its own records, or of another split's (:attr:`others`), which may hold
        more heads than this cache."""
        layouts = [self.record_layout, *(other.record_layout for other in self.others)]
        return max(math.prod(each.chunk_shape(num_tokens)) * each.dtype.itemsize for each in layouts)

    def record_keys(self, keys: Sequence[str], request: RequestInfo | None = None) -> list[str]:
        """The record keys of chunk keys (those of record 0, under ``request``'s isolation),
        ``count`` per chunk, chunk by chunk."""
        if self.count == 1:
            return list(keys)
        prefixes = self.prefixes
        isolated = isolated_prefixes(self.fingerprints, request)
        if isolated is not None:
            prefixes = isolated
            with self._lock:
                self._isolations[prefixes[0]] = prefixes
                self._isolations.move_to_end(prefixes[0])
                if len(self._isolations) > _MAX_ISOLATIONS:
                    self._isolations.popitem(last=False)
        cut = len(prefixes[0])
        return [prefix + key[cut:] for key in keys for prefix in prefixes]

    def record_prefixes(self, request: RequestInfo | None = None) -> list[str]:
        """The key prefix of each record, under ``request``'s cache_salt/LoRA (``None``: none)."""
        return isolated_prefixes(self.fingerprints, request) or list(self.prefixes)

    def all_records(self, keys: Sequence[str]) -> list[str]:
        """Every record key of the chunks named by their record-0 ``keys`` (as events and
        the chunk journal name them); a key of a salt or LoRA not seen lately stays alone."""
        if self.count == 1:
            return list(keys)
        cut = len(self.prefixes[0])
        with self._lock:
            known = {key[:cut]: self._isolations.get(key[:cut]) for key in keys}
        known[self.prefixes[0]] = self.prefixes
        found: dict[str, None] = {}  # ordered, once each: a journal may name several records
        for key in keys:
            prefixes = known[key[:cut]]
            found.update(dict.fromkeys([key] if prefixes is None else [prefix + key[cut:] for prefix in prefixes]))
        return list(found)

    def _grouped(self, tensor: torch.Tensor, heads: int) -> torch.Tensor:
        """``tensor`` (a chunk or record, contiguous) as ``[layers, kv, pages, heads, run]``: a
        head's run is its ``head_dim`` elements of a token, or of a packed format its whole
        block (the block's bytes are head-major)."""
        layers, kv, tokens, _ = tensor.shape
        if self.layout.whole_blocks_only:
            size = self.layout.block_size
            return tensor.view(layers, kv, tokens // size, heads, size * self.layout.head_dim)
        return tensor.view(layers, kv, tokens, heads, self.layout.head_dim)

    def split(self, chunk: torch.Tensor, records: Sequence[torch.Tensor]) -> None:
        """Copy each head group of ``chunk`` into its record tensor (one strided copy each)."""
        source = self._grouped(chunk, self.layout.num_kv_heads)
        group = self.shard.group
        for index, record in enumerate(records):
            self._grouped(record, group).copy_(source[:, :, :, index * group : (index + 1) * group])

    def join(self, records: Sequence[torch.Tensor], chunk: torch.Tensor, group: int | None = None) -> None:
        """Copy record tensors of ``group`` heads each (default: this cache's records') into
        their head groups of ``chunk``: :meth:`split` reversed."""
        target = self._grouped(chunk, self.layout.num_kv_heads)
        group = group or self.shard.group
        for index, record in enumerate(records):
            target[:, :, :, index * group : (index + 1) * group].copy_(self._grouped(record, group))

    def _assemble(self, records: Sequence[torch.Tensor], chunk: torch.Tensor) -> None:
        self.join(records, chunk)


def heads_are_block_runs(layout: KVLayout) -> bool:
    """Whether chunks of ``layout``'s format can be cut by KV head: always for formats that
    address tokens; for packed (``whole_blocks_only``) ones, whose chunks hold each block as
    stored, only where a block's heads are runs of it ('head' the outermost axis after
    'block' and 'kv'), which :meth:`HeadRecords._grouped` assumes. A property of the
    format, not of this cache's head count: a one-head cache would still cut the records
    of more heads that another TP size writes."""
    axes = [axis for axis in layout.format.axes[1:] if axis != "kv"]
    return not layout.whole_blocks_only or "head" not in axes or axes[0] == "head"


def isolated_prefixes(fingerprints: Sequence[Fingerprint], request: RequestInfo | None) -> list[str] | None:
    """The key prefixes of ``fingerprints`` under ``request``'s cache_salt/LoRA, or None without one."""
    if request is None or (request.cache_salt is None and request.lora_id is None):
        return None
    return [f.for_request(cache_salt=request.cache_salt, lora_id=request.lora_id).key_prefix() for f in fingerprints]


def slowest_per_chunk(located: Sequence[str], count: int, tier_order: Sequence[str]) -> list[str]:
    """Per whole chunk of ``count`` leading records, the slowest (latest in ``tier_order``) of their tiers."""
    if count == 1:
        return list(located)
    whole = len(located) // count * count
    return [max(located[i : i + count], key=tier_order.index) for i in range(0, whole, count)]


def _other_group_sizes(total: int, held: int, own: int) -> list[int]:
    """Record sizes (heads) other writers' splits of ``total`` heads use that a cache of
    ``held`` heads can read: divisors of ``held`` (joined, largest first), then multiples
    of it that divide ``total`` (sliced, smallest first); ``own`` left out."""
    joins = [g for g in range(held, 0, -1) if held % g == 0]
    slices = [g for g in range(2 * held, total + 1, held) if total % g == 0]
    return [g for g in joins + slices if g != own]


class OtherSplit(RecordSplit):
    """Records another writer's split of the heads wrote, as read by a cache of ``parent``'s heads.

    ``group`` heads per record: fewer than the cache holds, ``count`` records joined per
    chunk; more, one record per chunk of which the cache takes its heads.
    """

    def __init__(self, parent: HeadRecords, fingerprint: Fingerprint, group: int) -> None:
        self.parent = parent
        self.group = group
        shard, held = parent.shard, parent.layout.num_kv_heads
        if group <= held:
            starts = [shard.first + i * group for i in range(held // group)]
            self.offset = 0
        else:
            starts = [shard.first // group * group]
            self.offset = shard.first - starts[0]
        self.count = len(starts)
        self.record_layout = replace(parent.layout, num_kv_heads=group)
        self.chunk_layout = parent.layout
        base = replace(fingerprint, tp_rank=0, tp_size=1)
        self.fingerprints = [
            replace(base, kv_heads=head_range(start, group, shard.total), kv_layout=self.record_layout.describe())
            for start in starts
        ]
        self.prefixes = [f.key_prefix() for f in self.fingerprints]

    def record_keys(self, keys: Sequence[str], request: RequestInfo | None = None) -> list[str]:
        """The keys of these records of the chunks named by the engine's own ``keys``."""
        prefixes = isolated_prefixes(self.fingerprints, request) or self.prefixes
        cut = len(self.parent.prefixes[0])
        return [prefix + key[cut:] for key in keys for prefix in prefixes]

    def _assemble(self, records: Sequence[torch.Tensor], chunk: torch.Tensor) -> None:
        parent, held = self.parent, self.parent.layout.num_kv_heads
        if self.group <= held:
            parent.join(records, chunk, self.group)
        else:  # one record of more heads: this cache's heads are a run of them
            source = parent._grouped(records[0], self.group)[:, :, :, self.offset : self.offset + held]
            parent._grouped(chunk, held).copy_(source)
