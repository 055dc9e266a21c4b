"""Keys name the commit of a hub checkpoint SGLang loaded, not the revision's name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sglang_pools import write_model_dir

HERE = Path(__file__).parent

#: Prints, for hub repo ``org/tiny`` in an offline HF cache with ``main`` at each commit of
#: argv[2] in turn, then with argv[3] asked for by name, the key prefix of the radix-cache
#: backend's chunks and the revision HiCache's pages are keyed by, each after SGLang's loader
#: fetched the checkpoint (its hooks applied by SGLang's plugin loading, as in every server process).
REVISIONS = """
import json, os, sys
from pathlib import Path
os.environ.update(HF_HOME=sys.argv[1], HF_HUB_OFFLINE="1")  # read when huggingface_hub is imported
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader import loader
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
from sglang.srt.server_args import ServerArgs
from sglang_pools import make_pool
from kvplug_sglang.page_identity import loaded_checkpoint
from kvplug_sglang.setup_engine import build_cache_engine

def keys(revision=None):
    # What DefaultModelLoader._prepare_weights calls (its own binding of the function).
    loader.download_weights_from_hf("org/tiny", None, ["*.json"], revision, ignore_patterns=None)
    pool = make_pool(size=64)
    model_config = ModelConfig("org/tiny", revision=revision)
    engine = build_cache_engine(model_config=model_config, k_pool=pool.k_buffer, v_pool=pool.v_buffer)
    reset_context()
    publish(ServerArgs(model_path="org/tiny", revision=revision, device="cpu"), role="test", ranks=SpawnRanks(world_rank=0))
    try:
        return [engine.fingerprint.key_prefix(), loaded_checkpoint()[1]]
    finally:
        reset_context()
        engine.close()

main = Path(sys.argv[1], "hub", "models--org--tiny", "refs", "main")
seen = []
for commit in sys.argv[2].split(","):
    main.write_text(commit)  # a push to main between two servers' starts
    seen.append(keys())
seen.append(keys(sys.argv[3]))
print("KEYS " + json.dumps(seen))
"""


def test_servers_that_loaded_other_commits_of_main_never_share_chunks_or_pages(tmp_path: Path) -> None:
    # SGLang names the revision as asked for (None: main) in its model config, and keeps the
    # snapshot its loader fetched nowhere: keyed by the name, servers started before and after
    # a push to main shared chunks (radix cache) and pages (HiCache) of other weights.
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    commits = ["0123456789abcdef0123456789abcdef01234567", "fedcba9876543210fedcba9876543210fedcba98"]
    for commit in commits:
        write_model_dir(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", REVISIONS, str(tmp_path / "hf"), ",".join(commits), commits[1]],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("KEYS ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    (before, before_pages), (after, after_pages), (asked, asked_pages) = json.loads(lines[-1][len("KEYS ") :])
    assert before != after, "radix-cache servers that loaded other commits of main keyed their chunks alike"
    assert (before_pages, after_pages) == (commits[0], commits[1]), "HiCache keyed pages by the revision's name"
    assert (after, after_pages) == (asked, asked_pages)  # main at a commit, or its hash asked for: one set of weights
