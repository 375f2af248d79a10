#!/usr/bin/env bash
# One device call's worth of GPU checks and measurements, each step time-boxed, logs under
# $OUT (default ./gpu-out). Usage: benchmarks/gpu_suite.sh [demo] [tests] [stall] [diag] [incr]
# [restore] [hash] (default: all but hash). Run from the repository root on the GPU machine.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(demo tests stall diag incr restore)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for s in "${steps[@]}"; do
  echo "== $s"
  case $s in
    demo) timeout 120 python3 -m gpusnap demo 2>&1 | tail -3 ;;
    tests) timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda \
             tests/test_concurrent_capture.py tests/test_capture_pieces.py tests/test_validation_cuda.py \
             tests/test_restore_pipelined.py tests/test_restore_lazy.py tests/test_restore_pieces.py \
             tests/test_chunk_hash.py tests/test_chunk_hash_many.py > "$OUT/tests.log" 2>&1; tail -3 "$OUT/tests.log" ;;
    stall) timeout 330 python3 benchmarks/concurrent_stall.py --model gpt2-large --saves 2 --every 20 --batch 4 \
             --configs "validate=0,incremental=0;validate=1,incremental=1" --json "$OUT/stall.json" \
             > "$OUT/stall.log" 2>&1; tail -44 "$OUT/stall.log" ;;
    diag) timeout 150 python3 benchmarks/stall_diagnosis.py > "$OUT/diag.log" 2>&1; tail -6 "$OUT/diag.log" ;;
    incr) timeout 150 python3 benchmarks/incremental_bench.py --out "$OUT/incr.json" > "$OUT/incr.log" 2>&1
          tail -9 "$OUT/incr.log" ;;
    restore) timeout 200 python3 benchmarks/restore_bench.py --repeat 1 --out "$OUT/restore.json" \
               > "$OUT/restore.log" 2>&1; tail -8 "$OUT/restore.log" ;;
    hash) timeout 120 python3 benchmarks/hash_kernel.py --out "$OUT/hash.json" > "$OUT/hash.log" 2>&1
          tail -20 "$OUT/hash.log" ;;
    *) echo "unknown step $s" ;;
  esac
done
