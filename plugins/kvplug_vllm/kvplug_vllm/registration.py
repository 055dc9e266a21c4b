"""vLLM plugin entry point (group ``vllm.general_plugins``): registers ``KVPlugConnector``.

vLLM calls every general plugin once in each of its processes (front end,
engine core, workers), so registering must be idempotent: the factory raises on
a second registration of one name.
"""

from __future__ import annotations

from kvplug_vllm.identity import CONNECTOR_MODULE, CONNECTOR_NAME

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "register"]


def register() -> None:
    """Register the connector with vLLM's ``KVConnectorFactory`` (lazily imported)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    _choose_lookup_socket_folder()
    _check_configs_early()


def _check_configs_early() -> None:
    """Refuse a bad kvplug config when vLLM builds its config, not after the model loads."""
    from kvplug_vllm.config_check import install

    try:
        install()
    except Exception as exc:  # another vLLM version: the connector still validates, later
        import logging

        logging.getLogger("kvplug.vllm").warning("kvplug cannot check its config before the model loads: %s", exc)


def _choose_lookup_socket_folder() -> None:
    """Pick the lookup sockets' private folder in the first vLLM process.

    The choice is exported as ``$KVPLUG_LOOKUP_DIR``, so the engine core (scheduler)
    and the workers it starts agree on it even when the usual folder was refused
    (a link or another user's folder) and a fresh ``mkdtemp`` folder is used instead.
    """
    import logging

    from kvplug import private_socket_dir

    try:
        private_socket_dir()
    except Exception as exc:  # never break vLLM's start-up: lookups over the socket will say why
        logging.getLogger("kvplug.vllm.lookup").warning("no private folder for lookup sockets: %s", exc)
