#!/usr/bin/env bash
# The GPU check (issue 31): one H200 lent for 15 minutes, offline, with its own python3 (3.12, torch 2.11
# CUDA, transformers 5, peft, accelerate, safetensors, scipy, matplotlib, numpy, pyyaml, tqdm; no gguf, trl,
# bitsandbytes). No venv, no network: the project runs from the working tree on PYTHONPATH; the only
# install is the carried wheels of build/gpu-wheels (pip --no-index --no-deps --target, outside the repo).
# The exact calls, what travels with each and how to read the results: docs/GPU.md.
#
# Steps (name, expected seconds on the H200 (estimates: no GPU run yet), timeout seconds), each written
# to $OUT as soon as it ends, so a run cut off still returns what it measured:
#   prepare    10  25  install the carried wheels; reassemble the GGUF from its two halves, check sha256
#   env        10  30  versions, GPU, which packages are there; score_sums on cuda against the CPU's
#                      on one fp32 batch (a random 8-layer Llama of width 256), worst relative error (env.json)
#   big        90 140  engine overhead and peak memory, random bf16 models of real shapes: Llama-3-8B at
#                      4 x 512 (floor, squares alone) and 2 rows of 2k-token responses through the token
#                      budget; Qwen3-30B-A3B with 8 layers, fallback parameters named (big.json)
#   table      45  90  the engine table on the embedded default's shape, bf16 and fp32 x batch 8 and 16,
#                      and the length sweep 32..512 (table.json)
#   sparse     40  70  one AdamW step at 1% (sparse deltas) against full fine-tuning on the 8B shape,
#                      out of memory reported as such (sparse.json)
#   sampling   30  60  fisher_select's sampler against HF generate, real weights (GGUF converted once
#                      here: ~20 s of it) (sampling.json)
#   demo       30  60  make demo's calibration on the real weights, report.json timings per phase
#                      against the CPU's figure (demo.json)
# Timeouts add up to 475 s (under 8 minutes). $OUT holds 8 files: log.txt, steps.tsv (one line per step:
# expected, timeout, wall seconds, status), env.json, big.json, table.json, sparse.json, sampling.json,
# demo.json. A step that fails or times out is recorded and the next one runs.
#
# Usage: OUT=dir bash bench/gpu_check.sh [--cpu-smoke] [--dry-run]
#        bash bench/gpu_check.sh --stage     the first of the two calls: keep the carried first half
#   --cpu-smoke  the same steps and code paths with tiny sizes on the CPU (bench/gpu_simulate.sh runs it)
#   --dry-run    print the steps (name, expected, timeout, command), run nothing
# Environment: PYTHON (default python3); TIMEOUT_SCALE (multiplies every timeout; default 1, 10 with
# --cpu-smoke); GPU_CHECK_WORK (default /tmp/fisher-select-gpu: the staged half, the wheels' target, the
# reassembled GGUF and the converted model, outside the repo).
set -uo pipefail  # no -e: a failed step is a result; the script goes on to the next
cd "$(dirname "$0")/.."

SMOKE=0 DRY=0 ACTION=run
for arg in "$@"; do
  case "$arg" in
    --cpu-smoke) SMOKE=1 ;;
    --dry-run) DRY=1 ;;
    --stage) ACTION=stage ;;
    --prepare) ACTION=prepare ;;  # internal: the prepare step, run under its timeout
    *) echo "gpu_check.sh: unknown argument $arg (expected --cpu-smoke, --dry-run, --stage)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
WORKDIR=${GPU_CHECK_WORK:-/tmp/fisher-select-gpu}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF=$WORKDIR/gguf/$NAME
SITE=$WORKDIR/site
OUT=${OUT:-gpu-check}
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 FISHER_SELECT_CACHE=$WORKDIR/cache

check_part() {  # the sha256 of one carried half against bench/gguf.sha256
  local want
  want=$(awk -v n="$(basename "$1")" '$2 == n {print $1}' bench/gguf.sha256)
  [ -n "$want" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$want" ] || {
    echo "gpu_check.sh: $1 does not match bench/gguf.sha256; rerun bench/gpu_prepare.sh and the call" >&2; return 1; }
}

if [ "$ACTION" = stage ]; then  # call 1: the first half waits outside the repo for call 2
  mkdir -p "$WORKDIR/gguf"
  found=0
  for part in build/gguf/"$NAME".part-*; do
    [ -f "$part" ] || continue
    check_part "$part" || exit 1
    cp "$part" "$WORKDIR/gguf/" && found=1 && echo "staged $part in $WORKDIR/gguf"
  done
  [ "$found" = 1 ] || { echo "gpu_check.sh --stage: no build/gguf/$NAME.part-* carried (carry it)" >&2; exit 1; }
  exit 0
fi

if [ "$ACTION" = prepare ]; then
  mkdir -p "$SITE" "$WORKDIR/gguf"
  if ls build/gpu-wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      build/gpu-wheels/*.whl || exit 1
  else
    echo "no carried wheels in build/gpu-wheels: nothing installed (the GGUF steps need gguf)"
  fi
  for part in build/gguf/"$NAME".part-*; do  # call 2's half; call 1's is staged in $WORKDIR/gguf already
    [ -f "$part" ] && { check_part "$part" && cp "$part" "$WORKDIR/gguf/" || exit 1; }
  done
  ls "$WORKDIR/gguf/$NAME".part-aa "$WORKDIR/gguf/$NAME".part-ab >/dev/null || {
    echo "a half of the GGUF is missing (did the machine go cold between the two calls? see docs/GPU.md)" >&2; exit 1; }
  cat "$WORKDIR/gguf/$NAME".part-aa "$WORKDIR/gguf/$NAME".part-ab > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF"
  [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" = "$(awk -v n=$NAME '$2 == n {print $1}' bench/gguf.sha256)" ] || {
    echo "the reassembled $GGUF does not match bench/gguf.sha256" >&2; exit 1; }
  echo "reassembled $GGUF (sha256 checked)"
  [ "$SMOKE" = 1 ] && exit 0
  exec "$PY" -c "import torch, sys; ok = torch.cuda.is_available(); print('cuda:', ok, torch.__version__); sys.exit(0 if ok else 1)"
fi

SM="" SCALE=${TIMEOUT_SCALE:-1}
[ "$SMOKE" = 1 ] && SM="--smoke" SCALE=${TIMEOUT_SCALE:-10}  # a shared CPU running the real 135M model, not the H200
STEPS=(  # name expected timeout command...
  "prepare 10 25 bash bench/gpu_check.sh --prepare ${SM:+--cpu-smoke}"
  "env 10 30 $PY bench/gpu_steps.py env --out $OUT/env.json"
  "big 90 140 $PY bench/gpu_steps.py big $SM --out $OUT/big.json"
  "table 45 90 $PY bench/gpu_steps.py table $SM --out $OUT/table.json"
  "sparse 40 70 $PY bench/gpu_steps.py sparse $SM --out $OUT/sparse.json"
  "sampling 30 60 $PY bench/gpu_steps.py sampling $SM --gguf $GGUF --out $OUT/sampling.json"
  "demo 30 60 $PY bench/gpu_steps.py demo $SM --gguf $GGUF --out $OUT/demo.json"
)

if [ "$DRY" = 1 ]; then
  for line in "${STEPS[@]}"; do
    read -r name expected limit cmd <<< "$line"
    echo "step $name expected=${expected}s timeout=${limit}s: timeout $limit $cmd"
  done
  exit 0
fi

mkdir -p "$OUT"
LOG=$OUT/log.txt
: > "$LOG"
printf 'step\texpected_s\ttimeout_s\twall_s\tstatus\n' > "$OUT/steps.tsv"
echo "gpu_check.sh $* at $(date -u +%FT%TZ) on $(hostname), smoke=$SMOKE" | tee -a "$LOG"
failed=0
for line in "${STEPS[@]}"; do
  read -r name expected limit cmd <<< "$line"
  limit=$((limit * SCALE))
  echo "+ [$name: expected ${expected}s, timeout ${limit}s] $cmd" | tee -a "$LOG"
  start=$(date +%s%N)
  # shellcheck disable=SC2086  # cmd is a list of words by construction (no spaces inside one)
  timeout --kill-after=5 "$limit" $cmd 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  ms=$((($(date +%s%N) - start) / 1000000))
  wall=$((ms / 1000)).$(printf '%03d' $((ms % 1000)))
  case $rc in 0) status=ok ;; 124|137) status="timeout" ;; *) status="failed($rc)" ;; esac
  [ "$rc" = 0 ] || failed=$((failed + 1))
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$expected" "$limit" "$wall" "$status" >> "$OUT/steps.tsv"
  echo "= $name: $status in ${wall}s" | tee -a "$LOG"
done
tee -a "$LOG" < "$OUT/steps.tsv"
timeout 20 "$PY" bench/gpu_steps.py summary "$OUT" 2>&1 | tee -a "$LOG"  # one line per figure, into log.txt
echo "$failed step(s) not ok; results in $OUT ($(ls "$OUT" | wc -l) files)" | tee -a "$LOG"
exit $((failed > 0))
