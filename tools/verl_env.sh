#!/usr/bin/env bash
# Build the venvs that reinforcement learning on tpu runs in: VeRL (its GRPO recipe, FSDP2 actor,
# vLLM server-mode rollout, Ray controller) in one, TRL's GRPOTrainer in another.
#
#   tools/verl_env.sh [VENV_DIR]     default $TORCHTPU_INTEGRATION_CACHE/verl, and VENV_DIR-trl
#                                    ($TORCHTPU_INTEGRATION_CACHE: ~/.cache/torchtpu-integration)
#
# TRL has its own venv: VeRL 0.9.1 imports trl's AutoModelForCausalLMWithValueHead whenever trl
# is installed (its model patching, even for GRPO), which TRL 1.x no longer has (VeRL's own
# extra pins trl 0.27). TRL 1.16 needs only transformers, accelerate and datasets: the TRL venv
# is the interpreter's packages (--system-site-packages) plus trl and torchtpu editable.
#
# VeRL and vLLM share a venv, because VeRL's rollout runs vLLM inside VeRL's own processes. Their pins do not
# meet: verl 0.9.1 asks for transformers>=5.5.3,<5.11 (and its [vllm] extra for vllm==0.24.0,
# torch==2.11.0), while the vLLM that torchtpu's platform plugin supports (0.33) asks for
# transformers>=5.16.1. vLLM's pin wins: its model code imports what that transformers has,
# while VeRL only uses transformers' stable API (AutoModelForCausalLM, AutoConfig, tokenizers),
# so verl is installed with --no-deps and its requirements are listed here without the
# transformers bound. The rest as tools/vllm_env.sh does: --system-site-packages (the
# interpreter's torch and jax, held by a constraints file), vllm --no-deps and the
# pure-Python packages it needs (the list is read from tools/vllm_env.sh, one source), and this
# checkout of torchtpu (editable: its vllm.platform_plugins and verl.plugins entry points).
#
# Environment: PYTHON (the interpreter to build the venv from; default python3).
set -euo pipefail

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
CACHE=${TORCHTPU_INTEGRATION_CACHE:-$HOME/.cache/torchtpu-integration}
VENV=${1:-$CACHE/verl}
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
VERL_VERSION=0.9.1
TRL_VERSION=1.16.0

# vLLM's version and the packages it needs: the same as tools/vllm_env.sh
eval "$(sed -n -e '/^VLLM_VERSION=/p' -e '/^DEPS=(/,/^)/p' "$REPO/tools/vllm_env.sh")"
VLLM_DEPS=("${DEPS[@]}")

# verl 0.9.1's requirements less transformers (vLLM's range above) and the loggers it only
# imports when asked for them (wandb, tensorboard); TransferQueue, from its verl-core extra, is
# what its v1 trainers (separate trainer and rollout) pass batches through
VERL_DEPS=(
    accelerate codetiming datasets dill hydra-core pandas peft "pyarrow>=19" pybind11
    pylatexenc "ray[default]>=2.41" torchdata "tensordict>=0.8,<=0.10,!=0.9.0" packaging
    uvicorn fastapi cachetools "TransferQueue>=0.1.10"
)

mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv --system-site-packages "$VENV"
VPY=$VENV/bin/python
CONSTRAINTS=$VENV/interpreter-constraints.txt
"$VPY" -c "import importlib.metadata as m
for name in ('torch', 'jax', 'jaxlib', 'numpy'): print(f'{name}=={m.version(name)}')" > "$CONSTRAINTS"
# (this machine's pip config may name local indexes that do not exist: drop pip's notes about them)
quiet() { "$@" 2> >(grep -v "^WARNING: Location .* is ignored" >&2); }
PIP=(quiet "$VPY" -m pip install -q -c "$CONSTRAINTS")
"${PIP[@]}" --no-deps "vllm==$VLLM_VERSION" "verl==$VERL_VERSION"
"${PIP[@]}" "${VLLM_DEPS[@]}" "${VERL_DEPS[@]}"
"${PIP[@]}" --no-deps "torchvision==0.29.0"
"${PIP[@]}" --no-deps -e "$REPO"

"$VPY" - <<'PY'
import importlib.metadata as md
import vllm.entrypoints.openai.api_server  # noqa: F401  (fail here)
import verl
from verl.utils.device import get_device_name, get_nccl_backend, get_resource_name
print(", ".join(f"{n} {md.version(n)}" for n in ("verl", "vllm", "transformers", "ray", "tensordict")),
      f"| verl platform: device {get_device_name()}, backend {get_nccl_backend()}, Ray resource {get_resource_name()}")
PY

TRL_VENV=$VENV-trl
"$PYTHON" -m venv --system-site-packages "$TRL_VENV"
cp "$CONSTRAINTS" "$TRL_VENV/interpreter-constraints.txt"
quiet "$TRL_VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" "trl==$TRL_VERSION"
quiet "$TRL_VENV/bin/python" -m pip install -q --no-deps -e "$REPO"
"$TRL_VENV/bin/python" -c "import importlib.metadata as md, trl  # noqa: F401
print(', '.join(f'{n} {md.version(n)}' for n in ('trl', 'transformers', 'accelerate', 'datasets')))"
echo "Ready: $VPY -m pytest -n 0 tests/test_rl.py (VeRL), $TRL_VENV/bin/python -m pytest -n 0 tests/test_rl.py (TRL)"
