#!/usr/bin/env bash
# One lent GPU session (the device tool's `run`, from the repository root; results land in $OUT):
#   1. the accuracy sweep: every case of `--accuracy --all-cases` in bfloat16 and float16 (three
#      shards each) and the six standard cases in float32, seven processes at once (the GPU idles
#      between their small calls; Triton compiles on the CPUs); rows are written as they finish;
#   2. then, alone on the GPU, the backward tuner (`--tune`: gpu-tune.md) and the benchmark with
#      the configs it chose (gpu-tuned.*), inside --budget.
# Each step has its own timeout, so one failure still leaves the others' files (8 come back at most).
set -u
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/keyfold-gpu}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
PY="${PY:-python3}"
BUDGET="${BUDGET:-80}"
SIZES="${SIZES:-8192,32768}"
MODES="${MODES:-fwd+bwd}"
ACC="${ACC:-140}"
TUNE="${TUNE:-1}"      # 0: the accuracy sweep alone
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } > "$LOG" 2>&1
t0=$(date +%s)
for dt in bfloat16 float16; do
  for k in 0 1 2; do
    timeout "$ACC" "$PY" -m keyfold bench gpu --accuracy --all-cases --dtypes "$dt" --shard "$k/3" \
      > "/tmp/acc-$dt-$k.md" 2> "/tmp/acc-$dt-$k.log" &
  done
done
timeout "$ACC" "$PY" -m keyfold bench gpu --accuracy --dtypes float32 > "/tmp/acc-float32-0.md" 2> "/tmp/acc-float32-0.log" &
wait
for dt in bfloat16 float16 float32; do
  cat /tmp/acc-$dt-0.md > "$OUT/accuracy-$dt.md"
  for k in 1 2; do [ -f "/tmp/acc-$dt-$k.md" ] && grep "^| " "/tmp/acc-$dt-$k.md" | tail -n +2 >> "$OUT/accuracy-$dt.md"; done
  for f in /tmp/acc-$dt-*.log; do echo "== $f"; tr '\r' '\n' < "$f" | grep -v "^accuracy:" | tail -c 1500; done >> "$LOG"
done
echo "accuracy: $(( $(date +%s) - t0 )) s; rows meeting the rule / not:" | tee -a "$LOG"
grep -c "| yes |$" "$OUT"/accuracy-*.md | tee -a "$LOG"
grep "| NO |$" "$OUT"/accuracy-*.md | tee -a "$LOG"
[ "$TUNE" = 1 ] || exit 0
t1=$(date +%s)
timeout $(( BUDGET + 170 )) "$PY" -m keyfold bench gpu --tune --out "$OUT" --budget "$BUDGET" --sizes "$SIZES" \
  --modes "$MODES" >> "$LOG" 2>&1
echo "tune+bench: rc $? in $(( $(date +%s) - t1 )) s" | tee -a "$LOG"
cat "$OUT/gpu-tune.md" 2>/dev/null
sed -n '/## keyfold.s time/,$p' "$OUT/gpu-tuned.md" 2>/dev/null
