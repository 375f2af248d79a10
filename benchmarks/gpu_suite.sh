#!/usr/bin/env bash
# One device call's worth of GPU checks and measurements, each step time-boxed, logs under
# $OUT (default ./gpu-out). Usage: benchmarks/gpu_suite.sh [demo] [tests] [stall] [diag] [incr]
# [restore] [rdiag] [probe] [inplace] [ring] [fresh] [serve] [gather] [hash] [quick] (default: all but rdiag, probe, inplace, ring, fresh, serve, gather, hash and quick). Run from the repository root on
# the GPU machine; read what comes back with benchmarks/suite_summary.py suite.tgz. SUITE_S
# (default 570) bounds the whole call: a step gets at most the time left,
# and one with under 30 s left is skipped, so the logs of the steps before it always come back.
# STALL_CONFIGS and STALL_ARGS (e.g. --gc-freeze) vary the stall step, STALL_S bounds it (420); TEST_FILES picks the
# tests step's files, RDIAG_ARGS the restore diagnosis's options, PROBE_ARGS restore_probe.py's, INPLACE_ARGS inplace_procs.py's, RING_ARGS ring_readers.py's, FRESH_MODELS and FRESH_ARGS fresh_cold_start.py's, SERVE_ARGS cold_start_serve.py's,
# RESTORE_REPEAT the restore bench's timed runs per measurement (best kept; 1: includes first-use costs).
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
# Logs go to $L; after every step they are packed into $OUT/suite.tgz (the device tool returns
# few files, and a step killed at the limit must not lose the logs before it).
OUT=${OUT:-gpu-out}
L=$(mktemp -d)
mkdir -p "$OUT"
pack() { tar czf "$OUT/suite.tgz" --exclude=disk-ckpt -C "$L" . ; }
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(demo tests stall diag incr restore)
SUITE_S=${SUITE_S:-570}
start=$SECONDS
# timeout with at most the suite's time left: "t 120 cmd..." runs cmd for min(120, left - 5) s.
t() { local left=$(( SUITE_S - (SECONDS - start) - 5 )); local lim=$(( $1 < left ? $1 : left ))
      shift; timeout -s ABRT -k 10 "$lim" "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$L/gpu.txt"
for s in "${steps[@]}"; do
  if (( SUITE_S - (SECONDS - start) < 30 )); then echo "== $s skipped: suite time spent"; continue; fi
  echo "== $s ($(( SECONDS - start )) s)"
  case $s in
    demo) t 120 python3 -m gpusnap demo 2>&1 | tail -3 ;;
    # SIGABRT at the limit: faulthandler prints every thread's stack (a hang shows where it is)
    tests) [ -d .whl ] && pip install -q --no-index --find-links .whl pytest-timeout > /dev/null 2>&1
           t 200 python3 -X faulthandler -m pytest -v -p no:cacheprovider --timeout 50 -m cuda \
             ${TEST_FILES:-tests/test_concurrent_capture.py tests/test_capture_pieces.py tests/test_validation_cuda.py \
             tests/test_restore_pipelined.py tests/test_restore_lazy.py tests/test_restore_pieces.py \
             tests/test_chunk_hash.py tests/test_chunk_hash_many.py tests/test_bench_dcp.py tests/test_state_rng.py} \
             > "$L/tests.log" 2>&1; tail -3 "$L/tests.log" ;;
    stall) t ${STALL_S:-420} python3 benchmarks/concurrent_stall.py --model gpt2-large --saves 2 --every 20 --batch 4 ${STALL_ARGS:-} \
             --configs "${STALL_CONFIGS:-device_snapshot=0,validate=0,incremental=0;device_snapshot=0;device_snapshot=1,incremental=0;device_snapshot=1}" --json "$L/stall.json" \
             > "$L/stall.log" 2>&1; tail -44 "$L/stall.log" ;;
    diag) t 240 python3 benchmarks/stall_diagnosis.py --variants "${DIAG_VARIANTS:-full,plain,no-store,poll,switch}" \
            --trace-dir "$L/traces" > "$L/diag.log" 2>&1
          tail -8 "$L/diag.log" ;;
    incr) t 150 python3 benchmarks/incremental_bench.py --out "$L/incr.json" > "$L/incr.log" 2>&1
          tail -9 "$L/incr.log" ;;
    restore) t 200 python3 benchmarks/restore_bench.py --repeat ${RESTORE_REPEAT:-1} --out "$L/restore.json" \
               > "$L/restore.log" 2>&1; tail -8 "$L/restore.log" ;;
    rdiag) t 240 python3 benchmarks/restore_diagnosis.py --sample ${RDIAG_ARGS:-} > "$L/rdiag.log" 2>&1
           tail -12 "$L/rdiag.log" ;;
    probe) t 150 python3 benchmarks/restore_probe.py ${PROBE_ARGS:-} > "$L/probe.log" 2>&1
           tail -16 "$L/probe.log" ;;
    inplace) t 200 python3 benchmarks/inplace_procs.py ${INPLACE_ARGS:-} > "$L/inplace.log" 2>&1
             tail -16 "$L/inplace.log" ;;
    ring) t 150 python3 benchmarks/ring_readers.py ${RING_ARGS:-} > "$L/ring.log" 2>&1
          tail -12 "$L/ring.log" ;;
    # the restore server against from_pretrained and the file paths, fresh processes (cold_start_serve.py)
    serve) t 560 python3 benchmarks/cold_start_serve.py ${SERVE_ARGS:-} --out "$L/serve" > "$L/serve.log" 2>&1
           tail -22 "$L/serve.log" ;;
    fresh) for m in ${FRESH_MODELS:-gpt2-large}; do
             t 240 python3 benchmarks/fresh_cold_start.py --model $m ${FRESH_ARGS:-} --out "$L/fresh-$m.json" > "$L/fresh-$m.log" 2>&1
             tail -12 "$L/fresh-$m.log"; done ;;
    gather) t 120 python3 benchmarks/gather_copy_bench.py ${GATHER_ARGS:-} --json "$L/gather.json" > "$L/gather.log" 2>&1
            tail -12 "$L/gather.log" ;;
    hash) t 120 python3 benchmarks/hash_kernel.py --out "$L/hash.json" > "$L/hash.log" 2>&1
          tail -20 "$L/hash.log" ;;
    quick) t 560 python3 -m gpusnap bench --quick --out "$L/bench" > "$L/quick.log" 2>&1
           tail -30 "$L/quick.log" ;;
    *) echo "unknown step $s" ;;
  esac
  pack
done
echo "== done ($(( SECONDS - start )) s)"
