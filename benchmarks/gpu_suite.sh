#!/usr/bin/env bash
# The GPU half of polyamp's measurements, on a CUDA machine with torch already installed.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR      (from the repository root)
#
# polyamp is used straight from this working tree through PYTHONPATH: nothing is installed, so the
# machine's torch is never touched and no package index is needed. Writes into OUT_DIR:
#   environment.json      python, torch, CUDA and GPU as torch sees them
#   conformance.txt/.json `python -m polyamp.conformance --backend torch --device cuda` (output, exit code)
#   gpu-*.json            one file per CUDA target of benchmarks/run.py
#   summary.json          every step's exit code
# Every step runs even if an earlier one fails; the script exits non-zero if any did.
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: bash benchmarks/gpu_suite.sh OUT_DIR" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
export PYTHONPATH="$PWD:$PWD/backends/torch:$PWD/backends/tensorflow${PYTHONPATH:+:$PYTHONPATH}"
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
"$PYTHON" -m polyamp.conformance --backend torch --device cuda --verbose >"$OUT/conformance.txt" 2>&1
CODES[conformance]=$?
"$PYTHON" - "$OUT/conformance.txt" "${CODES[conformance]}" >"$OUT/conformance.json" <<'EOF'
import json, sys
text = open(sys.argv[1]).read()
print(json.dumps({"command": "python -m polyamp.conformance --backend torch --device cuda",
                  "exit_code": int(sys.argv[2]), "output": text}, indent=2))
EOF
echo "conformance: exit ${CODES[conformance]} (see $OUT/conformance.txt)"

for target in gpu-syncs gpu-cuda-graph gpu-recipe gpu-compiled gpu-bf16; do
    "$PYTHON" benchmarks/run.py "$target" --out "$OUT" 2>&1 | tee "$OUT/$target.log"
    CODES[$target]=${PIPESTATUS[0]}
    echo "$target: exit ${CODES[$target]}"
done

status=0
{
    echo "{"
    first=1
    for name in conformance gpu-syncs gpu-cuda-graph gpu-recipe gpu-compiled gpu-bf16; do
        [ $first -eq 1 ] || echo ","
        first=0
        printf '  "%s": %s' "$name" "${CODES[$name]}"
        [ "${CODES[$name]}" -eq 0 ] || status=1
    done
    echo
    echo "}"
} >"$OUT/summary.json"
cat "$OUT/summary.json"
exit $status
