#!/usr/bin/env bash
# The integration tier: each integration's environment, then a representative selection of its
# tests in it. What CI runs after the default suite (.ci/run); a user can run the same.
#
#   tools/integration_tests.sh [PART...]           parts: vllm sglang extras torchtitan rl (default: all)
#   tools/integration_tests.sh --build [PART...]   only build (or reuse) the parts' venvs, all at once
#
# Environments: tools/vllm_env.sh, tools/sglang_env.sh, tools/extras_env.sh (Transformers,
# Diffusers, LiteRT, Ray), tools/torchtitan_env.sh and tools/verl_env.sh (part rl) build one venv each under
# $TORCHTPU_INTEGRATION_CACHE (default ~/.cache/torchtpu-integration). A venv is reused while
# its inputs are unchanged: the builder script, the interpreter's Python, torch and jax versions,
# and, for the extras, pyproject.toml's optional dependencies (a stamp file holds their hash);
# otherwise it is built again from scratch. `--build` builds every part's venv at the same time
# (the builds wait on the network more than on the CPU; .ci/run starts them in the background
# while the default suite runs), and a later run without it reuses them. A build that fails (pip, the network) is retried
# 3 times with a growing pause; one that still fails is reported as an environment failure,
# not as a test failure, and fails the run.
#
# Each part's tests run as `<venv>/bin/python -m pytest -rs` on the node ids below. No selected
# test may skip: a skip fails the run, unless its reason says it needs several hosts, a GPU or a
# TPU. Servers and launchers are started and killed by the tests themselves. The wall time of
# each build and each test run is printed at the end.
#
# Environment: PYTHON (default python3), TORCHTPU_INTEGRATION_CACHE, TORCHTPU_INTEGRATION_LOGS
# (where pytest's junit files and the build logs go; default a temporary folder).
set -uo pipefail

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
CACHE=${TORCHTPU_INTEGRATION_CACHE:-$HOME/.cache/torchtpu-integration}
LOGS=${TORCHTPU_INTEGRATION_LOGS:-$(mktemp -d /tmp/torchtpu-integration.XXXXXX)}
mkdir -p "$CACHE" "$LOGS"
cd "$REPO"

# ------------------------------------------------------------------ what each part runs
T=tests
VLLM_TESTS=(
    "$T/test_engine_contracts.py::test_vllm_contract"
    "$T/test_engine_contracts.py::test_vllm_overrides_are_in_the_contract"
    "$T/test_engine_contracts.py::test_engine_source_contract[vllm]"
    "$T/test_vllm.py::test_plugin_activates_on_request_only"
    # one server: greedy tokens = HF (3 concurrent requests, one prefilled in chunks), 64
    # concurrent requests, bad requests, and the compiled forward (vLLM's piecewise compile)
    "$T/test_vllm.py::test_server_greedy_matches_hf_batched_and_chunked"
    "$T/test_vllm.py::test_server_runs_the_compiled_forward"
    "$T/test_vllm.py::test_server_64_concurrent_requests_none_dropped_or_corrupted"
    "$T/test_vllm.py::test_server_rejects_bad_requests_and_keeps_serving"
    # the worker's warm-up: request counts 1-8 served after start-up lower no program, tokens = HF
    "$T/test_vllm.py::test_request_counts_are_compiled_at_start_up"
    # several replicas behind vllm-router (issue 30): greedy = HF through the router, the
    # metrics contract under load, KV events, sessions, failover (one replica SIGKILLed under
    # load: the router retries its requests on the other; tools/serve_replicas.py's retry
    # options make the retries outlast the router's 2 s health check)
    "$T/test_routing.py"
    # prefill/decode disaggregation: the KV moved between two servers by TpuTcpConnector, greedy
    # = HF = colocated, and through vllm-router's P/D mode
    "$T/test_pd.py::test_staged_blocks_are_served_once_by_range"
    "$T/test_pd.py::test_pd_greedy_equals_hf_and_colocated"
    "$T/test_pd.py::test_pd_unknown_prefill_fails_the_request"
    "$T/test_pd.py::test_pd_through_vllm_router"
)
SGLANG_TESTS=(
    "$T/test_engine_contracts.py::test_sglang_contract"
    "$T/test_engine_contracts.py::test_sglang_overrides_are_in_the_contract"
    "$T/test_engine_contracts.py::test_engine_source_contract[sglang]"
    "$T/test_sglang.py::test_platform_is_tpu_with_real_memory_figures"
    # one server (decode through the compiled tpu graph runner, SGLang's default): greedy = HF,
    # 64 concurrent requests, bad input
    "$T/test_sglang.py::test_server_completions_greedy_matches_hf"
    "$T/test_sglang.py::test_server_64_concurrent_greedy_requests_each_match_hf"
    "$T/test_sglang.py::test_server_rejects_bad_input_and_keeps_serving"
    # the offline engine with --enable-torch-compile (compiled decode, mixed batches) = HF
    "$T/test_sglang.py::test_engine_greedy_matches_hf"
    # two SGLang replicas behind smg (issue 30): greedy = HF through smg, the load figures smg
    # reads (/v1/loads = SGLang's Prometheus gauges) under load, sessions under
    # consistent_hashing and cache_aware, failover (one replica SIGKILLed)
    "$T/test_routing_sglang.py"
)
EXTRAS_TESTS=(
    "$T/test_hf.py::test_generate_greedy_matches_cpu"
    "$T/test_hf.py::test_trainer_on_tpu_matches_cpu"
    "$T/test_diffusers.py::test_eager_matches_cpu[ddpm]"
    "$T/test_litert.py::test_trained_on_tpu_converts_to_tflite"
    "$T/test_ray.py::test_cpu_task_feeds_a_tpu_task"
)
# test_torchtitan.py is marked slow: -m slow selects it
TORCHTITAN_TESTS=("$T/test_torchtitan.py::test_llama3_debugmodel_single_device_matches_cpu"
                  # --compile.enable on tpu (two compiled steps against the eager losses)
                  "$T/test_torchtitan_compile.py::test_compiled_two_steps_match_eager")
# reinforcement learning (issue 31): VeRL's tpu platform and checkpoint engine in the VeRL venv;
# TRL's GRPO on tpu in the TRL venv tools/verl_env.sh builds beside it (VeRL imports a class TRL 1.x
# no longer has whenever TRL is installed, so they cannot share one)
RL_TESTS=(
    "$T/test_rl.py::test_platform_from_the_entry_point[VERL_PLATFORM]"
    "$T/test_rl.py::test_platform_from_the_entry_point[auto-detection]"
    "$T/test_rl.py::test_plugins_off_leaves_verl_without_tpu"
    "$T/test_rl.py::test_toy_rows_read_by_verl_and_scored"
    "$T/test_rl.py::test_checkpoint_engine_moves_tpu_weights_to_every_receiver"
    "$T/test_rl.py::test_recipe_config_is_verls_grpo_with_separate_devices"
    "$T/test_rl.py::test_vllm_rollout_through_verls_registry"
    # the recipe end to end: 3 GRPO steps, actor and rollout on separate devices under Ray, the
    # log-prob and greedy-after-sync checks (about 4 minutes and 10 GB alone)
    "$T/test_rl.py::test_verl_recipe_three_steps_split_placement"
)
RL_TRL_TESTS=("$T/test_rl.py::test_trl_grpo_loss_and_gradients_match_cpu")

# ------------------------------------------------------------------ helpers
declare -a REPORT=()
FAILED=()
ENV_FAILED=()

now() { date +%s; }
record() { REPORT+=("$(printf '%-28s %6ss  %s' "$1" "$2" "$3")"); }

# The hash of what a venv is built from: the builder, the interpreter, its torch and jax, and extras.
inputs_hash() {
    local builder=$1 extra=${2:-}
    {
        cat "$builder"
        "$PYTHON" -c "import sys, importlib.metadata as m
print(sys.version)
for n in ('torch', 'jax', 'jaxlib'): print(n, m.version(n))"
        printf '%s\n' "$extra"
    } | sha256sum | cut -d' ' -f1
}

# ensure_env NAME BUILDER [EXTRA_INPUT]: a venv at $CACHE/NAME built by BUILDER (reused if its stamp matches)
ensure_env() {
    local name=$1 builder=$2 extra=${3:-} venv=$CACHE/$1 start log hash attempt
    start=$(now)
    hash=$(inputs_hash "$builder" "$extra")
    log=$LOGS/build-$name.log
    if [[ -f $venv/.torchtpu-stamp && $(cat "$venv/.torchtpu-stamp") == "$hash" && -x $venv/bin/python ]]; then
        # reused; this checkout (CI clones to a new folder) is installed editable in it again if it moved
        if [[ $(cat "$venv/.torchtpu-repo" 2>/dev/null) != "$REPO" ]]; then
            "$venv/bin/python" -m pip install -q --no-deps -e "$REPO" >"$log" 2>&1 \
                || { cat "$log" >&2; ENV_FAILED+=("$name"); record "env $name" $(($(now) - start)) "FAILED (reinstalling torchtpu)"; return 1; }
            echo "$REPO" > "$venv/.torchtpu-repo"
        fi
        record "env $name" $(($(now) - start)) "reused ($venv)"
        return 0
    fi
    rm -rf "$venv"
    for attempt in 1 2 3; do
        echo "== building $name ($builder $venv), attempt $attempt"
        if bash "$builder" "$venv" >"$log" 2>&1; then
            echo "$hash" > "$venv/.torchtpu-stamp"
            echo "$REPO" > "$venv/.torchtpu-repo"
            tail -n 2 "$log"
            record "env $name" $(($(now) - start)) "built (attempt $attempt)"
            return 0
        fi
        echo "== building $name failed (attempt $attempt); its log ends:" >&2
        grep -v "^WARNING: Location .* is ignored" "$log" | tail -n 15 >&2
        (( attempt < 3 )) && sleep $((30 * attempt * attempt))
    done
    rm -rf "$venv"
    ENV_FAILED+=("$name")
    record "env $name" $(($(now) - start)) "ENVIRONMENT FAILED after 3 attempts (not a test result; log: $log)"
    return 1
}

# The junit file's verdict: every selected test ran and none skipped (but for multi-host/GPU/TPU).
check_junit() {
    "$PYTHON" - "$1" <<'PY'
import re, sys, xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
allowed = re.compile(r"multi-host|several hosts|\bGPU\b|\bTPU\b|CUDA", re.I)
bad = []
for case in cases:
    for skip in case.findall("skipped"):
        reason = skip.get("message", "")
        if not allowed.search(reason):
            bad.append(f"{case.get('classname')}::{case.get('name')}: {reason}")
print(f"{len(cases)} tests in {sys.argv[1]}")
if not cases:
    sys.exit("no test ran")
if bad:
    sys.exit("selected tests were skipped (the tier runs them all):\n  " + "\n  ".join(bad))
PY
}

# run_tests NAME [pytest options --] NODEIDS...: the node ids in the part's venv
run_tests() {
    local name=$1 venv=$CACHE/$1 start rc xml=$LOGS/$1.xml
    shift
    start=$(now)
    echo "== $name: ${#@} test selections in $venv"
    "$venv/bin/python" -m pytest -p no:cacheprovider -rs -n 0 --junitxml="$xml" "$@"
    rc=$?
    if (( rc == 0 )) && ! check_junit "$xml"; then
        rc=1
    fi
    if (( rc == 0 )); then
        record "tests $name" $(($(now) - start)) "passed"
    else
        FAILED+=("$name")
        record "tests $name" $(($(now) - start)) "FAILED (pytest exit $rc)"
    fi
}

# checkout_in NAME: a venv a builder made beside its part's own ($CACHE/NAME), with this checkout
# installed in it again if it moved (what ensure_env does for the part's venv)
checkout_in() {
    local venv=$CACHE/$1
    if [[ ! -x $venv/bin/python ]]; then
        ENV_FAILED+=("$1")
        record "env $1" 0 "ENVIRONMENT MISSING (its builder did not make it)"
        return 1
    fi
    if [[ $(cat "$venv/.torchtpu-repo" 2>/dev/null) != "$REPO" ]]; then
        "$venv/bin/python" -m pip install -q --no-deps -e "$REPO" >"$LOGS/build-$1.log" 2>&1 \
            || { cat "$LOGS/build-$1.log" >&2; ENV_FAILED+=("$1"); return 1; }
        echo "$REPO" > "$venv/.torchtpu-repo"
    fi
}

leftovers() {  # processes started from a venv of the tier that are still running
    pgrep -af "$CACHE/" | grep -v -e pgrep -e "integration_tests.sh" || true
}

# ------------------------------------------------------------------ the parts
part_vllm() { build_part vllm && run_tests vllm "${VLLM_TESTS[@]}"; }
part_sglang() { build_part sglang && run_tests sglang "${SGLANG_TESTS[@]}"; }
part_extras() { build_part extras && run_tests extras "${EXTRAS_TESTS[@]}"; }
part_torchtitan() { build_part torchtitan && run_tests torchtitan -m slow "${TORCHTITAN_TESTS[@]}"; }
part_rl() {
    build_part rl && checkout_in verl-trl || return 1
    run_tests verl "${RL_TESTS[@]}"
    run_tests verl-trl "${RL_TRL_TESTS[@]}"
}

BUILD_ONLY=0
if [[ ${1:-} == --build ]]; then
    BUILD_ONLY=1
    shift
fi
PARTS=("$@")
(( ${#PARTS[@]} )) || PARTS=(vllm sglang extras torchtitan rl)
for part in "${PARTS[@]}"; do
    case $part in
        vllm|sglang|extras|torchtitan|rl) ;;
        *) echo "unknown part: $part (vllm sglang extras torchtitan rl)" >&2; exit 2 ;;
    esac
done

build_part() {  # the venv of one part (what part_<name> builds before its tests)
    case $1 in
        vllm) ensure_env vllm tools/vllm_env.sh ;;
        sglang) ensure_env sglang tools/sglang_env.sh ;;
        torchtitan) ensure_env torchtitan tools/torchtitan_env.sh ;;
        rl) ensure_env verl tools/verl_env.sh ;;
        extras) ensure_env extras tools/extras_env.sh "$("$PYTHON" -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies'])")" ;;
    esac
}

if (( BUILD_ONLY )); then
    start=$(now)
    pids=()
    for part in "${PARTS[@]}"; do
        (build_part "$part"; rc=$?; printf '%s\n' "${REPORT[@]}"; exit $rc) > "$LOGS/build-$part.out" 2>&1 &
        pids+=($!)
    done
    rc=0
    for i in "${!PARTS[@]}"; do
        wait "${pids[$i]}" || rc=1
        cat "$LOGS/build-${PARTS[$i]}.out"
    done
    echo "== integration venvs: $(($(now) - start)) s for ${PARTS[*]}$( ((rc)) && echo ' (an ENVIRONMENT FAILED: see above; not a test result)')"
    exit $rc
fi
TOTAL_START=$(now)
for part in "${PARTS[@]}"; do
    "part_$part"
    left=$(leftovers)
    if [[ -n $left ]]; then
        echo "== processes left behind by $part:" >&2
        echo "$left" >&2
        FAILED+=("$part (left processes behind)")
    fi
done

echo
echo "== integration tier: wall time per part (logs and junit files in $LOGS)"
printf '%s\n' "${REPORT[@]}"
echo "total                        $(($(now) - TOTAL_START))s"
if (( ${#ENV_FAILED[@]} )); then
    echo "environment failures (not test results): ${ENV_FAILED[*]}" >&2
fi
if (( ${#FAILED[@]} )); then
    echo "test failures: ${FAILED[*]}" >&2
fi
(( ${#ENV_FAILED[@]} == 0 && ${#FAILED[@]} == 0 ))
