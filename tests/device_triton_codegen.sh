#!/bin/bash
# Compile for sm_90 under the device's Triton (the H200 image: 3.6.0), on this machine, no GPU: the codegen
# cases (tests/sm90_codegen.py) and one launch of every code path the table and the heuristic can take
# (tests/sm90_compile_every_config.py, ~7 min on 2 cores; ALL=1: every distinct launch, ~15 min). CI's
# Triton (3.9) accepts code that 3.6 refuses (docs/DESIGN.md §6, "CI's Triton is not the device's";
# session 21 found every expand broken on the H200 that way). Run it before a device call that carries a
# kernel change:
#
#     bash tests/device_triton_codegen.sh            # TRITON_VERSION=3.6.0, venv in .venv-triton-device/
#
# A virtual environment with torch (whichever build pip picks; only its CPU side runs) and that Triton is made once and
# kept (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${TRITON_VERSION:-3.6.0}
VENV=${VENV:-.venv-triton-device}
if ! "$VENV/bin/python" -c "import triton, sys; sys.exit(triton.__version__ != '$VERSION')" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch numpy
    "$VENV/bin/pip" install -q "triton==$VERSION"
fi
"$VENV/bin/python" -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
PYTHONPATH=$PWD "$VENV/bin/python" tests/sm90_codegen.py --table
PYTHONPATH=$PWD "$VENV/bin/python" tests/sm90_compile_every_config.py ${ALL:+--all}
