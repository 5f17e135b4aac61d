#!/usr/bin/env bash
# Build a venv that serves with SGLang on tpu, without SGLang's CUDA-only wheels.
#
#   tools/sglang_env.sh [VENV_DIR]        default /tmp/sglangenv
#
# `pip install -e ".[sglang]"` works too, but SGLang's requirements pull flashinfer,
# sglang-kernel, cutlass and the CUDA toolkit (gigabytes that tpu never loads). This venv
# instead sees the interpreter's own torch and jax (--system-site-packages), installs
# sglang with --no-deps and then only the pure-Python packages SGLang imports to start an
# engine and its OpenAI-compatible server (the list below was found by trying), SGLang's
# pinned transformers (5.19) and tokenizers, the `openai` client, the `smg` wheel (the SGLang
# gateway's Rust router: cache_aware routing in front of several replicas;
# tools/serve_replicas.py starts it), and this checkout of torchtpu (editable, so its sglang
# entry points are registered).
#
# Environment: PYTHON (the interpreter to build the venv from; default python3).
set -euo pipefail

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
VENV=${1:-/tmp/sglangenv}
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
SGLANG_VERSION=0.5.23
SMG_VERSION=1.13.0

# What `import sglang.srt.entrypoints.engine` and a running server need beyond torch/jax/numpy.
DEPS=(
    "transformers==5.19.0" "tokenizers==0.23.2" "openai==2.8.0" "xgrammar==0.2.7"
    safetensors fastapi uvicorn uvloop pyzmq aiohttp requests pydantic orjson msgspec
    psutil setproctitle pybase64 python-multipart prometheus-client partial_json_parser
    interegular einops pillow sentencepiece tiktoken xxhash python-dateutil packaging
    regex scipy zstandard dill apache-tvm-ffi compressed-tensors gguf soundfile
)

"$PYTHON" -m venv --system-site-packages "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
"${PIP[@]}" "${DEPS[@]}"
# torchvision is imported by SGLang's multimodal configs; --no-deps keeps the interpreter's torch.
"${PIP[@]}" --no-deps torchvision
"${PIP[@]}" "smg==$SMG_VERSION"
"${PIP[@]}" --no-deps -e "$REPO"

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import sglang.srt.entrypoints.engine  # noqa: F401  (fails here, not at the first request)
import smg  # noqa: F401  (the router)
import torch
print(f"sglang {md.version('sglang')}, transformers {md.version('transformers')}, "
      f"torch {torch.__version__}, tpu: {torch.tpu.get_device_name()}, smg {md.version('smg')}")
EOF
echo "Ready: SGLANG_PLATFORM=tpu $VENV/bin/python -m sglang.launch_server --model-path MODEL"
