#!/usr/bin/env bash
# The GPU check in one command (see gpu_check.py).
#
#   benchmarks/gpu_check.sh fetch     # here, with network: kvplug's dependencies a bare GPU image lacks, as
#                                     # wheels in .whl/ (git-ignored locally), for Python 3.12 on x86-64
#   benchmarks/gpu_check.sh [ARGS]    # there: installs .whl/ (if present) into /tmp/site, runs gpu_check.py ARGS
set -euo pipefail
cd "$(dirname "$0")/.."
# kvplug's requirements that the GPU image (torch, Triton, pyyaml, pluggy, rich, typer, xxhash, ...) lacks
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 blake3==1.0.11)
if [[ "${1:-}" == fetch ]]; then
    exclude="$(git rev-parse --git-path info/exclude)"; grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
    exit 0
fi
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec python3 benchmarks/gpu_check.py "$@"
