"""Admission per tier (``tiers[i].admission``): which chunks the tier chain writes to a tier.

Real cpu and disk tiers through ``CacheEngine``; the sketch's bounds as properties."""

from __future__ import annotations

import pytest
import torch
from core_helpers import LAYOUTS, random_caches
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug import CacheEngine, load_config
from kvplug.core.plugins import PluginRegistry
from kvplug.core.policies.admission import (
    AGING_FACTOR,
    MAX_HITS,
    SKETCH_DEPTH,
    AdmitAll,
    FrequencyAdmission,
    FrequencyAdmissionConfig,
    FrequencySketch,
    make_admission_policy,
)
from kvplug.errors import ConfigError

LAYOUT = LAYOUTS["vllm_flash"]
CHUNKS = 3  # chunk_size 8 (make_engine), 24 tokens per prompt


@pytest.fixture
def registry() -> PluginRegistry:
    """Builtins with the cpu and disk tiers (both in the core test environment)."""
    return PluginRegistry(plugin_filter="cpu,disk")


def prompt(first: int) -> list[int]:
    return list(range(first, first + 8 * CHUNKS))


def counted(engine: CacheEngine, what: str, tier: str) -> float:
    return engine.metrics.value(f"kvplug_admission_{what}_total", tier=tier)


def held(engine: CacheEngine, index: int, tokens: list[int]) -> list[bool]:
    engine.flush()
    return engine.chain.tiers[index].contains([k.key for k in engine.chunk_keys(tokens)])


def cpu_and_disk(make_engine, tmp_path, disk_admission: dict | None) -> CacheEngine:
    disk: dict = {"type": "disk", "path": str(tmp_path / "disk")}
    if disk_admission is not None:
        disk["admission"] = disk_admission
    return make_engine(LAYOUT, tiers=[{"type": "cpu", "max_bytes": "64MiB"}, disk])


def load(engine: CacheEngine, tokens: list[int]) -> int:
    """Retrieve ``tokens`` into fresh caches (a second request loading the prefix)."""
    mask = engine.retrieve(tokens, random_caches(LAYOUT, 80, seed=1), torch.arange(len(tokens)))
    return int(mask.sum())


# --- through the engine -------------------------------------------------------------


def test_a_prompt_stored_once_never_reaches_a_frequency_tier(make_engine, tmp_path) -> None:
    engine = cpu_and_disk(make_engine, tmp_path, {"type": "frequency", "min_hits": 2})
    tokens = prompt(100)
    engine.store(tokens, random_caches(LAYOUT, 80), torch.arange(len(tokens)))
    for _ in range(5):  # lookups are no sightings: a scheduler repeats them for one request
        assert engine.lookup(tokens) == len(tokens)
    assert held(engine, 0, tokens) == [True] * CHUNKS
    assert held(engine, 1, tokens) == [False] * CHUNKS
    assert counted(engine, "declined", "1:disk") == CHUNKS
    assert counted(engine, "admitted", "1:disk") == 0
    assert counted(engine, "admitted", "0:cpu") == CHUNKS  # the all policy passes everything


def test_a_prefix_loaded_by_a_second_request_is_written_to_the_frequency_tier(make_engine, tmp_path) -> None:
    engine = cpu_and_disk(make_engine, tmp_path, {"type": "frequency", "min_hits": 2})
    tokens = prompt(100)
    engine.store(tokens, random_caches(LAYOUT, 80), torch.arange(len(tokens)))
    assert held(engine, 1, tokens) == [False] * CHUNKS
    # The second request finds the prefix in the cpu tier and loads it: its second sighting.
    assert load(engine, tokens) == len(tokens)
    assert held(engine, 1, tokens) == [True] * CHUNKS
    assert counted(engine, "admitted", "1:disk") == CHUNKS
    assert counted(engine, "declined", "1:disk") == CHUNKS  # from the first store
    # Later loads write nothing more (the key was admitted already) and count nothing.
    assert load(engine, tokens) == len(tokens)
    assert counted(engine, "admitted", "1:disk") == CHUNKS
    # What the disk got is the chunk itself: with the cpu tier gone it alone serves it.
    engine.chain.tiers[0].remove([k.key for k in engine.chunk_keys(tokens)])
    assert [(loc.tier, loc.tokens) for loc in engine.locate(tokens)] == [("disk", 8)] * CHUNKS
    assert load(engine, tokens) == len(tokens)


def test_an_admitted_chunk_the_tier_lost_is_written_again_on_a_later_load(make_engine, tmp_path) -> None:
    """Admitted but not held (a write dropped from a full queue, a failed put, a file
    removed): the next load from the cpu tier writes it again, however often it was seen."""
    engine = cpu_and_disk(make_engine, tmp_path, {"type": "frequency", "min_hits": 2})
    tokens = prompt(100)
    engine.store(tokens, random_caches(LAYOUT, 80), torch.arange(len(tokens)))
    assert load(engine, tokens) == len(tokens)  # the second sighting: admitted and written
    engine.flush()
    keys = [k.key for k in engine.chunk_keys(tokens)]
    engine.chain.tiers[1].remove(keys[:1])
    assert held(engine, 1, tokens) == [False] + [True] * (CHUNKS - 1)
    assert load(engine, tokens) == len(tokens)
    assert held(engine, 1, tokens) == [True] * CHUNKS
    assert counted(engine, "admitted", "1:disk") == CHUNKS  # admitted once, written twice


def test_a_prefix_stored_twice_is_written_on_its_second_store(make_engine, tmp_path) -> None:
    engine = make_engine(
        LAYOUT,
        tiers=[{"type": "disk", "path": str(tmp_path), "admission": {"type": "frequency", "min_hits": 2}}],
    )
    shared, one_off = prompt(100), prompt(500)
    caches = random_caches(LAYOUT, 80)
    engine.store(shared, caches, torch.arange(24))
    engine.store(one_off, caches, torch.arange(24) + 24)
    assert held(engine, 0, shared) == held(engine, 0, one_off) == [False] * CHUNKS
    assert engine.lookup(shared) == 0
    engine.store(shared, caches, torch.arange(24))  # nothing held it: computed and stored again
    assert held(engine, 0, shared) == [True] * CHUNKS
    assert held(engine, 0, one_off) == [False] * CHUNKS
    assert counted(engine, "admitted", "0:disk") == CHUNKS
    assert counted(engine, "declined", "0:disk") == 2 * CHUNKS
    assert load(engine, shared) == len(shared)


def test_the_all_policy_writes_every_chunk_as_before(make_engine, tmp_path) -> None:
    for admission in (None, {"type": "all"}):
        engine = cpu_and_disk(make_engine, tmp_path / str(admission is None), admission)
        assert isinstance(engine.chain._slots[1].admission, AdmitAll)
        tokens = prompt(100)
        engine.store(tokens, random_caches(LAYOUT, 80), torch.arange(len(tokens)))
        assert held(engine, 0, tokens) == held(engine, 1, tokens) == [True] * CHUNKS
        assert counted(engine, "admitted", "1:disk") == CHUNKS
        assert counted(engine, "declined", "1:disk") == 0


def test_promotion_into_a_faster_tier_respects_its_admission(make_engine, tmp_path) -> None:
    engine = make_engine(
        LAYOUT,
        tiers=[
            {"type": "cpu", "max_bytes": "64MiB", "admission": {"type": "frequency", "min_hits": 3}},
            {"type": "disk", "path": str(tmp_path)},
        ],
    )
    tokens = prompt(100)
    engine.store(tokens, random_caches(LAYOUT, 80), torch.arange(len(tokens)))  # sighting 1
    assert held(engine, 0, tokens) == [False] * CHUNKS
    assert held(engine, 1, tokens) == [True] * CHUNKS
    assert load(engine, tokens) == len(tokens)  # sighting 2: not promoted yet
    assert held(engine, 0, tokens) == [False] * CHUNKS
    assert engine.metrics.value("kvplug_promotions_total", tier="0:cpu") == 0
    assert load(engine, tokens) == len(tokens)  # sighting 3: promoted
    assert held(engine, 0, tokens) == [True] * CHUNKS
    assert engine.metrics.value("kvplug_promotions_total", tier="0:cpu") == CHUNKS
    assert [(loc.tier, loc.tokens) for loc in engine.locate(tokens)] == [("cpu", 8)] * CHUNKS


# --- config ---------------------------------------------------------------------------


def _config_error(registry: PluginRegistry, tmp_path, admission: object) -> ConfigError:
    tiers = [{"type": "cpu"}, {"type": "disk", "path": str(tmp_path), "admission": admission}]
    with pytest.raises(ConfigError) as info:
        load_config(engine_extra={"kvplug.tiers": tiers}, env={}, registry=registry)
    return info.value


@pytest.mark.parametrize(
    ("admission", "path", "words"),
    [
        ({"type": "frequency", "min_hits": 0}, "tiers[1].admission.min_hits", "greater than or equal to 1"),
        ({"type": "frequency", "min_hits": 256}, "tiers[1].admission.min_hits", "less than or equal to 255"),
        ({"type": "frequency", "sketch_keys": 10}, "tiers[1].admission.sketch_keys", "greater than or equal to 64"),
        ({"type": "frequency", "min_hits": True}, "tiers[1].admission.min_hits", "not a boolean"),
        ({"type": "frequency", "min_hit": 2}, "tiers[1].admission.min_hit", "Extra inputs"),
        ({"type": "lfu"}, "tiers[1].admission", "'all' or 'frequency'"),
        ({"min_hits": 2}, "tiers[1].admission", "'all' or 'frequency'"),
        ("frequency", "tiers[1].admission", "'all' or 'frequency'"),
    ],
)
def test_config_errors_name_the_field(registry, tmp_path, admission, path, words) -> None:
    error = _config_error(registry, tmp_path, admission)
    assert [problem.path for problem in error.problems] == [path]
    assert words in str(error)


def test_config_builds_the_policy(registry, tmp_path) -> None:
    tiers = [{"type": "disk", "path": str(tmp_path), "admission": {"type": "frequency", "min_hits": 3}}]
    config = load_config(engine_extra={"kvplug.tiers": tiers}, env={}, registry=registry).config
    admission = config.tiers[0].options.admission
    assert admission == FrequencyAdmissionConfig(min_hits=3, sketch_keys=100_000)
    policy = make_admission_policy(admission)
    assert isinstance(policy, FrequencyAdmission)
    assert (policy.min_hits, policy.sketch.width) == (3, 1 << 20)  # 10 x 100000 sightings, to a power of two


# --- the policy and its sketch ----------------------------------------------------------


def test_frequency_policy_admits_on_the_min_hits_sighting() -> None:
    policy = FrequencyAdmission(min_hits=2, sketch_keys=1000)
    assert policy.admit(["a", "b"]) == [False, False]
    policy.seen(["a", "b", "a"])  # one batch: one sighting each
    assert policy.admit(["a", "b"]) == [False, False]
    policy.seen(["a"])
    assert policy.admit(["a", "b"]) == [True, False]


def test_sketch_counts_halve_after_its_sample_size() -> None:
    sketch = FrequencySketch(64)
    for _ in range(8):
        sketch.add("hot")
    assert sketch.estimate("hot") == 8
    for i in range(sketch.sample_size - 8):
        sketch.add(f"cold-{i}")
    assert sketch.agings == 1
    assert sketch.estimate("hot") <= 4  # halved (one-off keys may share a counter or two)


@settings(max_examples=25, deadline=None)
@given(keys=st.integers(min_value=64, max_value=4096), distinct=st.integers(min_value=0, max_value=20_000))
def test_sketch_memory_is_fixed_whatever_the_number_of_keys(keys: int, distinct: int) -> None:
    sketch = FrequencySketch(keys)
    before = sketch.nbytes
    assert AGING_FACTOR * keys <= sketch.width < 2 * AGING_FACTOR * keys
    assert before == SKETCH_DEPTH * sketch.width
    for i in range(distinct):
        sketch.add(f"v1/fingerprint/{i:064x}")
    assert sketch.nbytes == before
    assert len(sketch._rows) == SKETCH_DEPTH and all(len(row) == sketch.width for row in sketch._rows)
    assert all(max(row) <= MAX_HITS for row in sketch._rows)


@settings(max_examples=50, deadline=None)
@given(
    sightings=st.lists(st.integers(min_value=0, max_value=400), max_size=600),
    keys=st.sampled_from([64, 100, 1000]),
)
def test_sketch_never_undercounts_within_its_window(sightings: list[int], keys: int) -> None:
    sketch = FrequencySketch(keys)
    sightings = sightings[: sketch.sample_size - 1]  # no aging inside the window
    truth: dict[str, int] = {}
    for number in sightings:
        key = f"key-{number}"
        sketch.add(key)
        truth[key] = truth.get(key, 0) + 1
    assert sketch.agings == 0
    for key, count in truth.items():
        assert sketch.estimate(key) >= min(count, MAX_HITS)


def test_a_period_of_one_off_keys_does_not_fill_the_sketch() -> None:
    """The reviewer's case: a stream of distinct keys as long as one aging period. Were the
    rows sized by ``keys`` instead of by the period, about half of them would read as seen
    twice by its end, and a frequency tier would admit one-off prompts."""
    sketch = FrequencySketch(1024)
    for i in range(sketch.sample_size - 1):  # one short of the aging that would clear them
        sketch.add(f"one-off-{i}")
    assert sketch.agings == 0
    seen_once = sum(sketch.estimate(f"one-off-{i}") >= 2 for i in range(sketch.sample_size - 1))
    never_seen = sum(sketch.estimate(f"never-{i}") >= 2 for i in range(10_000))
    assert seen_once / (sketch.sample_size - 1) < 0.02
    assert never_seen / 10_000 < 0.02
