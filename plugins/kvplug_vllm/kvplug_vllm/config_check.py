"""Refusing a bad kvplug config when vLLM builds its config, before any model loads.

vLLM 0.32 constructs both roles of a KV connector only after the model is loaded and
profiled (the workers' in ``initialize_from_config``, once the KV cache size is
known; the scheduler's after that, in ``EngineCore``), and its one class-level hook
that sees ``kv_connector_extra_config`` at config time,
``requires_piecewise_for_cudagraph``, runs only when full CUDA graphs are on (never
on the CPU backend or with ``--enforce-eager``). A config naming an uninstalled tier
so failed a minute into start-up, in a long log of engine-core tracebacks.

So the ``vllm.general_plugins`` entry point (run in the front-end process before it
builds its config) adds a check to ``EngineArgs.create_engine_config``: when
``kv_transfer_config`` names ``KVPlugConnector`` (directly, by module path, or as a
``MultiConnector`` child), the kvplug part of its extra config is validated exactly
as the connector will validate it, and a bad one raises one
:class:`kvplug.errors.ConfigError` naming the field, e.g. ``tiers[1].type``, from
the ``LLM(...)`` call or the ``vllm serve`` command, before an engine process starts.
Each tier's side-effect-free :meth:`kvplug.StorageTier.preflight` runs there too (a
disk folder under a file or under a parent this process cannot write); what only
opening a tier can tell is still found by the worker, as a
:class:`kvplug.errors.TierOpenError` naming ``tiers[i]``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvplug import TierChain, get_registry, load_config
from kvplug.errors import KVPlugError
from kvplug_vllm.identity import CONNECTOR_MODULE, CONNECTOR_NAME

logger = logging.getLogger("kvplug.vllm")

_MARK = "_kvplug_checks_config"


def kvplug_extra_configs(kv_transfer_config: Any) -> Iterator[Mapping[str, Any]]:
    """The ``kv_connector_extra_config`` of each KVPlugConnector a kv_transfer_config sets up."""
    if kv_transfer_config is None:
        return
    entries: list[Mapping[str, Any]] = [
        {
            "kv_connector": getattr(kv_transfer_config, "kv_connector", None),
            "kv_connector_module_path": getattr(kv_transfer_config, "kv_connector_module_path", None),
            "kv_connector_extra_config": getattr(kv_transfer_config, "kv_connector_extra_config", None) or {},
        }
    ]
    if entries[0]["kv_connector"] == "MultiConnector":
        children = entries[0]["kv_connector_extra_config"].get("connectors") or []
        entries = [child for child in children if isinstance(child, Mapping)]
    for entry in entries:
        module = entry.get("kv_connector_module_path")
        if entry.get("kv_connector") == CONNECTOR_NAME and module in (None, CONNECTOR_MODULE):
            yield entry.get("kv_connector_extra_config") or {}


def check_kv_transfer_config(kv_transfer_config: Any) -> None:
    """Validate kvplug's settings in a vLLM ``kv_transfer_config`` as the connector would.

    Raises :class:`kvplug.errors.ConfigError` naming every bad field (an unknown
    ``tiers[1].type``, a bad ``kvplug.layerwise``, an unreadable ``kvplug.config``
    file), or :class:`kvplug.errors.TierOpenError` naming a tier whose
    :meth:`~kvplug.StorageTier.preflight` fails; returns quietly for a config that does
    not use kvplug.
    """
    from kvplug_vllm.settings import check_reset_tiers, split_extra_config

    for extra in kvplug_extra_configs(kv_transfer_config):
        settings, engine_extra = split_extra_config(extra)
        config = load_config(engine_extra=engine_extra).config
        check_reset_tiers(settings, config)
        # What each tier can tell without opening itself (a disk folder under a file).
        TierChain.preflight(config.tiers, config.registry or get_registry())


def install() -> None:
    """Check kvplug's part of every config ``EngineArgs`` builds in this process (idempotent).

    Wraps ``EngineArgs.create_engine_config`` (what ``LLM(...)``, ``AsyncLLM`` and
    ``vllm serve`` call before starting an engine) rather than ``VllmConfig.__post_init__``:
    pydantic turns a ``ValueError`` raised there, as :class:`~kvplug.errors.ConfigError`
    is one, into its own ``ValidationError``.
    """
    from vllm.engine.arg_utils import EngineArgs

    if not getattr(EngineArgs.create_engine_config, _MARK, False):
        EngineArgs.create_engine_config = checked(EngineArgs.create_engine_config)


def checked(create: Callable[..., Any]) -> Callable[..., Any]:
    """``create`` (``EngineArgs.create_engine_config``) followed by :func:`check_kv_transfer_config`.

    This runs for every vLLM start in a process where kvplug-vllm is installed, kvplug
    the connector or not: only kvplug's own errors (:class:`kvplug.errors.KVPlugError`)
    stop the start. Anything else (a vLLM whose config has changed shape) is logged and
    the config returned unchecked; the connector still validates its config when it starts.
    """

    @functools.wraps(create)
    def create_checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        vllm_config = create(self, *args, **kwargs)
        try:
            check_kv_transfer_config(getattr(vllm_config, "kv_transfer_config", None))
        except KVPlugError:
            raise
        except Exception as exc:
            logger.warning("kvplug could not check vLLM's kv_transfer_config early (%r); the connector checks it", exc)
        return vllm_config

    setattr(create_checked, _MARK, True)
    return create_checked
