"""``kvplug ctl`` over an engine of pipeline stages: each stage's workers serve sockets of their own.

Each stage holds other layers, in a cache engine of its own per tensor-parallel rank, and the
stages' tensor-parallel ranks start at 0 again. Sockets named by the tensor-parallel rank alone
were one per rank of the first stage: a later stage's server found its socket served and did not
start, so ``kvplug ctl`` (and an adapter's lookups and cache resets over the sockets) reached one
stage and never the others' records.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from core_helpers import LAYOUTS, random_caches
from typer.testing import CliRunner

from kvplug import CacheEngine, ControlIdentity, ControlServer, Fingerprint, load_config
from kvplug.cli.main import app

LAYOUT = LAYOUTS["vllm_flash"]
TOKENS = list(range(200, 216))  # two chunks of 8


def stage_engine(stage: int) -> CacheEngine:
    extra = {"kvplug": {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": [{"type": "cpu"}]}}
    fingerprint = Fingerprint.for_layout(LAYOUT, model_id="m", pp_rank=stage, pp_size=2)
    return CacheEngine(load_config(engine_extra=extra, env={}).config, LAYOUT, fingerprint)


def test_each_pipeline_stage_answers_kvplug_ctl(socket_dir: Path, tmp_path: Path) -> None:
    engines = [stage_engine(stage) for stage in (0, 1)]
    identities = [ControlIdentity("engine-pp", "tiny", "test", pp_rank=stage, pp_size=2) for stage in (0, 1)]
    assert [i.worker for i in identities] == [0, 1]
    servers = [ControlServer(e, i) for e, i in zip(engines, identities)]
    try:
        engines[1].store(TOKENS, random_caches(LAYOUT, 8), torch.arange(len(TOKENS)))  # the second stage alone
        engines[1].flush()
        prompt = tmp_path / "prompt.json"
        prompt.write_text(json.dumps(TOKENS))
        result = CliRunner().invoke(app, ["ctl", "lookup", str(prompt), "--json"])
        assert result.exit_code == 0, result.output
        ranks = json.loads(result.stdout)["ranks"]
        assert [(r["pp_rank"], r["tp_rank"], r["hit_tokens"]) for r in ranks] == [(0, 0, 0), (1, 0, 16)]
        listed = CliRunner().invoke(app, ["ctl", "list"], env={"COLUMNS": "250"})
        assert "dp0/pp0/tp0" in listed.output and "dp0/pp1/tp0" in listed.output, listed.output
    finally:
        for server in servers:
            server.close()
        for engine in engines:
            engine.close()


def test_a_stage_without_a_control_socket_is_named_and_the_lookup_misses(socket_dir: Path, tmp_path: Path) -> None:
    """Stage 1 of a two-stage engine has no control socket (stopped, or still starting): the
    engine's own lookups ask every worker and miss, while ``kvplug ctl`` answered from stage 0
    alone, "hit: 16 ... the prefix every rank holds ... over 1 rank(s)", and pinned or cleared
    one stage without a word."""
    engine = stage_engine(0)
    server = ControlServer(engine, ControlIdentity("engine-pp", "tiny", "test", pp_rank=0, pp_size=2))
    try:
        engine.store(TOKENS, random_caches(LAYOUT, 8), torch.arange(len(TOKENS)))
        engine.flush()
        prompt = tmp_path / "prompt.json"
        prompt.write_text(json.dumps(TOKENS))
        lookup = CliRunner().invoke(app, ["ctl", "lookup", str(prompt), "--json"])
        assert lookup.exit_code == 0, lookup.output
        total = json.loads(lookup.stdout)["total"]
        assert (total["hit_tokens"], total["missing_ranks"]) == (0, ["dp0/pp1/tp0"]), total
        assert "missing: dp0/pp1/tp0" in " ".join(lookup.stderr.split()), lookup.stderr
        explained = CliRunner().invoke(app, ["ctl", "explain", str(prompt)], env={"COLUMNS": "250"})
        assert "hit: 0 of 16 tokens" in explained.stdout and "dp0/pp1/tp0 did not answer" in explained.stdout, (
            explained.output
        )
        for command in (["pin", str(prompt)], ["unpin", str(prompt)], ["clear", "--all"]):
            result = CliRunner().invoke(app, ["ctl", *command])
            message = " ".join(result.output.split())
            assert result.exit_code == 2, (command, result.output)
            assert "missing: dp0/pp1/tp0" in message and "done on the other ranks only" in message, message
        listed = CliRunner().invoke(app, ["ctl", "list"], env={"COLUMNS": "250"})
        assert "dp0/pp0/tp0 of 2 x 1" in listed.output, listed.output
    finally:
        server.close()
        engine.close()
