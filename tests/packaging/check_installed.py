"""Check kvplug's installed wheels against the wheel files they came from (nox -s packaging).

Run by the python of the clean venv the wheels went into, from outside the checkout:
``python check_installed.py DIST_FOLDER``. Each wheel in the folder must be installed
from that wheel (not editable, not the checkout) at the wheel's version, hold its
package's ``py.typed`` (and kvplug-native its compiled extension, which must import),
declare its entry points, and each plugin must declare the kvplug API range it was
built for (``kvplug>=X,<Y``), a range that admits the core's version; torch must be
a CPU build. Prints one line per distribution; exits 1 naming every problem.
"""

from __future__ import annotations

import importlib
import json
import sys
import sysconfig
import zipfile
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

#: Entry points each distribution must declare, beyond its plugin's ``kvplug`` entry point.
EXTRA_ENTRY_POINTS = {
    "kvplug": {("console_scripts", "kvplug")},
    "kvplug-vllm": {("vllm.general_plugins", "kvplug")},
    "kvplug-sglang": {("sglang.srt.plugins", "kvplug")},
}
#: Files a distribution must hold beyond its package's ``__init__.py`` and ``py.typed``.
EXTRA_FILES = {"kvplug-native": ["kvplug_native/_copy.pyi"]}


def check(dist_folder: Path) -> list[str]:
    problems: list[str] = []
    if torch.version.cuda:  # the core pin's CPU build, never a multi-GB CUDA one
        problems.append(f"torch {torch.__version__} is a CUDA build")
    wheels = sorted(dist_folder.glob("*.whl"))
    if not wheels:
        return [f"no wheels in {dist_folder}"]
    core_version = Version(distribution("kvplug").version)
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            problems.append(f"{name}: built as {wheel.name} but not installed")
            continue
        found = _check_one(dist, str(name), version, wheel, site_packages, core_version)
        problems += [f"{name}: {problem}" for problem in found]
        print(f"{name} {dist.version}: {'ok' if not found else 'FAILED'}")
    return problems


def _check_one(
    dist: Distribution, name: str, version: Version, wheel: Path, site_packages: Path, core_version: Version
) -> list[str]:
    problems = []
    if Version(dist.version) != version:
        problems.append(f"installed version {dist.version}, the wheel is {version}")
    direct_url = dist.read_text("direct_url.json")
    if direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"):
        problems.append("installed editable, not from its wheel")
    package = name.replace("-", "_")
    try:
        module = importlib.import_module(package)
    except Exception as exc:  # any import failure is the finding; the rest is still checked
        problems.append(f"import {package} fails: {exc!r}")
    else:
        if not Path(str(module.__file__)).resolve().is_relative_to(site_packages):
            problems.append(f"{package} is imported from {module.__file__}, not from {site_packages}")
    installed = {str(path) for path in dist.files or []}
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = set(archive.namelist())
    for needed in [f"{package}/__init__.py", f"{package}/py.typed", *EXTRA_FILES.get(name, [])]:
        if needed not in installed or needed not in in_wheel:
            problems.append(f"{needed} is not in the wheel {wheel.name} or not installed from it")
    if name == "kvplug-native":
        problems += _check_extension(installed, site_packages)
    entry_points = {(entry.group, entry.name) for entry in dist.entry_points}
    expected = EXTRA_ENTRY_POINTS.get(name, {("kvplug", package.removeprefix("kvplug_"))})
    for group, entry in sorted(expected - entry_points):
        problems.append(f"no entry point {entry!r} in group {group!r}")
    if name != "kvplug":
        problems += _check_api_range(dist, core_version)
    return problems


def _check_extension(installed: set[str], site_packages: Path) -> list[str]:
    """kvplug-native's wheel carries its C extension, built for this platform, and it loads."""
    if not any(path.startswith("kvplug_native/_copy.") and path.endswith(".so") for path in installed):
        return ["no compiled kvplug_native/_copy*.so in the wheel"]
    try:
        extension = importlib.import_module("kvplug_native._copy")
    except ImportError as exc:
        return [f"its C extension does not load: {exc}"]
    if not Path(str(extension.__file__)).resolve().is_relative_to(site_packages):
        return [f"kvplug_native._copy is loaded from {extension.__file__}"]
    return []


def _check_api_range(dist: Distribution, core_version: Version) -> list[str]:
    """A plugin states the plugin API it was built for as a bounded range on kvplug (docs/api.md)."""
    ranges = [
        requirement.specifier
        for requirement in map(Requirement, dist.requires or [])
        if canonicalize_name(requirement.name) == "kvplug" and requirement.marker is None
    ]
    if len(ranges) != 1:
        return [f"declares {len(ranges)} requirements on kvplug, not one"]
    operators = {spec.operator for spec in ranges[0]}
    if not ({">=", ">"} & operators and {"<", "<="} & operators):
        return [f"its requirement kvplug{ranges[0]} is not a range with a lower and an upper bound"]
    if not ranges[0].contains(core_version):
        return [f"its range kvplug{ranges[0]} does not admit kvplug {core_version}"]
    return []


if __name__ == "__main__":
    found = check(Path(sys.argv[1]))
    for problem in found:
        print(f"error: {problem}", file=sys.stderr)
    sys.exit(1 if found else 0)
