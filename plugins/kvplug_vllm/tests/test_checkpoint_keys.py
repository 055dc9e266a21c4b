"""One checkpoint run two ways on a shared tier: real vLLM engines, one with its model config
overridden (``hf_overrides``: another ``rope_theta`` rotates every key otherwise). The KV one run
computed is not the other's, so neither may load the other's chunks as its own. (The random
model's greedy tokens do not show the other rotation: the hit count does.)"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import kv_config, output, report, run_process, step

# four real engines in one test: more than the suite's default 300 s on a loaded machine
pytestmark = pytest.mark.timeout(900)

OVERRIDES = {"rope_parameters": {"rope_type": "default", "rope_theta": 2.0}}


def test_a_run_with_config_overrides_misses_the_plain_runs_chunks(run_engine: Any, tmp_path: Path) -> None:
    kv = kv_config(**{"kvplug.tiers": [{"type": "disk", "path": str(tmp_path / "kv")}]})
    plain = run_engine(kv=kv, steps=[step("P1")])
    assert report(plain, 0)["totals"]["stored_tokens"] >= 256
    overridden = run_engine(kv=kv, steps=[step("P1")], hf_overrides=OVERRIDES)
    assert report(overridden, 0)["hit_tokens"] == 0, "the overridden run loaded the plain run's KV as its own"
    reference = run_engine(kv=None, steps=[step("P1")], hf_overrides=OVERRIDES)
    assert output(overridden, 0) == output(reference, 0)
    again = run_engine(kv=kv, steps=[step("P1")], hf_overrides=OVERRIDES)  # another process, overridden alike
    assert report(again, 0)["hit_tokens"] == 256, "runs of one override do not share their chunks"
    assert output(again, 0) == output(reference, 0)


#: Prints the key prefix of a vLLM ModelConfig of hub repo ``org/tiny`` (an offline HF cache)
#: with ``main`` at each commit of argv[2] in turn, then with argv[3] asked for by name.
REVISIONS = """
import json, os, sys
from pathlib import Path
os.environ.update(HF_HOME=sys.argv[1], HF_HUB_OFFLINE="1")  # read when huggingface_hub is imported
import torch
from types import SimpleNamespace
from vllm.config import ModelConfig
from kvplug import KVLayout
from kvplug_vllm.layout import VLLM_FLASH, fingerprint_for

def key_prefix(**fields):
    engine = SimpleNamespace(
        model_config=ModelConfig(model="org/tiny", dtype="bfloat16", **fields),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    layout = KVLayout(VLLM_FLASH, num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    return fingerprint_for(layout, engine, tp_rank=0, pp_rank=0).key_prefix()

main = Path(sys.argv[1], "hub", "models--org--tiny", "refs", "main")
prefixes = []
for commit in sys.argv[2].split(","):
    main.write_text(commit)  # a push to main between two servers' starts
    prefixes.append(key_prefix())
prefixes.append(key_prefix(revision=sys.argv[3]))
print("PREFIXES " + json.dumps(prefixes))
"""


def test_servers_that_loaded_other_commits_of_main_never_share_chunks(tiny_model: str, tmp_path: Path) -> None:
    # vLLM resolves the revision it loads (main by default) to a commit, but the revision's
    # text stays "main": keyed by it, servers started before and after a push shared chunks.
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    commits = ["0123456789abcdef0123456789abcdef01234567", "fedcba9876543210fedcba9876543210fedcba98"]
    for commit in commits:
        shutil.copytree(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    done = run_process([sys.executable, "-c", REVISIONS, str(tmp_path / "hf"), ",".join(commits), commits[1]])
    lines = [line for line in done.stdout.splitlines() if line.startswith("PREFIXES ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    before, after, asked = json.loads(lines[-1][len("PREFIXES ") :])
    assert before != after, "servers that loaded other commits of main keyed their chunks alike"
    assert after == asked  # the commit main pointed at, or asked for by its hash: the same weights
