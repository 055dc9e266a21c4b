"""pluggy's markers of kvplug's hooks: the spec modules import them from here, not from
the package that lists those modules."""

from __future__ import annotations

import pluggy

PROJECT_NAME = "kvplug"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
