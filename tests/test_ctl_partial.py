"""``kvplug ctl`` over ranks of which one fails: the ranks done before it are named."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from core_helpers import LAYOUTS, random_caches
from typer.testing import CliRunner

from kvplug import CacheEngine, ControlIdentity, ControlServer, Fingerprint, load_config
from kvplug.cli.main import app

LAYOUT = LAYOUTS["vllm_flash"]
TOKENS = list(range(100, 116))  # two chunks of 8


def rank_engine(folder: Path) -> CacheEngine:
    tiers = [{"type": "cpu", "max_bytes": "64MiB"}, {"type": "disk", "path": str(folder), "max_bytes": "64MiB"}]
    extra = {"kvplug": {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}
    return CacheEngine(
        load_config(engine_extra=extra, env={}).config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="m")
    )


@pytest.fixture
def two_ranks(tmp_path: Path, socket_dir: Path) -> Iterator[tuple[CacheEngine, CacheEngine]]:
    """Ranks tp0 and tp1 of one engine, each with its control server, the prompt stored on both."""
    engines = (rank_engine(tmp_path / "tp0"), rank_engine(tmp_path / "tp1"))
    servers = [
        ControlServer(e, ControlIdentity("engine-a", "tiny", "test", tp_rank=i, tp_size=2))
        for i, e in enumerate(engines)
    ]
    for engine in engines:
        engine.store(TOKENS, random_caches(LAYOUT, 8), torch.arange(len(TOKENS)))
        engine.flush()
    yield engines
    for server in servers:
        server.close()
    for engine in engines:
        engine.close()


def test_a_pin_that_fails_on_one_rank_names_the_ranks_it_was_done_on(
    two_ranks: tuple[CacheEngine, CacheEngine], tmp_path: Path
) -> None:
    """Rank tp1's engine is gone (closed) while its server still answers: the pin is made on tp0
    and fails on tp1. The error named tp1's socket alone, so the operator did not learn that
    tp0 now holds a pin (which must be undone, or kept)."""
    two_ranks[1].close()
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(TOKENS))
    result = CliRunner().invoke(app, ["ctl", "pin", str(prompt)])
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "rank dp0/tp1:" in message and "pin was done on the ranks that answered first: dp0/tp0" in message, message


def test_a_clear_on_a_closed_engine_is_an_error_not_none_cleared(
    two_ranks: tuple[CacheEngine, CacheEngine], tmp_path: Path
) -> None:
    """Rank tp1's engine is closed while its server answers: its tiers remove nothing (the disk
    records stay), and clear said tp1 cleared 0 chunks, exit 0."""
    two_ranks[1].close()
    result = CliRunner().invoke(app, ["ctl", "clear", "--all"])
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "rank dp0/tp1:" in message and "EngineClosedError" in message, message
    assert "clear was done on the ranks that answered first: dp0/tp0" in message, message
    assert len(list((tmp_path / "tp1").glob("*/*.kvr"))) >= 2  # what it would have said it cleared


def test_stats_and_tiers_name_a_rank_whose_engine_is_closed(
    two_ranks: tuple[CacheEngine, CacheEngine], tmp_path: Path
) -> None:
    """Rank tp1's engine is closed while its server answers: it serves nothing and its figures
    are not live. stats and tiers printed them as a serving rank's; they name it closed
    (exit 0: tp0 still serves), and exit 1 once every rank's engine is closed."""
    two_ranks[1].close()
    for command in ("stats", "tiers"):
        result = CliRunner().invoke(app, ["ctl", command, "--per-rank"], env={"COLUMNS": "250"})
        assert result.exit_code == 0, result.output
        message = " ".join(result.output.split())
        assert "closed: dp0/tp1: the engine of these ranks is closed" in message, message
        assert "tiers of dp0/tp1 (engine closed" in message and "tiers of dp0/tp0 (engine closed" not in message
        as_json = CliRunner().invoke(app, ["ctl", command, "--json"])
        assert as_json.exit_code == 0, as_json.output
        body = json.loads(as_json.stdout)  # the notice goes to stderr: stdout stays one JSON object
        assert body["total"]["closed_ranks"] == ["dp0/tp1"]
        assert [rank["closed"] for rank in body["ranks"]] == [False, True]

    two_ranks[0].close()
    for command in ("stats", "tiers"):
        result = CliRunner().invoke(app, ["ctl", command])
        assert result.exit_code == 1, result.output
        assert "closed: dp0/tp0, dp0/tp1 (every rank: the engine is closed)" in " ".join(result.output.split())
        assert CliRunner().invoke(app, ["ctl", command, "--json"]).exit_code == 1


def test_an_explain_over_the_reply_limit_says_how_many_tokens_fit(tmp_path: Path, socket_dir: Path) -> None:
    """An explain whose reply (a row per chunk) is over the control protocol's limit failed
    with the reply's size alone; it says to send a shorter prompt, and how many tokens fit:
    an explain of that many answers."""
    extra = {"kvplug": {"chunk_size": 1, "tiers": [{"type": "cpu", "max_bytes": "64MiB"}]}}
    engine = CacheEngine(
        load_config(engine_extra=extra, env={}).config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="m")
    )
    server = ControlServer(engine, ControlIdentity("engine-a", "tiny", "test"))
    try:
        prompt = tmp_path / "prompt.json"
        prompt.write_text(json.dumps(list(range(120_000))))  # 120000 chunks of a token: about 19 MB of reply
        result = CliRunner().invoke(app, ["ctl", "explain", str(prompt)])
        assert result.exit_code == 2, result.output[-2000:]
        message = " ".join(result.output.split())
        found = re.search(r"send a shorter prompt, at most about (\d+) tokens", message)
        assert found and "over the protocol's limit" in message, message
        fits = int(found.group(1))
        assert 0 < fits < 120_000
        prompt.write_text(json.dumps(list(range(fits))))
        shorter = CliRunner().invoke(app, ["ctl", "explain", str(prompt), "--json"])
        assert shorter.exit_code == 0, shorter.output[-2000:]
        assert json.loads(shorter.stdout)["total"]["num_tokens"] == fits
    finally:
        server.close()
        engine.close()


def test_a_pin_over_two_ranks_counts_the_tokens_every_rank_covers_not_their_sum(
    two_ranks: tuple[CacheEngine, CacheEngine], tmp_path: Path
) -> None:
    """Chunks and bytes add up over ranks (each holds its own records); the prompt tokens the
    pinned chunks cover do not: two ranks covering the same 16 tokens cover 16, not 32."""
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps([*TOKENS, 7, 8, 9]))  # three tokens past the last whole chunk
    result = CliRunner().invoke(app, ["ctl", "pin", str(prompt), "--json"])
    assert result.exit_code == 0, result.output
    total = json.loads(result.output)["total"]
    assert total["chunks"] == 4 and total["tokens"] == len(TOKENS), total
    said = " ".join(CliRunner().invoke(app, ["ctl", "pin", str(prompt)]).output.split())
    assert f"covering {len(TOKENS)} prompt tokens on every rank" in said, said
