#!/usr/bin/env bash
# The GPU half of polyamp's measurements, on a CUDA machine with torch already installed.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR      (from the repository root)
#
# polyamp is used straight from this working tree through PYTHONPATH: nothing is installed, so the
# machine's torch is never touched and no package index is needed. Writes into OUT_DIR:
#   environment.json      python, torch, CUDA and GPU as torch sees them
#   conformance.txt/.json `python -m polyamp.conformance --backend torch --device cuda` (output, exit code)
#   jax-conformance.txt/.json     the same for polyamp_jax on JAX's GPU backend, where jax and optax import
#   keras-<backend>-conformance.txt/.json   the same for Keras on its torch and JAX backends, where keras
#                         (and jax) can be imported; a missing framework is recorded as "skipped"
#   cuda-tests.txt/.json  the torch tests with CUDA cases (skip_on_device without a sync, folded clipping),
#                         where pytest can be imported
#   gpu-*.json            one file per CUDA target of benchmarks/run.py
#   jax-cuda.json         the jitted JAX step (benchmarks/run.py jax) on JAX's GPU backend
#   fp8-gpu.json          FP8 recipes against bfloat16 and torchao (benchmarks/fp8_gpu.py), where torchao imports
#   fp8-jax-gpu.json      the JAX/Flax FP8 step against bfloat16 and Flax's fp8 (benchmarks/fp8_jax_gpu.py), where
#                         JAX sees a GPU and flax imports
#   gpu-conformance.json  the conformance runs' counts, for benchmarks/RESULTS.md
#   summary.json          every step's exit code
# Every step runs even if an earlier one fails; the script exits non-zero if any did. GPU_SUITE_SKIP names steps
# not to run (space-separated, e.g. "keras-jax-conformance gpu-training-state"), each recorded as "skipped";
# STEP_TIMEOUT bounds each step (seconds, default 1200).
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: bash benchmarks/gpu_suite.sh OUT_DIR" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
export PYTHONPATH="$PWD:$PWD/backends/torch:$PWD/backends/tensorflow:$PWD/backends/keras:$PWD/backends/jax${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=3
PYTHON=${PYTHON:-python}

python_json() {  # python_json FILE CODE: run CODE, which prints one JSON document, into FILE
    "$PYTHON" -c "$2" >"$1"
}

python_json "$OUT/environment.json" '
import json, platform, torch
print(json.dumps({
    "python": platform.python_version(),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "cuda_available": torch.cuda.is_available(),
    "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
}, indent=2))'

declare -A CODES
asked_to_skip() {  # asked_to_skip NAME: true (and recorded) when GPU_SUITE_SKIP names NAME
    case " ${GPU_SUITE_SKIP:-} " in
    *" $1 "*)
        echo "$1: skipped (GPU_SUITE_SKIP)"
        CODES[$1]='"skipped"'
        return 0
        ;;
    esac
    return 1
}
conformance() {  # conformance NAME COMMAND...: run the suite; keep its output and exit code in NAME.txt/.json
    # A run whose cases were all skipped (no CUDA device seen) exits 0 but checked nothing: recorded as such.
    local name=$1 code
    shift
    asked_to_skip "$name" && return
    timeout "${STEP_TIMEOUT:-1200}" "$@" >"$OUT/$name.txt" 2>&1
    code=$?
    "$PYTHON" - "$OUT/$name.txt" "$code" "${KERAS_BACKEND:-}" "${@:2}" >"$OUT/$name.json" <<'EOF'
import json, re, sys
output, code, keras_backend, *args = sys.argv[1:]
text = open(output).read()
passed = re.search(r"\b(\d+) passed", text)
command = ("KERAS_BACKEND=" + keras_backend + " " if keras_backend else "") + "python " + " ".join(args)
count = int(passed.group(1)) if passed else 0
print(json.dumps({"command": command, "exit_code": int(code), "passed": count, "output": text}, indent=2))
sys.exit(0 if count else 1)
EOF
    if [ $? -ne 0 ] && [ $code -eq 0 ]; then
        CODES[$name]='"nothing ran"'
    else
        CODES[$name]=$code
    fi
    echo "$name: exit ${CODES[$name]} (see $OUT/$name.txt)"
}

conformance conformance "$PYTHON" -m polyamp.conformance --backend torch --device cuda --verbose
if "$PYTHON" -c "import jax, optax; assert jax.default_backend() == 'gpu'" >/dev/null 2>&1; then
    conformance jax-conformance "$PYTHON" -m polyamp.conformance --backend jax --device cuda --verbose
else
    echo "jax-conformance: skipped (jax or optax cannot be imported, or JAX sees no GPU)"
    CODES[jax-conformance]='"skipped"'
fi
KERAS_STEPS=()
for backend in torch jax; do
    name=keras-$backend-conformance
    KERAS_STEPS+=("$name")
    if ! KERAS_BACKEND=$backend "$PYTHON" -c "import keras, $backend" >/dev/null 2>&1; then
        echo "$name: skipped (keras or $backend cannot be imported)"
        CODES[$name]='"skipped"'
        continue
    fi
    KERAS_BACKEND=$backend conformance "$name" "$PYTHON" -m polyamp.conformance --backend keras --device "$backend-cuda" --verbose
done

# The CUDA cases of the torch tests (no host sync with skip_on_device, folded clipping bitwise on the GPU,
# the step compiled with mode="reduce-overhead").
if "$PYTHON" -c "import pytest" >/dev/null 2>&1; then
    conformance cuda-tests "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/test_torch_device_skip.py \
        tests/test_torch_clip_fold.py tests/test_torch_compile.py -k cuda
else
    echo "cuda-tests: skipped (pytest cannot be imported)"
    CODES[cuda-tests]='"skipped"'
fi

TARGETS=(gpu-syncs gpu-cuda-graph gpu-recipe gpu-compiled gpu-bf16 gpu-training-state)
if [ "${CODES[jax-conformance]}" != '"skipped"' ] && "$PYTHON" -c "import jmp" >/dev/null 2>&1; then
    TARGETS+=(jax)
else
    echo "jax: skipped (JAX on GPU, optax and jmp are needed)"
    CODES[jax]='"skipped"'
fi
for target in "${TARGETS[@]}"; do
    asked_to_skip "$target" && continue
    timeout "${STEP_TIMEOUT:-1200}" "$PYTHON" benchmarks/run.py "$target" --out "$OUT" 2>&1 | tee "$OUT/$target.log"
    CODES[$target]=${PIPESTATUS[0]}
    echo "$target: exit ${CODES[$target]}"
done

# FP8 against bfloat16 and torchao's conversion (benchmarks/fp8_gpu.py), where torchao can be imported (the
# machine may have no package index: install its wheel with `pip install --no-deps torchao-*.whl` first).
if ! asked_to_skip fp8-gpu; then
    if "$PYTHON" -c "import torchao.float8" >/dev/null 2>&1; then
        timeout "${STEP_TIMEOUT:-1200}" "$PYTHON" benchmarks/fp8_gpu.py --out "$OUT" 2>&1 | tee "$OUT/fp8-gpu.log"
        CODES[fp8-gpu]=${PIPESTATUS[0]}
        echo "fp8-gpu: exit ${CODES[fp8-gpu]}"
    else
        echo "fp8-gpu: skipped (torchao cannot be imported)"
        CODES[fp8-gpu]='"skipped"'
    fi
fi

# The JAX/Flax FP8 step against its bfloat16 step and Flax's own fp8 (benchmarks/fp8_jax_gpu.py).
if ! asked_to_skip fp8-jax-gpu; then
    if [ "${CODES[jax-conformance]}" != '"skipped"' ] && "$PYTHON" -c "import flax" >/dev/null 2>&1; then
        timeout "${STEP_TIMEOUT:-1200}" "$PYTHON" benchmarks/fp8_jax_gpu.py --out "$OUT" 2>&1 | tee "$OUT/fp8-jax-gpu.log"
        CODES[fp8-jax-gpu]=${PIPESTATUS[0]}
        echo "fp8-jax-gpu: exit ${CODES[fp8-jax-gpu]}"
    else
        echo "fp8-jax-gpu: skipped (JAX on GPU and flax are needed)"
        CODES[fp8-jax-gpu]='"skipped"'
    fi
fi

# The conformance counts as one result (gpu-conformance.json) for benchmarks/RESULTS.md.
"$PYTHON" - "$OUT" <<'EOF2'
import sys
from pathlib import Path

from benchmarks import _common, report

payload = report.conformance_result(Path(sys.argv[1]))
if payload is not None:
    _common.write(Path(sys.argv[1]), payload)
EOF2

status=0
{
    echo "{"
    first=1
    for name in conformance jax-conformance "${KERAS_STEPS[@]}" cuda-tests gpu-syncs gpu-cuda-graph gpu-recipe gpu-compiled gpu-bf16 gpu-training-state jax fp8-gpu fp8-jax-gpu; do
        [ $first -eq 1 ] || echo ","
        first=0
        printf '  "%s": %s' "$name" "${CODES[$name]}"
        [ "${CODES[$name]}" = 0 ] || [ "${CODES[$name]}" = '"skipped"' ] || status=1
    done
    echo
    echo "}"
} >"$OUT/summary.json"
cat "$OUT/summary.json"
exit $status
