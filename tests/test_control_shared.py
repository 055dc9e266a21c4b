"""``kvplug ctl clear`` on one of two engines sharing a tier: it removes what that engine
wrote, and what it only loaded from its private tiers alone; the other engine's records
in the shared tier stay readable.

Two real cache engines, each with a private cpu tier, share a real disk tier (a folder);
engine A serves a real control server and the clear is the real ``kvplug ctl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from core_helpers import LAYOUTS, random_caches
from typer.testing import CliRunner

from kvplug import CacheEngine, ControlIdentity, ControlServer, EngineControl, Fingerprint, load_config
from kvplug.cli.main import app

LAYOUT = LAYOUTS["vllm_flash"]  # float16, block 4
THEIRS = list(range(100, 124))  # three chunks of 8, stored by engine B
OURS = [*THEIRS, *range(700, 716)]  # B's three chunks, then two of A's own


def open_engine(shared: Path, *, cpu: bool = True, group: str = "", owner: CacheEngine | None = None) -> CacheEngine:
    """An engine on a private cpu tier and the shared disk; with ``owner``, one more KV cache
    group's engine storing into the owner's tiers under its own fingerprint (``group``)."""
    tiers: list[dict[str, Any]] = [{"type": "cpu", "max_bytes": "64MiB"}] if cpu else []
    tiers.append({"type": "disk", "path": str(shared), "max_bytes": "64MiB"})
    extra = {"kvplug": {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}
    config = load_config(engine_extra=extra, env={}).config
    fingerprint = Fingerprint.for_layout(LAYOUT, model_id="m", engine_variant=group)
    return CacheEngine(config, LAYOUT, fingerprint, shares_tiers_with=owner)


def ctl(*args: str) -> Any:
    result = CliRunner().invoke(app, ["ctl", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_clear_all_removes_this_engines_writes_and_leaves_another_engines_records_in_a_shared_tier(
    tmp_path: Path, socket_dir: Path
) -> None:
    shared = tmp_path / "shared"
    caches = random_caches(LAYOUT, 80)
    with open_engine(shared) as a, open_engine(shared) as b:
        server = ControlServer(a, ControlIdentity("engine-a", "a", "test"))
        try:
            b.store(THEIRS, caches, torch.arange(len(THEIRS)))
            b.flush()
            # A loads B's three chunks from the shared disk (a copy lands in A's cpu tier),
            # then stores only its own two: B's are already there.
            loaded = a.retrieve(OURS, random_caches(LAYOUT, 80, seed=1), torch.arange(len(OURS)))
            assert int(loaded.sum()) == len(THEIRS)
            a.store(OURS, caches, torch.arange(len(OURS)))
            a.flush()
            assert [loc.tier for loc in a.locate(OURS)] == ["cpu"] * 5

            cleared = ctl("clear", "--all")["total"]
            # A's cpu tier is private (trusted_reads): B's chunks A loaded go from it too;
            # from the shared disk only the two chunks A wrote.
            assert cleared["removed"] == {"0:cpu": 5, "1:disk": 2}
            assert a.lookup(OURS) == len(THEIRS)  # B's chunks still load, from the disk
            assert [loc.tier for loc in a.locate(OURS)] == ["disk"] * 3
        finally:
            server.close()
    with open_engine(shared, cpu=False) as reader:  # a third engine reads what is left on disk
        assert [loc.tier for loc in reader.locate(OURS)] == ["disk"] * 3
        assert int(reader.retrieve(OURS, random_caches(LAYOUT, 80, seed=2), torch.arange(len(OURS))).sum()) == 24


def test_a_chunk_this_engine_stored_again_where_another_engine_wrote_it_first_stays(
    tmp_path: Path, socket_dir: Path
) -> None:
    """Without a tier written on the store's side (the disk tier writes through its queue)
    the engine hands every chunk to the tiers, and the disk tier's queue skips those it
    holds: A "stores" B's chunks too, but the records on disk are still B's writes."""
    shared = tmp_path / "shared"
    caches = random_caches(LAYOUT, 80)
    with open_engine(shared, cpu=False) as a, open_engine(shared, cpu=False) as b:
        server = ControlServer(a, ControlIdentity("engine-a", "a", "test"))
        try:
            b.store(THEIRS, caches, torch.arange(len(THEIRS)))
            b.flush()
            loaded = a.retrieve(OURS, random_caches(LAYOUT, 80, seed=1), torch.arange(len(OURS)))
            assert int(loaded.sum()) == len(THEIRS)
            assert a.store(OURS, caches, torch.arange(len(OURS))) == len(OURS)  # all five handed over
            a.flush()
            cleared = ctl("clear", "--all")["total"]
            assert cleared["removed"] == {"0:disk": 2}
        finally:
            server.close()
    with open_engine(shared, cpu=False) as reader:
        assert [loc.tier for loc in reader.locate(OURS)] == ["disk"] * 3


def test_clear_all_of_an_engine_with_companion_groups_leaves_another_engines_records_of_every_group(
    tmp_path: Path, socket_dir: Path
) -> None:
    """An engine with a companion (one engine per KV cache group, sharing the first one's
    tiers): the journal tells the companion's written records from its loaded ones too."""
    shared = tmp_path / "shared"
    caches = random_caches(LAYOUT, 80)
    with (
        open_engine(shared, group="g0") as a,
        open_engine(shared, group="g0") as b,
        open_engine(shared, group="g1", owner=a) as a1,
        open_engine(shared, group="g1", owner=b) as b1,
    ):
        server = ControlServer(EngineControl(a, [a1]), ControlIdentity("engine-a", "a", "test"))
        try:
            for engine in (b, b1):
                engine.store(THEIRS, caches, torch.arange(len(THEIRS)))
                engine.flush()
            for engine in (a, a1):
                loaded = engine.retrieve(OURS, random_caches(LAYOUT, 80, seed=1), torch.arange(len(OURS)))
                assert int(loaded.sum()) == len(THEIRS)
                engine.store(OURS, caches, torch.arange(len(OURS)))
                engine.flush()
            cleared = ctl("clear", "--all")["total"]
            assert cleared["removed"] == {"0:cpu": 10, "1:disk": 4}  # per group: 5 from cpu, A's 2 from disk
            assert a.lookup(OURS) == a1.lookup(OURS) == len(THEIRS)
        finally:
            server.close()
    for group in ("g0", "g1"):
        with open_engine(shared, cpu=False, group=group) as reader:
            assert [loc.tier for loc in reader.locate(OURS)] == ["disk"] * 3
