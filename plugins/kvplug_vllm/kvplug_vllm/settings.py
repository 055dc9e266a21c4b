"""The connector's own settings, and kvplug's per-request settings from vLLM.

vLLM hands a connector one free-form dict, ``kv_connector_extra_config``. kvplug's
core config takes its ``kvplug.``-prefixed keys (or a nested ``kvplug`` mapping);
the keys below are the vLLM connector's own and are split off first, so that they
can sit in the same namespace (``"kvplug.layerwise": true``) without the core
rejecting them as unknown.

Per request, ``SamplingParams(extra_args={"kv_transfer_params": {...}})`` (or
``kv_transfer_params`` in an OpenAI request body) may set kvplug's per-request
fields: ``{"kvplug.skip_save": true}``, ``{"kvplug.save_unfull_chunk": true}``, and
``{"kvplug.pin": true}`` to pin the chunks it stores (only where the operator sets
``tenancy.request_pins``: any API client can send it; see docs/security.md), and
``{"kvplug.report": true}`` to get the request's hit counts back in the output's
``kv_transfer_params``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError

from kvplug import KVPlugConfig, StorageTier, TimeoutSeconds, did_you_mean
from kvplug.errors import ConfigError, ConfigProblem

PREFIX = "kvplug."
#: kv_transfer_params key asking for the request's cache report in its output.
REPORT_KEY = "kvplug.report"
#: kv_transfer_params key pinning the chunks the request stores (the config's per-request ``pin_request``).
PIN_KEY = "kvplug.pin"


class ConnectorSettings(BaseModel):
    """Options of the vLLM connector itself (not of the cache engine)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layerwise: bool = Field(
        default=False,
        description="Load and store layer by layer inside the forward pass "
        "(wait_for_layer_load / save_kv_layer) instead of once before / after it.",
    )
    save_decode_cache: bool = Field(
        default=False, description="Also store chunks completed by generated (decode) tokens."
    )
    skip_last_n_tokens: NonNegativeInt = Field(
        default=0, description="Leave the last N prompt tokens out of lookups (LMCache's option)."
    )
    lookup_channel: Literal["auto", "direct", "socket"] = Field(
        default="auto",
        description="How the scheduler asks the worker's cache engine: direct (same process), "
        "socket (vLLM's multiprocess engine), or auto (direct when the worker is in this process).",
    )
    lookup_timeout_s: TimeoutSeconds = Field(
        default=10.0,
        description="Seconds the scheduler waits for a lookup's answer from the worker (over the lookup "
        "socket, or in the background); past it the request is a miss. The tiers' own time for one lookup "
        "is the core's lookup_budget_s.",
    )
    background_lookups: bool = Field(
        default=True,
        description="true: a lookup that the tiers answering inline (memory, and local files: disk, "
        "shm; StorageTier.inline_lookups) cannot answer alone, one that needs a remote tier, runs off vLLM's "
        "scheduler thread; get_num_new_matched_tokens answers None (ask again next step) until it is done, "
        "and vLLM schedules other requests meanwhile (an answer then waits for the engine's next step). "
        "false: every lookup is answered at once, the scheduler waiting for it.",
    )
    max_background_lookups: int = Field(
        default=8,
        ge=1,
        le=256,
        description="Background lookups in flight at once; a request asked about while all are busy is "
        "asked about again next step (and is a miss once it has waited lookup_timeout_s).",
    )
    load: Literal["auto", "sync", "async"] = Field(
        default="auto",
        description="How cached prefixes are loaded: sync (before the step's forward pass), async (in the "
        "background while vLLM schedules other requests; the request waits in WAITING_FOR_REMOTE_KVS), or auto "
        "(async when part of the prefix is only in a tier whose medium is not memory: disk or remote).",
    )
    load_timeout_s: TimeoutSeconds = Field(
        default=10.0,
        description="Seconds after which an asynchronous load not finished in this time is given up: its blocks are reported "
        "through get_block_ids_with_load_errors and vLLM recomputes them.",
    )
    reset_tiers: list[str] | None = Field(
        default=None,
        description="Tier types whose chunks vLLM's reset_prefix_cache (reset_cache) removes; "
        "None (the default): every in-memory tier (medium memory, e.g. cpu); [] leaves every tier alone.",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Serve the worker's kvplug Prometheus metrics on 127.0.0.1 at this port "
        "(plus the worker's index: its tensor-parallel rank, plus pp_rank * tp_size with pipeline stages).",
    )


SETTING_NAMES = frozenset(ConnectorSettings.model_fields)
#: Connector settings renamed before the first release (old key -> new key, what else changed).
RENAMED = {
    "lookup": ("lookup_channel", ""),
    "lookups": ("background_lookups", "true for background, false for blocking"),
    "load_timeout_ms": ("load_timeout_s", "in seconds, e.g. 10.0 for 10000 ms"),
}
_clash = SETTING_NAMES & set(KVPlugConfig.model_fields)
assert not _clash, f"connector settings shadow core config fields: {_clash}"


def split_extra_config(extra: Mapping[str, Any] | None) -> tuple[ConnectorSettings, dict[str, Any]]:
    """``(connector settings, the rest for kvplug.load_config)`` from vLLM's extra config."""
    rest: dict[Any, Any] = {}
    mine: dict[str, Any] = {}
    dotted: dict[str, Any] = {}  # (applied after the nested mapping, whatever the order of keys)
    for key, value in (extra or {}).items():
        if isinstance(key, str) and key.startswith(PREFIX) and key[len(PREFIX) :] in SETTING_NAMES | set(RENAMED):
            dotted[key[len(PREFIX) :]] = value
        elif key == "kvplug" and isinstance(value, Mapping):
            nested = dict(value)
            for name in (SETTING_NAMES | set(RENAMED)) & set(nested):
                mine[name] = nested.pop(name)
            rest[key] = nested
        else:
            rest[key] = value  # (another connector's key may be anything)
    # A kvplug.<setting> key wins over the nested mapping's, as it does for the core's settings;
    # which one won depended on the order of the engine's keys.
    mine.update(dotted)
    old = _unknown_names(rest)
    for name in sorted(RENAMED.keys() & mine.keys()):
        new, note = RENAMED[name]
        message = f"renamed to {PREFIX + new!r}" + (f" ({note})" if note else "")
        old.append(ConfigProblem(PREFIX + name, mine.pop(name), message))
    if old:
        raise ConfigError(old, "kv_connector_extra_config")
    try:
        settings = ConnectorSettings.model_validate(mine)
    except ValidationError as exc:
        problems = [
            ConfigProblem(PREFIX + ".".join(str(p) for p in error["loc"]), error.get("input"), error["msg"])
            for error in exc.errors(include_url=False)
        ]
        raise ConfigError(problems, "kv_connector_extra_config") from None
    return settings, rest


def check_reset_tiers(settings: ConnectorSettings, config: KVPlugConfig) -> None:
    """Refuse a ``kvplug.reset_tiers`` entry that is no tier type of ``config``: a misspelled
    type (``disc``) left that tier out of every reset, with nothing said."""
    types = [tier.type for tier in config.tiers]
    unknown = [name for name in settings.reset_tiers or [] if name not in types]
    if unknown:
        message = f"{', '.join(map(repr, unknown))} is no tier type of this config (its tiers: {', '.join(types)})"
        raise ConfigError(
            [ConfigProblem(PREFIX + "reset_tiers", settings.reset_tiers, message)], "kv_connector_extra_config"
        )


def _unknown_names(rest: Mapping[Any, Any]) -> list[ConfigProblem]:
    """A ``kvplug.`` key that is neither a connector setting nor a core field, named with the
    names of both (the core's own error would list only its fields, so a misspelled connector
    setting got a list without the setting meant)."""
    given = [
        (key[len(PREFIX) :], value) for key, value in rest.items() if isinstance(key, str) and key.startswith(PREFIX)
    ]
    nested = rest.get("kvplug")
    given += [(str(key), value) for key, value in nested.items()] if isinstance(nested, Mapping) else []
    allowed = sorted(SETTING_NAMES | set(KVPlugConfig.model_fields) | {"config"})  # config: a YAML file's path
    problems = []
    for name, value in given:
        first = name.split(".")[0]
        if first in allowed:
            continue
        hint = did_you_mean(first, allowed)
        problems.append(ConfigProblem(PREFIX + name, value, f"unknown key; {hint}allowed: {', '.join(allowed)}"))
    return problems


def kvplug_params(kv_transfer_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """kvplug's per-request settings in a request's ``kv_transfer_params``, not validated.

    Raises :class:`kvplug.errors.ConfigError` if ``kv_transfer_params`` is not a mapping
    (vLLM's offline API passes ``SamplingParams.extra_args`` on as given).
    """
    if kv_transfer_params is None:
        return {}
    if not isinstance(kv_transfer_params, Mapping):
        kind = type(kv_transfer_params).__name__
        raise ConfigError([ConfigProblem("kv_transfer_params", kind, "must be a mapping (a dict) or None")])
    return {
        "pin_request" if key == PIN_KEY else key[len(PREFIX) :]: value
        for key, value in kv_transfer_params.items()
        if isinstance(key, str) and key.startswith(PREFIX) and key != REPORT_KEY
    }


def request_overrides(kv_transfer_params: Mapping[str, Any] | None, config: KVPlugConfig) -> dict[str, Any]:
    """kvplug's per-request overrides in a request's ``kv_transfer_params``.

    Raises :class:`kvplug.errors.ConfigError` naming a key that is not a per-request
    setting or a value of the wrong type.
    """
    overrides = kvplug_params(kv_transfer_params)
    if overrides:
        config.with_overrides(overrides, source="kv_transfer_params")  # validates, raises ConfigError
    return overrides


def resets(tier: StorageTier, reset_tiers: list[str] | None) -> bool:
    """Whether vLLM's ``reset_prefix_cache`` empties ``tier`` (the ``reset_tiers`` setting):
    the named tier types, or by default every tier whose ``medium`` is memory."""
    return tier.medium == "memory" if reset_tiers is None else tier.name in reset_tiers


def wants_report(kv_transfer_params: Mapping[str, Any] | None) -> bool:
    return isinstance(kv_transfer_params, Mapping) and bool(kv_transfer_params.get(REPORT_KEY))
