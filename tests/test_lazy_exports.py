"""``kvplug.lazy_exports``: a package's names imported on first use, as every plugin exports them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import kvplug

#: The plugin packages the core's test environment installs (the engine adapters and cuda
#: have their own environments).
PLUGINS = [
    "kvplug_cpu",
    "kvplug_disk",
    "kvplug_s3",
    "kvplug_valkey",
    "kvplug_compress",
    "kvplug_native",
    "kvplug_mooncake",
]


@pytest.mark.parametrize("package", ["kvplug", *PLUGINS])
def test_a_package_imports_its_exported_modules_only_when_a_name_is_used(package: str) -> None:
    """Registering a plugin imports its package: that must not import its tiers' modules
    (nor torch through them). The first use of a name imports its module, keeps the value
    on the package, and an unknown name is an AttributeError naming the package."""
    script = textwrap.dedent(
        f"""
        import importlib, sys
        package = importlib.import_module({package!r})
        assert "torch" not in sys.modules, "importing the package imported torch"
        modules = {{name: where if isinstance(where, str) else where[0] for name, where in package._LAZY.items()}}
        pending = [name for name, module in modules.items() if module not in sys.modules]
        assert pending, "every exported module was imported with the package"
        name = pending[0]
        value = getattr(package, name)
        assert modules[name] in sys.modules
        assert vars(package)[name] is value, "the value is not kept on the package"
        try:
            package.NoSuchName
        except AttributeError as error:
            print(error)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"module {package!r} has no attribute 'NoSuchName'" in done.stdout


def test_a_name_maps_to_its_module_or_to_a_module_and_a_name_there(monkeypatch: pytest.MonkeyPatch) -> None:
    module = type(sys)("lazy_exports_probe")
    monkeypatch.setitem(sys.modules, "lazy_exports_probe", module)
    getter = kvplug.lazy_exports("lazy_exports_probe", {"dedent": "textwrap", "Joined": ("os.path", "join")})
    assert getter("dedent") is textwrap.dedent
    assert getter("Joined") is __import__("os.path").path.join
    assert vars(module)["Joined"] is __import__("os.path").path.join
    with pytest.raises(AttributeError, match="module 'lazy_exports_probe' has no attribute 'indent'"):
        getter("indent")
