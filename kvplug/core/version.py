"""The installed kvplug's version: the plugin API's, whose range plugins declare."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    KVPLUG_VERSION = version("kvplug")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    KVPLUG_VERSION = "0.0.0"
