#!/usr/bin/env bash
# One device call's worth of GPU checks and measurements, each step time-boxed, logs under
# $OUT (default ./gpu-out), packed into $OUT/suite.tgz. Usage: benchmarks/gpu_suite.sh [demo] [tests]
# [rdiag] [fresh] [serve] [quick] [suspend] [migrate] [migrate_serve] [migrate_general] [migrate_sample] [attr_default] [pool] [cost] [cost_slab] [compiled] (default: demo
# tests). Run from the repository root on the GPU machine. SUITE_S (default 570) bounds the whole call: a
# step gets at most the time left, and one with under 30 s left is skipped, so the logs of the
# steps before it always come back.
# TEST_FILES picks the tests step's files, RDIAG_ARGS restore_diagnosis.py's options, FRESH_MODELS
# and FRESH_ARGS fresh_cold_start.py's, SERVE_ARGS cold_start_serve.py's, MIGRATE_ARGS migrate_bench.py's,
# SUSPEND_ARGS suspend_resume.py's, COST_SYSTEMS/COST_SAVES/COST_S the cost step's.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
# Logs go to $L; after every step they are packed into $OUT/suite.tgz (the device tool returns
# few files, and a step killed at the limit must not lose the logs before it).
OUT=${OUT:-gpu-out}
L=$(mktemp -d)
mkdir -p "$OUT"
pack() { tar czf "$OUT/suite.tgz" --exclude=disk-ckpt -C "$L" . ; }
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(demo tests)
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
             tests/test_chunk_hash.py tests/test_chunk_hash_many.py tests/test_bench_dcp.py tests/test_state_rng.py \
             tests/test_suspend.py tests/test_suspend_lazy.py tests/test_suspend_errors.py tests/test_pool_serve.py} \
             > "$L/tests.log" 2>&1; tail -3 "$L/tests.log" ;;
    rdiag) t 240 python3 benchmarks/restore_diagnosis.py --sample ${RDIAG_ARGS:-} > "$L/rdiag.log" 2>&1
           tail -12 "$L/rdiag.log" ;;
    # the restore server against from_pretrained and the file paths, fresh processes (cold_start_serve.py)
    serve) t 560 python3 benchmarks/cold_start_serve.py ${SERVE_ARGS:-} --out "$L/serve" > "$L/serve.log" 2>&1
           tail -22 "$L/serve.log" ;;
    fresh) for m in ${FRESH_MODELS:-gpt2-large}; do
             t 240 python3 benchmarks/fresh_cold_start.py --model $m ${FRESH_ARGS:-} --out "$L/fresh-$m.json" > "$L/fresh-$m.log" 2>&1
             tail -12 "$L/fresh-$m.log"; done ;;
    quick) t 560 python3 -m gpusnap bench --quick --out "$L/bench" > "$L/quick.log" 2>&1
           tail -30 "$L/quick.log" ;;
    # moving a job and the warm pool (docs/moving.md, docs/pool.md): their acceptance figures
    suspend) t 150 python3 benchmarks/suspend_resume.py ${SUSPEND_ARGS:-} --out "$L/suspend.json" > "$L/suspend.log" 2>&1
             tail -14 "$L/suspend.log" ;;
    migrate) t 240 python3 benchmarks/migrate_bench.py ${MIGRATE_ARGS:-} --out "$L/migrate.json" > "$L/migrate.log" 2>&1
             tail -14 "$L/migrate.log" ;;
    # the serving part alone (fast handoff), the general way in the same call, and sampled (where the time goes)
    migrate_serve) t 100 python3 benchmarks/migrate_bench.py --parts serve --out "$L/migrate-serve.json" > "$L/migrate-serve.log" 2>&1
             grep -E '^serving' "$L/migrate-serve.log" ;;
    migrate_general) t 100 python3 benchmarks/migrate_bench.py --parts serve --general --out "$L/migrate-general.json" > "$L/migrate-general.log" 2>&1
             grep -E '^serving' "$L/migrate-general.log" ;;
    migrate_sample) t 100 python3 benchmarks/migrate_bench.py --parts serve --sample --out "$L/migrate-sample.json" > "$L/migrate-sample.log" 2>&1
             grep -A40 'where the' "$L/migrate-sample.log" | cut -c1-100 | head -80 ;;
    # where the default path's promoted save costs the training (cost_attribution.py --default-root)
    attr_default) mkdir -p "${COST_ROOT:-/root/gpusnap-disk}"
          t 280 python3 benchmarks/cost_attribution.py --default-root "${COST_ROOT:-/root/gpusnap-disk}" --rounds 3 \
            --window 12 --variants default,nocheck,inmemory --out "$L/attr" > "$L/attr.log" 2>&1
          rm -rf "${COST_ROOT:-/root/gpusnap-disk}"; tail -8 "$L/attr.log" ;;
    pool) t 240 python3 benchmarks/pool_start.py --out "$L/pool.json" > "$L/pool.log" 2>&1
          tail -14 "$L/pool.log" ;;
    # the default Checkpointer(root) against the pinned copy, root on the local disk (COST_ROOT)
    # (its --budget-s ends the measuring 45 s before the step's limit, so cost.md is written)
    cost) mkdir -p "${COST_ROOT:-/root/gpusnap-disk}"
          left=$(( SUITE_S - (SECONDS - start) - 5 )); lim=${COST_S:-480}; (( left < lim )) && lim=$left
          t $lim python3 -m gpusnap bench --cost --quick --workload ${COST_WORKLOAD:-llama} --budget-s $(( lim - 45 )) \
            --systems ${COST_SYSTEMS:-pinned_writer,gpusnap_default,gpusnap_default_p10} --saves ${COST_SAVES:-5} --every 10 \
            --root "${COST_ROOT:-/root/gpusnap-disk}" --no-plots --out "$L/cost" > "$L/cost.log" 2>&1
          rm -rf "${COST_ROOT:-/root/gpusnap-disk}"; tail -10 "$L/cost/cost.md" ;;
    # the default's first save with 64 MiB slabs: shorter page-locking calls between the training's launches
    cost_slab) mkdir -p "${COST_ROOT:-/root/gpusnap-disk}"
          GPUSNAP_FAST_SLAB_BYTES=$((64 << 20)) t 150 python3 -m gpusnap bench --cost --quick --workload ${COST_WORKLOAD:-llama} \
            --systems gpusnap_default --saves 3 --every 10 --root "${COST_ROOT:-/root/gpusnap-disk}" --no-plots \
            --out "$L/cost-slab64" > "$L/cost-slab64.log" 2>&1
          rm -rf "${COST_ROOT:-/root/gpusnap-disk}"; tail -6 "$L/cost-slab64/cost.md" ;;
    # a compiled model's first windows, with prepare() at set-up (issue 39, item 5)
    compiled) mkdir -p "${COST_ROOT:-/root/gpusnap-disk}"
          t 150 python3 benchmarks/compiled_cost.py --prepare --root "${COST_ROOT:-/root/gpusnap-disk}/compiled" \
            --out "$L/compiled" --window 20 > "$L/compiled.log" 2>&1
          rm -rf "${COST_ROOT:-/root/gpusnap-disk}"; tail -8 "$L/compiled.log" ;;
    *) echo "unknown step $s" ;;
  esac
  pack
done
echo "== done ($(( SECONDS - start )) s)"
