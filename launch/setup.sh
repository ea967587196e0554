#!/usr/bin/env bash
# Install everything falconext needs on a fresh Debian machine: system packages (Redis for
# the control plane), PyTorch 2.13.0, then falconext itself with its test extra and what
# Megatron-LM's training code imports, into the Python named by PYTHON (default python3):
#     bash launch/setup.sh                                   # Python 3.11, megatron-core 0.16.1
#     PYTHON=/path/to/python3.12 bash launch/setup.sh        # Python 3.12, megatron-core 0.19.2
# Idempotent: re-running it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
# supported: Python 3.11 with megatron-core 0.16.1, Python 3.12 with megatron-core 0.19.2
# (pyproject.toml picks the megatron-core by the Python)
if ! ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
    echo "setup: error: PYTHON=$PY is not a Python interpreter that runs here" >&2
    exit 1
fi
case "$ver" in
    3.11|3.12) ;;
    *) echo "setup: error: Python $ver is not supported: use 3.11 (megatron-core 0.16.1) or 3.12 (megatron-core 0.19.2), e.g. PYTHON=python3.12" >&2
       exit 1 ;;
esac
SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi

if ! command -v redis-server >/dev/null 2>&1; then
    echo "setup: installing redis-server" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

# torch first and pinned: with 2.13.0 present, megatron-core's own torch requirement is
# already met and pip does not pull a CUDA build from the registry.
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    echo "setup: installing torch 2.13.0 (CPU)" >&2
    "$PY" -m pip install -q "torch==2.13.0"
fi
# megatron-lm: what Megatron-LM's own training code imports (tests/megatron_lm, .ci/run)
"$PY" -m pip install -q -e ".[dev,megatron-lm]"
# an editable install leaves falconext uncompiled; where PYTHONDONTWRITEBYTECODE is set every
# process (a job starts a dozen) would compile it again
"$PY" -m compileall -q falconext >/dev/null
echo "setup: ok ($("$PY" -c 'import falconext, torch; print("falconext", falconext.__version__, "torch", torch.__version__)'))" >&2
