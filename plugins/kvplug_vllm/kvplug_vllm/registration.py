"""vLLM plugin entry point (group ``vllm.general_plugins``): registers ``KVPlugConnector``.

vLLM calls every general plugin once in each of its processes (front end,
engine core, workers), so registering must be idempotent: the factory raises on
a second registration of one name.
"""

from __future__ import annotations

#: The name a deployment puts in ``kv_transfer_config["kv_connector"]``.
CONNECTOR_NAME = "KVPlugConnector"
CONNECTOR_MODULE = "kvplug_vllm.connector"


def register() -> None:
    """Register the connector with vLLM's ``KVConnectorFactory`` (lazily imported)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
