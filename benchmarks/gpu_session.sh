#!/bin/bash
# One device call that checks and times what the issues ask for, in order of cost, each step under its
# own time limit, everything under $OUT/r and packed into $OUT/results.tgz (the device tool returns at most
# a handful of files). Run from the repo root on the GPU machine, the peers' builds carried in .peers:
#
#     bash benchmarks/gpu_session.sh [quick|full]        # quick ~6 min, full ~12 min (two calls' worth)
#
# quick: GPU tests of the launch paths, the core grid with the peers, decode step, host time, training.
# full:  adds the high-rank and mixed grids and the whole GPU test suite.
set -u
MODE=${1:-quick}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD LORA_PEERS=${LORA_PEERS:-$PWD/.peers}
OUT=${OUT:-/tmp/lora_ops_out}
R=$OUT/r
mkdir -p "$R"
T0=$(date +%s)
step() {  # step NAME LIMIT_S COMMAND...: run, log to $R/NAME.log, print the exit status and the time
    local name=$1 limit=$2; shift 2
    timeout "$limit" "$@" > "$R/$name.log" 2>&1
    local rc=$?
    echo "[$(( $(date +%s) - T0 )) s] $name rc=$rc"
}
TESTS="tests/test_fast_launch.py tests/test_overlap.py tests/test_layers.py tests/test_autograd.py"
[ "$MODE" = full ] && TESTS="tests"
step tests 300 env LORA_OPS_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider $TESTS
step core 200 python benchmarks/bench_lora.py --grid core --time-budget 170 --out "$R"
if [ "$MODE" = full ]; then
    step highrank 200 python benchmarks/bench_lora.py --grid highrank --time-budget 170 --out "$R"
    step mixed 120 python benchmarks/bench_lora.py --grid mixed --time-budget 100 --out "$R"
fi
step decode 90 python benchmarks/bench_decode.py --out "$R"
step host 90 python benchmarks/host_overhead.py --out "$R"
step grad 150 python benchmarks/grad_check.py --out "$R"
tar czf "$OUT/results.tgz" -C "$OUT" r
tail -3 "$R/tests.log"
sed -n '/geometric/,$p' "$R/core.log" | head -12
tail -3 "$R/decode.log"
tail -3 "$R/host.log"
tail -6 "$R/grad.log"
