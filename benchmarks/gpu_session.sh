#!/bin/bash
# Device calls that check and time what the issues ask for, each step under its own time limit, everything
# under $OUT/r and packed into $OUT/results.tgz (the device tool returns at most a handful of files). Each
# part fits one call (the device tool allows 600 s per call). Run from the repo root on the GPU machine,
# the peers' builds carried in .peers:
#
#     bash benchmarks/gpu_session.sh quick     # GPU tests of the launch paths, training, codegen and
#                                              # determinism, core grid with the peers, host time, decode
#                                              # step (~7 min)
#     bash benchmarks/gpu_session.sh props     # the kernels' property tests (hypothesis "gpu" profile: 4
#                                              # examples each; compiles dominate: not yet seen to finish
#                                              # in one call; PROPS_K="expand or ..." picks a subset)
#     bash benchmarks/gpu_session.sh more      # high-rank and mixed grids, gradients + training step and
#                                              # its profile (~8 min)
#     bash benchmarks/gpu_session.sh stacked   # apply_lora(stack_a=True) (DESIGN §4): its GPU tests (with
#                                              # CUDA-graph capture), the core grid with the `stacked` and
#                                              # `in_order` layers (paired with the base layer),
#                                              # the decode step without and with it, and the Llama high-rank
#                                              # grid's stacked rows to 1024 tokens (~9 min)
#     bash benchmarks/gpu_session.sh large     # 1024-8192 tokens, where the write-first path and the store
#                                              # entries run: GPU tests of the configs and the write-first
#                                              # path, the core grid's rows there with the peers and the layer
#                                              # variants (~3 min)
#     bash benchmarks/gpu_session.sh checks    # the tuner's output check on the GPU (its tests, bf16 judged
#                                              # there), race_sweep.py on the high-rank grid (every path run 4
#                                              # times: values and bits), and one small real tune with the
#                                              # check on, its stderr kept (~5 min)
#     bash benchmarks/gpu_session.sh bench     # quick's and host's benchmarks without their tests: core grid with
#                                              # the peers, host time, decode step without and with stack_a (~7 min)
#     bash benchmarks/gpu_session.sh host      # session 24's host-path changes (bound eager calls, metadata
#                                              # strides, autocast): their GPU tests, host_overhead at 64 and
#                                              # 1 token, the decode step with stack_a (~7 min; host_python
#                                              # runs on the CPU machine only: Triton 3.6's interpreter there
#                                              # refuses numpy 2)
#     BASE=DIR bash benchmarks/gpu_session.sh train   # the training path's host work (session 25: eager
#                                              # autograd without the dispatcher, one backward op per role;
#                                              # 26: batch copies; 28: unchecked backward ops; 29: bound
#                                              # backwards and training deltas): their GPU tests,
#                                              # then grad_check's timing rows and train_profile at 1024
#                                              # tokens for the tree in DIR (git archive of the commit
#                                              # before, carried in .scratch) and this one in turn (~9 min)
#     BASE=DIR bash benchmarks/gpu_session.sh float32   # session 25's float32 GPU tiles: the float32 GPU
#                                              # tests of the launch paths and gradients, then the core
#                                              # subset in float32 for the tree in DIR and this one (~7 min)
#     BASE=DIR bash benchmarks/gpu_session.sh float16   # float16's expand tiles: the float16 GPU tests,
#                                              # then Llama's high-rank rows at 256-4096 tokens in float16
#                                              # for the tree in DIR and this one (~8 min)
#     bash benchmarks/gpu_session.sh turns     # the rank loop's planes in turn (session 26 lab, one dot a
#                                              # step): its GPU test, then lab_planes_in_turn.py on the
#                                              # high-rank rows at 1024 / 4096 tokens, both modes (~9 min)
#     bash benchmarks/gpu_session.sh suite1    # every test file but the property tests on the GPU, file by
#     bash benchmarks/gpu_session.sh suite2    # file (75 s each, short tracebacks), in two halves (~5 min
#                                              # each): what the CPU suite cannot see (session 27 found six
#                                              # GPU-only failures in files no mode ran on the GPU; on a cold
#                                              # machine test_autograd, test_model_compile, test_codegen and
#                                              # test_peft_parity need ~150 s: `files` with FILE_LIMIT=150)
#     FILES="tests/a.py ..." bash benchmarks/gpu_session.sh files   # those test files, as suite1 runs its own
#                                              # (FILE_LIMIT=s each, 75 unless set; FILE_K=pytest -k)
#     BASE=DIR bash benchmarks/gpu_session.sh hostab   # eager host time (host_overhead --subset: what LoRA
#                                              # adds, with and without stack_a) for the tree in DIR and this
#                                              # one, in turn three times (~3 min)
#     bash benchmarks/gpu_session.sh fill      # the one-launch batch metadata fill (session 28; the GPU default
#                                              # since 33, LORA_OPS_ONE_LAUNCH_FILL=0 the torch path): its
#                                              # GPU tests, then lab_batch_fill.py (host and GPU µs of
#                                              # LoRABatch.update by either path, metadata compared), then the
#                                              # decode step's synced column by either fill with FILL_DECODE=1
#                                              # (~9 min; ~7 without)
#     bash benchmarks/gpu_session.sh pads      # stack_a's pads per token bucket and its stack limits retuned
#                                              # on this GPU (--kinds stack_pad, then stack_limit, --merge;
#                                              # Llama r16/r64), then the stacked layer at 256 / 1024 tokens
#                                              # under the table before and after, in turn; both tables come
#                                              # back under $OUT (~9 min)
#     bash benchmarks/gpu_session.sh gradx     # lora_grad_x writing every row (session 43): the gradient and
#                                              # training tests on the GPU, then lab_train_ops with the op on a
#                                              # zero-filled dx beside it (AB_GRAD_X_FILL=1; Llama r16/r64 at
#                                              # 1024 / 4096 tokens, no sweep) (~5 min)
#     BASE=DIR bash benchmarks/gpu_session.sh writeall   # session 44: the write-first expand's work list on the
#                                              # slots' own lanes, and the shrink op and lora_grad_h writing all
#                                              # of h: the write-first, gradient and training tests on the GPU,
#                                              # lora_linear's write-first rows (core grid, 1024 / 4096 tokens,
#                                              # in_order) for the tree in DIR and this one, then lab_train_ops
#                                              # with the ops on a zero-filled h beside them (AB_SHRINK_FILL=1;
#                                              # Llama r16/r64 at 1024 / 4096 tokens, no sweep) (~9 min)
#     bash benchmarks/gpu_session.sh configs   # what the runtime autotune and the heuristic give against
#                                              # the table (core subset), and the high-rank shapes the table
#                                              # lacks tuned into a copy of it under $OUT (~9 min)
#     bash benchmarks/gpu_session.sh tunehere  # a table of this GPU's own where it has none (an H100 takes the
#                                              # H200's): --merge starts from that table, --min-gain 0.02 keeps a
#                                              # retuned shape only where it beats it in turn; TUNE_ARGS picks the
#                                              # shapes (default: Llama r16/r64 at 1-256 tokens, add_lora_'s pair);
#                                              # the table comes back under $OUT: commit it to keep it (~9 min)
#     bash benchmarks/gpu_session.sh pending   # what sessions 44-47 changed (ran on an H100 in session 48): the write-first,
#                                              # aliasing and rank-0 GPU tests (session 44's work.store_zero_rows and
#                                              # the shrink's block_columns; 45's apart_from), the batch fill's tests
#                                              # (46: slots_out, int64 slots past int32), 47's FLOP formulas on
#                                              # CUDA tensors and under capture, race_sweep's core grid
#                                              # (values and bits, every path), the write-first rows (~9 min;
#                                              # SKIP_SWEEP=1 SKIP_LARGE=1: the tests only, ~6)
#     bash benchmarks/gpu_session.sh memcheck  # the kernels' property, write-first and stacked tests under
#                                              # compute-sanitizer's memcheck (every access in bounds; session 49:
#                                              # 342 passed, 0 errors on an H100, ~3.5 min; MEMCHECK_FILES picks files)
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
in_trees() {  # in_trees NAME LIMIT COMMAND...: step NAME_base, then NAME_new: COMMAND run for the tree in $BASE,
              # then this one, with @TREE@ in its words replaced by the tree and @TAG@ by base / new
    local name=$1 limit=$2 tree tag word; shift 2
    for tree in "${BASE:?BASE=the tree to compare}" .; do
        tag=$([ "$tree" = . ] && echo new || echo base)
        local words=()
        for word in "$@"; do word=${word//@TREE@/$tree}; words+=("${word//@TAG@/$tag}"); done
        step "${name}_$tag" "$limit" "${words[@]}"
    done
}
suite_files() {  # suite_files HALF: the test files but the property tests (props), half 1 or 2 of them
    ls tests/test_*.py | grep -v test_kernels_property | awk -v h="$1" '(NR % 2) == (h % 2)'
}
if [ "$MODE" = suite1 ] || [ "$MODE" = suite2 ] || [ "$MODE" = files ]; then
    for f in $([ "$MODE" = files ] && echo "${FILES:?FILES=the test files}" || suite_files "${MODE#suite}"); do
        name=$(basename "$f" .py)
        step "$name" "${FILE_LIMIT:-75}" env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider \
            -rf --tb=short ${FILE_K:+-k "$FILE_K"} "$f"
        grep -E "^FAILED|^ERROR" "$R/$name.log" | head -5
        tail -1 "$R/$name.log"
    done
elif [ "$MODE" = quick ]; then
    # 2026-12-03: 90-110 s did not finish the property subset on a cold machine (hypothesis + compiles;
    # 10-25 s a property test at 12 examples), hence the "gpu" profile's 4; the core grid takes 40-65 s.
    # 2026-12-04: with the property subset in front, 150-200 s cut this step at 53-58% on a cold machine
    # (compiles); the property tests have a mode of their own ("props").
    step tests 170 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_fast_launch.py tests/test_training.py tests/test_codegen.py tests/test_determinism.py \
        tests/test_write_first.py
    step core 110 python benchmarks/bench_lora.py --grid core --time-budget 95 --out "$R"
    step host 75 python benchmarks/host_overhead.py --out "$R"
    step decode 80 python benchmarks/bench_decode.py --out "$R"
elif [ "$MODE" = bench ]; then
    # The benchmarks of quick and host without their tests (after a `files` call has run those): the core grid
    # with the peers and the stacked layers (session 37 ran it without them: no stack_a figure), host time, the
    # decode step without and with stack_a.
    step core 170 python benchmarks/bench_lora.py --grid core --variants stacked --time-budget 150 --out "$R"
    step host 75 python benchmarks/host_overhead.py --out "$R"
    step decode 80 python benchmarks/bench_decode.py --out "$R"
    step decode_stacked 80 python benchmarks/bench_decode.py --stack-a --out "$R/stacked"
elif [ "$MODE" = host ]; then
    step tests 240 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_eager.py tests/test_strided_meta.py tests/test_autocast.py tests/test_plan.py tests/test_layers.py \
        tests/test_errors.py tests/test_stacked.py tests/test_fast_launch.py tests/test_model_compile.py
    step host64 100 python benchmarks/host_overhead.py --out "$R/m64"
    step host1 100 python benchmarks/host_overhead.py --tokens 1 --out "$R/m1"
    step decode_stacked 80 python benchmarks/bench_decode.py --stack-a --out "$R"
elif [ "$MODE" = train ]; then
    step tests 200 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_eager_autograd.py tests/test_autograd.py tests/test_training.py tests/test_batch_copies.py \
        tests/test_eager.py
    for i in 1 2; do   # the trees in turn: the GPU's clock and the host drift between runs
        in_trees "grad$i" $([ $i = 1 ] && echo 150 || echo 90) python @TREE@/benchmarks/grad_check.py --dtypes bf16 \
            --tokens 256 --out "$R/grad${i}_@TAG@"
    done
    mkdir -p "$R/profile_base" "$R/profile_new"
    in_trees profile 60 python @TREE@/benchmarks/train_profile.py --tokens 1024 --layers qkv,o --out "$R"/profile_@TAG@
elif [ "$MODE" = float32 ]; then
    step tests 200 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_autograd.py tests/test_write_first.py tests/test_fast_launch.py -k fp32
    in_trees f32 150 python @TREE@/benchmarks/bench_lora.py --grid core --subset --dtype float32 --peers '' \
        --time-budget 120 --out "$R"/f32_@TAG@
elif [ "$MODE" = float16 ]; then
    step tests 200 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_autograd.py tests/test_write_first.py tests/test_fast_launch.py -k fp16
    in_trees f16 170 python @TREE@/benchmarks/bench_lora.py --grid highrank --models llama3-8b --ms 256,1024,4096 \
        --dtype float16 --peers '' --time-budget 150 --out "$R"/f16_@TAG@
elif [ "$MODE" = turns ]; then
    step tests 90 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_kernels_property.py -k "planes_in_turn or takes_h_as_bf16_planes"
    # Store mode first (lora_linear's path from 1024 tokens), Llama's rows before Phi-4-mini's.
    step turns 470 env BUDGET=440 python benchmarks/lab_planes_in_turn.py
elif [ "$MODE" = hostab ]; then
    # One timing script for both trees (the base tree's copy replaced), the trees in turn three times:
    # the host's speed drifts between runs by more than what a change of a few Python calls moves.
    cp benchmarks/host_overhead.py "${BASE:?BASE=the tree to compare}/benchmarks/"
    for i in 1 2 3; do
        in_trees "host$i" 60 python @TREE@/benchmarks/host_overhead.py --subset --out "$R/host${i}_@TAG@"
    done
    grep -H "LoRA adds" "$R"/host*.log
elif [ "$MODE" = fill ]; then
    # With session 33's two GPU-only tests: a CUDA graph capturing the fill, a split model compiled in one graph.
    step tests 150 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_batch.py tests/test_split_devices.py \
        "tests/test_model_compile.py::test_cuda_graph_captures_the_batch_fill_from_device_slots"
    # Compiled models, CUDA graphs and autograd with every fill through the kernel (the default).
    step tests_on 220 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest \
        -q -p no:cacheprovider -rf tests/test_model_compile.py tests/test_batch_copies.py tests/test_eager_autograd.py
    step fill 150 python benchmarks/lab_batch_fill.py
    if [ -z "${FILL_DECODE:-}" ]; then   # FILL_DECODE=1: the decode step too (~160 s more)
        tar czf "$OUT/results.tgz" -C "$OUT" r
        for l in tests tests_on; do echo "== $l"; grep -E "^FAILED|^ERROR" "$R/$l.log" | head -5; tail -1 "$R/$l.log"; done
        grep -A30 "| L |" "$R/fill.log" | tail -32; exit 0
    fi
    # The decode step's synced column (set_token_slots, replay, synchronize) by either fill.
    step decode_fill_off 80 env LORA_OPS_ONE_LAUNCH_FILL=0 python benchmarks/bench_decode.py --stack-a \
        --out "$R/decode_fill_off"
    step decode_fill_on 80 python benchmarks/bench_decode.py --stack-a --out "$R/decode_fill_on"
elif [ "$MODE" = memcheck ]; then
    sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    step memcheck 280 "$sanitizer" --tool memcheck --print-limit 10 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu \
        python -m pytest -q -p no:cacheprovider -rf \
        ${MEMCHECK_FILES:-tests/test_kernels_property.py tests/test_write_first.py tests/test_stacked.py}
    grep -E "ERROR SUMMARY|^FAILED" "$R/memcheck.log" | sort | uniq -c; tail -1 "$R/memcheck.log"
elif [ "$MODE" = props ]; then
    step tests 560 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_kernels_property.py ${PROPS_K:+-k "$PROPS_K"}
elif [ "$MODE" = stacked ]; then
    step tests 150 bash -c 'LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_stacked.py tests/test_ops_contract.py tests/test_model_compile.py -k "stacked or stack_a or cuda_graph"'
    step core 170 python benchmarks/bench_lora.py --grid core --variants stacked,in_order --time-budget 150 --out "$R"
    step decode 60 python benchmarks/bench_decode.py --out "$R"
    step decode_stacked 60 python benchmarks/bench_decode.py --stack-a --out "$R"
    # Wide stacks (ranks 128-320: where layers.stacked_token_limit stops stacking), no peers.
    step highrank 90 python benchmarks/bench_lora.py --grid highrank --models llama3-8b --ms 1,64,256,1024 \
        --variants stacked --peers '' --time-budget 75 --out "$R"
elif [ "$MODE" = large ]; then
    step tests 90 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider \
        tests/test_configs.py tests/test_write_first.py
    step core 110 python benchmarks/bench_lora.py --grid core --ms 1024,4096,8192 --variants stacked,in_order \
        --time-budget 95 --out "$R"
elif [ "$MODE" = checks ]; then
    step tests 120 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_configs.py -k "check or what_add_lora or store_runner"
    step sweep 150 env GRID=highrank REPEATS=4 BUDGET=135 python benchmarks/race_sweep.py
    cp lora_ops/configs/tuned/NVIDIA_H200.json "$R/"
    step tune 150 python -m lora_ops.tune --model llama3-8b --layers o down --ranks 320 --tokens 4096 --kinds pair \
        --merge --min-gain 0.02 --time-budget 120 --out "$R/NVIDIA_H200.json"
elif [ "$MODE" = tunehere ]; then
    # Not --skip-tuned: after the first run the table holds the other GPU's entries too, which it would skip.
    step tune 540 python -m lora_ops.tune --merge --min-gain 0.02 --time-budget 500 \
        ${TUNE_ARGS:---model llama3-8b --ranks 16 64 --tokens 1 16 64 256 --kinds pair}
    cp lora_ops/configs/tuned/*.json "$R/"
    tail -30 "$R/tune.log"
elif [ "$MODE" = pending ]; then
    step tests 250 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_write_first.py tests/test_autograd.py tests/test_kernels_property.py -k "store_mode or layer_matches \
        or cuda_graph or rows_written or needs_no_zeroed or many_tiles or written_whole or viewing_y or y_that_is_x \
        or overlapping or expand_into or rank_zero_stack"
    step fill 100 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_batch.py tests/test_model_compile.py tests/test_flops.py -k "batch or fill or slots or flops"
    # SKIP_SWEEP=1 / SKIP_LARGE=1: the tests only (~6 min; a call with less device time left)
    [ -n "${SKIP_SWEEP:-}" ] || step sweep 120 env GRID=core REPEATS=3 BUDGET=105 python benchmarks/race_sweep.py
    [ -n "${SKIP_LARGE:-}" ] || step large 100 python benchmarks/bench_lora.py --grid core --ms 1024,4096,8192 \
        --variants in_order --peers '' --time-budget 85 --out "$R"
elif [ "$MODE" = pads ]; then
    mkdir -p "$R/before" "$R/after"
    cp lora_ops/configs/tuned/*.json "$R/before/"
    # PAD_S / LIMIT_S: the two tunes' time budgets (a call with less device time left)
    step tune_pad $(( ${PAD_S:-270} + 30 )) python -m lora_ops.tune --kinds stack_pad --merge --ranks 16 64 \
        --time-budget "${PAD_S:-270}"
    step tune_limit $(( ${LIMIT_S:-110} + 20 )) python -m lora_ops.tune --kinds stack_limit --merge --ranks 16 64 \
        --time-budget "${LIMIT_S:-110}"
    cp lora_ops/configs/tuned/*.json "$R/after/"
    for table in before after; do
        step "ab_$table" 70 env LORA_OPS_TUNED_DIR="$R/$table" python benchmarks/bench_lora.py --grid core \
            --variants stacked --ms 256,1024 --peers '' --time-budget 55 --out "$R/ab_$table"
    done
elif [ "$MODE" = gradx ]; then
    step tests 200 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_autograd.py tests/test_training.py
    step lab_gradx 200 env AB_GRAD_X_FILL=1 SWEEP=0 MODELS=llama3-8b RANKS=16,64 MS=1024,4096 BUDGET=180 OUT="$R" \
        python benchmarks/lab_train_ops.py
elif [ "$MODE" = writeall ]; then
    # SKIP_LARGE=1 / SKIP_LAB=1: without the write-first rows / the lab (a call with less device time left)
    step tests 230 env LORA_OPS_TEST_DEVICE=cuda HYPOTHESIS_PROFILE=gpu python -m pytest -q -p no:cacheprovider -rf \
        tests/test_write_first.py tests/test_autograd.py tests/test_training.py
    [ -n "${SKIP_LARGE:-}" ] || in_trees large 80 python @TREE@/benchmarks/bench_lora.py --grid core --ms 1024,4096 \
        --variants in_order --peers '' --time-budget 65 --out "$R"/large_@TAG@
    [ -n "${SKIP_LAB:-}" ] || step lab_fill 170 env AB_SHRINK_FILL=1 SWEEP=0 MODELS=llama3-8b RANKS=16,64 MS=1024,4096 BUDGET=150 OUT="$R" \
        python benchmarks/lab_train_ops.py
elif [ "$MODE" = configs ]; then
    step variants 245 python benchmarks/bench_lora.py --grid core --subset --variants autotune,heuristic \
        --peers '' --time-budget 225 --out "$R"
    cp lora_ops/configs/tuned/NVIDIA_H200.json "$R/"
    # The high-rank shapes the table does not hold yet, every bucket but 8192 (4096's entries serve it);
    # 2026-12-03: buckets 1-64 take ~5 s a shape, and a call fits about 45 shapes.
    step tune 250 python -m lora_ops.tune --model llama3-8b phi4-mini --ranks 128 256 320 \
        --tokens 1 16 64 256 1024 4096 --merge --skip-tuned --time-budget 225 --out "$R/NVIDIA_H200.json"
else
    step highrank 150 python benchmarks/bench_lora.py --grid highrank --time-budget 130 --out "$R"
    step grad 150 python benchmarks/grad_check.py --out "$R"   # 110 s was too little on a cold machine
    step profile 60 python benchmarks/train_profile.py --out "$R"
    step mixed 120 python benchmarks/bench_lora.py --grid mixed --time-budget 105 --out "$R"   # 70 s left rows out
fi
tar czf "$OUT/results.tgz" -C "$OUT" r
for log in tests core host decode decode_stacked highrank grad profile mixed variants sweep tune grad2_base grad2_new \
        profile_base profile_new f32_base f32_new f16_base f16_new turns tests_on fill decode_fill_off decode_fill_on \
        tune_pad tune_limit ab_before ab_after lab_gradx large_base large_new lab_fill fill sweep large; do
    [ -f "$R/$log.log" ] || continue
    echo "== $log"; grep -A12 geometric "$R/$log.log" | head -8 || true; tail -3 "$R/$log.log"
done
