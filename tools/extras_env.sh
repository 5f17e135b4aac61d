#!/usr/bin/env bash
# Build the venv that tests/test_hf.py, test_diffusers.py, test_litert.py and test_ray.py run in.
#
#   tools/extras_env.sh [VENV_DIR]        default /tmp/extrasenv
#
# The four extras (hf, diffusers, litert, ray) install together: one venv, made with
# --system-site-packages so it keeps the interpreter's torch and jax; this checkout of torchtpu
# is installed editable with those extras, under a constraint that torch and jax stay the
# interpreter's (the script fails if they would not). About 70 packages, Ray and LiteRT's
# converter the largest; nothing is compiled.
#
# Environment: PYTHON (the interpreter to build the venv from; default python3).
set -euo pipefail

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
VENV=${1:-/tmp/extrasenv}
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
EXTRAS=hf,diffusers,litert,ray

"$PYTHON" -m venv --system-site-packages "$VENV"
VPY=$VENV/bin/python
# torch and jax as the interpreter has them: an extra that asked for others fails the install
CONSTRAINTS=$VENV/interpreter-constraints.txt
"$VPY" -c "import importlib.metadata as m
for name in ('torch', 'jax', 'jaxlib', 'numpy'): print(f'{name}=={m.version(name)}')" > "$CONSTRAINTS"
# (this machine's pip config may name local indexes that do not exist: drop pip's notes about them)
quiet() { "$@" 2> >(grep -v "^WARNING: Location .* is ignored" >&2); }
quiet "$VPY" -m pip install -q -c "$CONSTRAINTS" -e "$REPO[$EXTRAS]"

"$VPY" - <<'PY'
import importlib.metadata as md
import accelerate, diffusers, litert_torch, ray.train, transformers  # noqa: F401,E401  (fail here)
import ai_edge_litert.interpreter  # noqa: F401
import torch
print(", ".join(f"{n} {md.version(n)}" for n in
                ("transformers", "accelerate", "diffusers", "litert-torch", "ai-edge-litert", "ray")),
      f"| torch {torch.__version__}")
PY
echo "Ready: $VENV/bin/python -m pytest tests/test_hf.py tests/test_diffusers.py tests/test_litert.py tests/test_ray.py"
