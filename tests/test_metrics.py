"""An engine's metrics as structured samples: a name, a labels mapping and a value."""

from __future__ import annotations

from kvplug import MetricSample
from kvplug.core.metrics import EngineMetrics


def test_samples_carry_labels_as_data_and_value_matches_them_exactly() -> None:
    metrics = EngineMetrics()
    metrics.tier_errors.labels("0:s3,{a=b}", "get").inc(3)
    metrics.stored_tokens.inc(64)
    samples = metrics.samples()
    assert MetricSample("kvplug_tier_errors_total", {"tier": "0:s3,{a=b}", "op": "get"}, 3.0) in samples
    assert MetricSample("kvplug_stored_tokens_total", {}, 64.0) in samples
    assert not any(s.name.endswith("_created") for s in samples)
    assert metrics.value("kvplug_tier_errors_total", tier="0:s3,{a=b}", op="get") == 3
    assert metrics.value("kvplug_tier_errors_total", tier="0:s3,{a=b}") == 0  # labels match exactly
    assert metrics.value("kvplug_stored_tokens_total") == 64
    series = {s.series for s in samples}
    assert ("kvplug_tier_errors_total", (("op", "get"), ("tier", "0:s3,{a=b}"))) in series
