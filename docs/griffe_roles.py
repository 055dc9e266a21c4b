"""A griffe extension (mkdocs.yml, mkdocstrings' ``extensions``): reST roles in docstrings as Markdown code.

kvplug's docstrings are read in the source and in the API reference alike; they use reST's
``:class:`~kvplug.KVEvent``` roles, which Markdown would print as they are. Each role becomes
a code span of its target (``~`` keeps the last name, as Sphinx shows it); the docstrings stay
as they are.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


class ReSTRoles(Extension):
    """Rewrite ``:role:`target``` to a code span in every docstring griffe loads."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
