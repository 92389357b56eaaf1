#!/usr/bin/env bash
# The GPU run behind benchmarks/RESULTS.md's "GPU backend" section: on a machine with one NVIDIA
# GPU and the image's python3 (torch, triton, transformers; no network, pagedserve not installed):
#
#     OUT=DIR bash scripts/gpu_run.sh [SECONDS [gpu_check options]]   # 400 s in all by default
#     OUT=DIR bash scripts/gpu_run.sh 400 --dry-run                    # the same on a CPU (tiny shapes)
#
# Logs and JSON go to $OUT (default ./gpu_out).
# 1. wheels carried in .whl/ (what pagedserve imports and the image lacks) into /tmp/site;
# 2. the device, driver and versions (env.txt);
# 3. the CPU kernels built in the background (section 3 of the check runs a CPU engine);
# 4. the tests that run on the GPU when torch sees one (pytest.log): the Triton kernels against
#    the torch reference, compiled; their 64-bit offsets; the engine on the Triton backend
#    (a tiny Llama, Gemma 2 / 3 with windows and soft-capping, gpt-oss with sinks) against the
#    torch backend and transformers; CUDA-graph padding;
# 5. benchmarks/gpu_moe.py: the MoE experts' Triton grouped GEMM checked and timed against the torch loop
#    over experts at OLMoE / Qwen3-30B-A3B / gpt-oss-20b shapes (gpu_moe.log, gpu_moe.json), a quarter of
#    what is left;
# 6. benchmarks/gpu_check.py in what time is left (gpu_check.log, gpu_check.json).
set -uo pipefail
START=$(date +%s)
TOTAL=${1:-400}
shift || true
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
left() { echo $((TOTAL - ($(date +%s) - START))); }

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/tmp/pagedserve-cache
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1     # no network there: never wait on the Hub
unset TRITON_INTERPRET
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:$PYTHONPATH
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 - <<'EOF'
import platform, torch, triton, transformers
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}, transformers {transformers.__version__}")
print(f"device: {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
EOF
    lscpu | grep -E "Model name|^CPU\(s\)"
} 2>&1 | tee "$OUT/env.txt"

python3 -c "from pagedserve.kernels.prebuild import prebuild; print(prebuild())" >"$OUT/prebuild.log" 2>&1 &
PREBUILD=$!

# Only the plugins these tests use (another installed plugin may import what the image lacks).
TESTS=(tests/test_triton_kernels.py tests/test_triton_offsets.py tests/test_cuda_graphs.py
       tests/test_hybrid_models.py::test_triton_backend_matches_transformers
       tests/test_moe_models.py::test_gpt_oss_matches_transformers tests/test_triton_moe.py)
run_tests() {
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout "$1" python3 -m pytest -q -p no:cacheprovider -p pytest_timeout \
        "${@:2}" "${TESTS[@]}" 2>&1 | tee -a "$OUT/pytest.log"
    return "${PIPESTATUS[0]}"
}
PYTEST_S=$(( $(left) * 3 / 10 ))
echo "[gpu_run] pytest, at most ${PYTEST_S}s"
if python3 -c "import xdist" 2>/dev/null; then
    run_tests "$PYTEST_S" -p xdist.plugin -n 6; RC=$?
    if [ "$RC" -ge 2 ] && [ "$RC" -ne 124 ]; then      # interrupted, or xdist itself failed: once more, serially
        run_tests $(( PYTEST_S / 2 )); RC=$?
    fi
else
    run_tests "$PYTEST_S"; RC=$?
fi
echo "[gpu_run] pytest exit $RC"

MOE_S=$(( $(left) / 4 ))
MOE_ARGS=()
[[ " $* " == *" --dry-run "* ]] && MOE_ARGS=(--dry-run)
echo "[gpu_run] gpu_moe, at most ${MOE_S}s"
timeout "$MOE_S" python3 benchmarks/gpu_moe.py "${MOE_ARGS[@]}" --json "$OUT/gpu_moe.json" 2>&1 | tee "$OUT/gpu_moe.log"
echo "[gpu_run] gpu_moe exit ${PIPESTATUS[0]}"

wait "$PREBUILD"
CHECK_S=$(( $(left) - 10 ))
echo "[gpu_run] gpu_check, ${CHECK_S}s left"
timeout "$CHECK_S" python3 benchmarks/gpu_check.py --budget-seconds $((CHECK_S - 15)) \
    --json "$OUT/gpu_check.json" "$@" 2>&1 | tee "$OUT/gpu_check.log"
echo "[gpu_run] gpu_check exit ${PIPESTATUS[0]}, $(( $(date +%s) - START ))s in all"
