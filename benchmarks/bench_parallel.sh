#!/usr/bin/env bash
# One `gpusnap bench` per GPU, all at once, for a host with several GPUs and a per-command
# time limit. Usage: benchmarks/bench_parallel.sh "ARGS for GPU 0" "ARGS for GPU 1" ...
# Each runs as `python3 -m gpusnap bench ARGS --out DIR` on its own GPU (CUDA_VISIBLE_DEVICES),
# bounded by LIMIT_S (default 580; give each a smaller --budget-s so its report is written),
# and its report and log come back packed as $OUT/benchI.tgz. The runs share the host's cores,
# memory and tmpfs: say so next to any figure they produce (BENCHMARKS.md).
set -uo pipefail
if [ $# -eq 0 ]; then
  echo "usage: $0 \"ARGS for GPU 0\" [\"ARGS for GPU 1\" ...]" >&2
  exit 2
fi
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
LIMIT_S=${LIMIT_S:-580}
mkdir -p "$OUT"
# tmpfs is sized when mounted; a VM whose memory grows later leaves it too small for GPT-2 large
mount -o remount,size=90% /dev/shm 2>/dev/null || true
{ nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc; df -h /dev/shm /tmp; } > "$OUT/host.txt" 2>&1
i=0
for args in "$@"; do
  d=$(mktemp -d)
  (
    echo "gpusnap bench $args" > "$d/command.txt"
    # shellcheck disable=SC2086  # ARGS is a word list on purpose
    CUDA_VISIBLE_DEVICES=$i timeout -s INT -k 15 "$LIMIT_S" python3 -m gpusnap bench $args --out "$d/bench" \
      > "$d/bench.log" 2>&1
    echo "exit $?" >> "$d/bench.log"
    tar czf "$OUT/bench$i.tgz" -C "$d" .
  ) &
  i=$((i + 1))
done
wait
for f in "$OUT"/bench*.tgz; do echo "== $f"; tar xzf "$f" -O ./bench.log | tail -n 25; done
