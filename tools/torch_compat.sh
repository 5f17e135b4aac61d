#!/usr/bin/env bash
# Run torchtpu's smoke tests against one torch release, in a venv of its own.
#
#   tools/torch_compat.sh VERSION [VENV_DIR]      e.g. tools/torch_compat.sh 2.11
#
# VERSION is a release or a series (2.11 means torch==2.11.*). The venv (default
# /tmp/torchtpu-compat/torch-VERSION, reused when it already holds that torch) gets torch,
# JAX (JAX, default: the newest that pyproject.toml allows; e.g. JAX=0.10.1 checks the lower
# bound) and torchtpu installed editable from this checkout with its dev extra; the
# interpreter that runs this script (and its own editable torchtpu) is never modified: the
# script checks that `import torchtpu` there still resolves to the same place afterwards.
#
# torch comes from the CPU wheel index (TORCH_INDEX, default PyTorch's CPU index) when it
# answers; otherwise from the normal index, whose Linux wheels are CUDA builds (several GB
# with their nvidia-* libraries) that run on the CPU all the same. The result says which.
#
# Environment: PYTHON (the interpreter to build the venv from; default python3), JAX,
# TORCH_INDEX, SMOKE (pytest arguments replacing the default subset below).
# Exit status: 0 when the C++ hooks built and every smoke test passed (or was skipped/xfailed).
set -euo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
VERSION=$1
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${2:-/tmp/torchtpu-compat/torch-$VERSION${JAX:+-jax-$JAX}}
PYTHON=${PYTHON:-python3}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
# A release (2.11.0) is pinned as given; a series (2.11) takes its newest release.
[[ $VERSION =~ ^[0-9]+\.[0-9]+$ ]] && SPEC="torch==$VERSION.*" || SPEC="torch==$VERSION"
# The smoke subset: device, eager ops, compile, module moves, the C++ hooks, torch.accelerator,
# flex_attention (it reads torch's private BlockMask layout), and a slice of the CI's OpInfo
# conformance (eager float32). A few minutes on 2 cores.
DEFAULT_SMOKE=(tests/test_device.py tests/test_ops_elementwise.py tests/test_compile.py
               tests/test_module_to.py tests/test_native_hooks.py tests/test_accelerator.py
               tests/test_flex_attention.py tests/conformance/test_opinfo.py -k "not test_opinfo or (eager_float32 and (add or matmul or softmax))")
if [[ -n ${SMOKE:-} ]]; then read -r -a SMOKE_ARGS <<< "$SMOKE"; else SMOKE_ARGS=("${DEFAULT_SMOKE[@]}"); fi

log() { printf '\n== %s\n' "$*"; }
where_torchtpu() { (cd / && "$1" -c "import torchtpu, os; print(os.path.dirname(torchtpu.__file__))" 2>/dev/null) || echo "(not importable)"; }

HOST_BEFORE=$(where_torchtpu "$PYTHON")

log "venv $VENV"
if [[ ! -x $VENV/bin/python ]]; then
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi
VPY=$VENV/bin/python

have=$("$VPY" -c "import torch; print(torch.__version__)" 2>/dev/null || true)
if [[ -n $have && ( $have == "$VERSION" || $have == "$VERSION"[.+]* ) ]]; then
    echo "torch $have already installed"
    SOURCE="(already in the venv)"
else
    log "installing $SPEC"
    if "$VPY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=15)" \
            "$TORCH_INDEX" 2>/dev/null; then
        SOURCE="$TORCH_INDEX (CPU build)"
        # The CPU index for torch alone; its dependencies come from the normal index.
        "$VPY" -m pip install "$SPEC" --index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple
    else
        SOURCE="the normal index ($TORCH_INDEX did not answer): a CUDA build, run on the CPU"
        echo "$TORCH_INDEX does not answer; taking torch from the normal index"
        "$VPY" -m pip install "$SPEC"
    fi
fi

JAX_SPEC=${JAX:+jax==$JAX jaxlib==$JAX}
log "installing torchtpu (editable, [dev]) and ${JAX_SPEC:-the newest jax pyproject.toml allows}"
# torch is already satisfied in the venv, so this never swaps it for another release.
# shellcheck disable=SC2086  (JAX_SPEC is two words or none)
"$VPY" -m pip install -q -e "$REPO[dev]" $JAX_SPEC

HOST_AFTER=$(where_torchtpu "$PYTHON")
if [[ $HOST_AFTER != "$HOST_BEFORE" ]]; then
    echo "ERROR: the host interpreter's torchtpu moved: $HOST_BEFORE -> $HOST_AFTER" >&2
    exit 1
fi

log "versions and the C++ hooks"
"$VPY" - <<'EOF' | tee "$VENV/compat-versions.txt"
import platform, torch, jax, torchtpu
from torchtpu.runtime import native
native.load()
print(f"torch {torch.__version__}  jax {jax.__version__}  python {platform.python_version()}")
print(f"torchtpu from {torchtpu.__file__}")
print("C++ hooks:", "built and loaded" if native.load() else f"UNAVAILABLE: {native.unavailable_reason()}")
EOF

log "smoke tests: ${SMOKE_ARGS[*]}"
set +e
(cd "$REPO" && "$VPY" -m pytest -q -p no:cacheprovider -rfEs "${SMOKE_ARGS[@]}") 2>&1 | tee "$VENV/compat-pytest.txt"
rc=${PIPESTATUS[0]}
set -e

hooks_ok=0
grep -q "C++ hooks: built and loaded" "$VENV/compat-versions.txt" && hooks_ok=1
log "summary"
head -1 "$VENV/compat-versions.txt"
echo "torch from: $SOURCE"
grep "C++ hooks" "$VENV/compat-versions.txt"
echo "tests: $(grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)' "$VENV/compat-pytest.txt" | tail -1 | tr -d '=' | xargs) (pytest exit $rc)"
echo "host torchtpu unchanged: $HOST_AFTER"
[[ $rc -eq 0 && $hooks_ok -eq 1 ]]
