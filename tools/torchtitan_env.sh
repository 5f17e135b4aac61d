#!/usr/bin/env bash
# Build the venv that tests/test_torchtitan.py and docs/torchtitan.md's commands run in.
#
#   tools/torchtitan_env.sh [VENV_DIR]          (default /tmp/titanenv)
#
# The venv is made with --system-site-packages so it keeps the interpreter's torch and jax
# (torchtitan 0.3 asks for torch>=2.11 only through its dependencies, which this torch meets);
# it gets torchtitan 0.3 and its dependencies from the index, then this checkout's torchtpu
# installed editable with --no-deps (the interpreter's own torchtpu is left alone).
# The script fails if the install replaced torch. Environment: PYTHON (default python3).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-/tmp/titanenv}
PYTHON=${PYTHON:-python3}

TORCH_BEFORE=$("$PYTHON" -c "import torch; print(torch.__version__)")
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv --system-site-packages "$VENV"
VPY=$VENV/bin/python

# (this machine's pip config names local indexes that may not exist: drop pip's notes about them)
quiet() { "$@" 2> >(grep -v "^WARNING: Location .* is ignored" >&2); }
quiet "$VPY" -m pip install -q "torchtitan==0.3.*"
# FLUX's encoders and tokenizers are transformers'. torchtitan's datasets (< 4.8) pins
# huggingface-hub < 2, which a newer interpreter-wide transformers refuses at import: install into
# the venv the newest transformers that takes the venv's huggingface-hub.
HUB=$("$VPY" -c "import importlib.metadata as m; print(m.version('huggingface-hub'))")
quiet "$VPY" -m pip install -q "transformers>=5" "huggingface-hub==$HUB"
quiet "$VPY" -m pip install -q --no-deps -e "$REPO"

TORCH_AFTER=$("$VPY" -c "import torch; print(torch.__version__)")
if [[ $TORCH_AFTER != "$TORCH_BEFORE" ]]; then
    echo "torchtitan's install replaced torch $TORCH_BEFORE with $TORCH_AFTER in $VENV" >&2
    exit 1
fi
"$VPY" -c "import torchtitan, torchtpu, torch, transformers, importlib.metadata as m; \
print('torchtitan', m.version('torchtitan'), '| torch', torch.__version__, '| transformers', \
      transformers.__version__, '| torchtpu from', torchtpu.__file__)"
echo "ready: $VENV (run: $VENV/bin/python -m pytest -m slow tests/test_torchtitan.py)"
