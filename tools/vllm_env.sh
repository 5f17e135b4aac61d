#!/usr/bin/env bash
# Build a venv that serves with vLLM on tpu, without vLLM's CUDA-only wheels.
#
#   tools/vllm_env.sh [VENV_DIR]        default /tmp/vllmenv
#
# `pip install -e ".[vllm]"` asks for vLLM's exact torch pin (torch==2.14.0) and about 200
# packages, flashinfer, cutlass and the CUDA toolkit among them, that tpu never loads. This
# venv instead sees the interpreter's own torch and jax (--system-site-packages), installs
# vllm with --no-deps and then only the pure-Python packages vLLM imports to run
# `LLM.generate` and its OpenAI-compatible server (the list below was found by trying),
# transformers within vLLM's pin, the `openai` client, torchvision (--no-deps, vLLM's pin;
# imported by its processors), the `vllm-router` wheel (vLLM's Rust router: cache_aware and
# KV-event routing in front of several replicas; tools/serve_replicas.py starts it), and this
# checkout of torchtpu (editable, so its vllm.platform_plugins entry point is registered).
#
# Environment: PYTHON (the interpreter to build the venv from; default python3).
set -euo pipefail

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
VENV=${1:-/tmp/vllmenv}
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
VLLM_VERSION=0.33.0
VLLM_ROUTER_VERSION=0.1.17

# What `import vllm.entrypoints.llm, vllm.entrypoints.openai.api_server` and a running
# engine need beyond torch/jax/numpy, within vllm 0.33.0's own version pins.
DEPS=(
    "transformers>=5.16.1,<5.21" "tokenizers>=0.23.2" "huggingface_hub>=1.31" "openai>=2.25"
    "fastapi[standard]>=0.133,<0.137" "aiohttp>=3.14.4" "lm-format-enforcer==0.11.3"
    "llguidance>=1.7,<1.8" "outlines_core==0.2.14" "lark==1.2.2" "xgrammar==0.2.8"
    "compressed-tensors==0.17.0" "depyf==0.20.0" oss-harmony
    regex cachetools psutil sentencepiece blake3 py-cpuinfo safetensors pydantic orjson
    prometheus_client prometheus-fastapi-instrumentator tiktoken partial-json-parser
    jsonschema pyzmq msgspec einops cloudpickle watchfiles python-json-logger pybase64 cbor2
    ijson setproctitle pillow pyyaml "model-hosting-container-standards>=0.1.14,<1"
)

"$PYTHON" -m venv --system-site-packages "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --no-deps "vllm==$VLLM_VERSION"
"${PIP[@]}" "${DEPS[@]}"
"${PIP[@]}" --no-deps "torchvision==0.29.0"
"${PIP[@]}" "vllm-router==$VLLM_ROUTER_VERSION"  # its dependencies are already above
"${PIP[@]}" --no-deps -e "$REPO"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import vllm.entrypoints.llm, vllm.entrypoints.openai.api_server  # noqa: F401,E401  (fail here)
import vllm_router_rs  # noqa: F401  (the router's Rust extension)
from vllm.platforms import current_platform
print(f"vllm {md.version('vllm')}, transformers {md.version('transformers')}, "
      f"platform {type(current_platform).__name__} ({current_platform.get_device_name()}), "
      f"vllm-router {md.version('vllm-router')}")
PY
echo "Ready: $VENV/bin/vllm serve MODEL   (the tpu platform comes from torchtpu's plugin)"
