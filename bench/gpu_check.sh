#!/usr/bin/env bash
# The GPU check of issue 23 (Scale), about 8 minutes on one H200 (no test suite):
#   0. install from the working tree (scripts/setup.sh: the CUDA build of torch)
#   1. the engine table (bench/bench_engine.py) in bfloat16 and float32 at batch 8 and 16 on cuda,
#      modes floor, scoring, budget (token-budget micro-batches), compiled, loop
#   2. the token-budget length sweep (32..512 response tokens, batch 8; the loop squares-only and
#      with the same sums), with the acceptance line
#   3. a 64-sample calibration of the embedded default (rl-arithmetic, 8 prompts x 8), wall time
#   4. score_sums on cuda against cpu on the same batch: max relative error of every sum
# Writes six flat files under $OUT (default ./gpu-check): summary.txt (the tables and lines),
# engine.json, sweep-length.json, calibrate.json, cuda-vs-cpu.json, log.txt.
#
# Usage: OUT=dir bash bench/gpu_check.sh [--dry-run] [--cpu-smoke]
#   --dry-run    print the commands, run nothing
#   --cpu-smoke  every step on the CPU with tiny random models and the current python ($PYTHON,
#                default python3; no install): the script's own test, minutes on a laptop
# Without a CUDA device and without --cpu-smoke it stops with an error; it never skips a step.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
SMOKE=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --cpu-smoke) SMOKE=1 ;;
    *) echo "gpu_check.sh: unknown argument $arg (expected --dry-run, --cpu-smoke)" >&2; exit 2 ;;
  esac
done

OUT=${OUT:-gpu-check}
WORK=$(mktemp -d)  # the run directory and the per-table JSON: outside $OUT, which stays flat and small
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: > "$LOG"
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$SMOKE" = 1 ]; then
  PY=${PYTHON:-python3}
  DEVICE=cpu MODEL=tiny DTYPES="float32" BATCHES="2" ROUNDS=1
  TABLE="--length 24 --response 8 --max-batch-tokens 32 --threads 1"
  SWEEP="--values 8 16 --prompt 8 --max-batch-tokens 24 --threads 1"
  MODES=${MODES:-floor,scoring,budget,loop}  # compiled: add it to MODES to time the compilation too
else
  PY=.venv/bin/python
  DEVICE=cuda MODEL=default DTYPES="bfloat16 float32" BATCHES="8 16" ROUNDS=3
  TABLE="--length 128 --response 64"
  SWEEP=""
  MODES=${MODES:-floor,scoring,budget,compiled,loop}
fi

run() {  # echo the command into the log; run it unless --dry-run; a failing step stops the script
  echo "+ $*" | tee -a "$LOG"
  [ "$DRY" = 1 ] && return 0
  "$@" 2>&1 | tee -a "$LOG"
}

if [ "$SMOKE" = 0 ]; then
  if [ "$DRY" = 0 ] && ! (command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1); then
    echo "gpu_check.sh: no CUDA device (nvidia-smi fails) at $(hostname); run it on a GPU machine, or pass --cpu-smoke" >&2
    exit 1
  fi
  run bash scripts/setup.sh
  run "$PY" -c "import torch, sys; ok = torch.cuda.is_available(); print('cuda:', ok, torch.__version__); sys.exit(0 if ok else 1)"
fi

# 1. the engine table
for dtype in $DTYPES; do
  for batch in $BATCHES; do
    run timeout 240 "$PY" bench/bench_engine.py --model "$MODEL" --device "$DEVICE" --dtype "$dtype" --batch "$batch" \
      --rounds "$ROUNDS" --modes "$MODES" $TABLE --json "$WORK/engine-$dtype-$batch.json"
  done
done

# 2. the token-budget length sweep (batch 8 on the GPU)
run timeout 240 "$PY" bench/bench_engine.py --model "$MODEL" --device "$DEVICE" --dtype float32 --sweep length \
  --batch "${BATCHES%% *}" --rounds "$ROUNDS" --modes floor,scoring,budget,loop,loop_sums $SWEEP --json "$OUT/sweep-length.json"

# 3. a 64-sample calibration, timed
if [ "$SMOKE" = 1 ]; then
  run "$PY" -c "
from transformers import AutoTokenizer
from fisher_select.models import resolve_model_path
from tests.tiny import save_small_llama
save_small_llama('$WORK/tiny-llama', AutoTokenizer.from_pretrained(resolve_model_path('smollm2-135m-instruct')), hidden=32, intermediate=64, layers=1)"
  CAL=(--model "$WORK/tiny-llama" --num-prompts 2 --samples-per-prompt 2 --max-new-tokens 4)
else
  CAL=(--num-prompts 8 --samples-per-prompt 8)
fi
CAL_CMD=("$PY" -m fisher_select calibrate --recipe rl-arithmetic "${CAL[@]}" --device "$DEVICE" --no-progress --out "$WORK/run")
START=$(date +%s.%N)
run timeout 300 "${CAL_CMD[@]}"
END=$(date +%s.%N)

# 4. cuda against cpu (cpu against cpu with --cpu-smoke), then the JSON and the summary
[ "$DRY" = 1 ] && { echo "(dry run: nothing ran; then score_sums $DEVICE vs cpu and the summary, under $OUT)"; exit 0; }
run "$PY" - "$DEVICE" "$MODEL" "$OUT/cuda-vs-cpu.json" <<'EOF'
import json, sys
import torch
sys.path.insert(0, "bench")
from bench_engine import build_model, make_batch
from fisher_select.engine.scoring import score_sums

device, name, out = sys.argv[1:]
model = build_model(name, "cpu", torch.float32)
batch = make_batch(model.config.vocab_size, 4, 64, 32, "cpu")
batch.mask[1, :5] = 0  # a left-padded row, as calibrate scores them
batch.resp[1, :5] = False
want = score_sums(model, batch.ids, batch.mask, batch.resp, batch.signal)
model = model.to(device)
got = score_sums(model, *(t.to(device) for t in (batch.ids, batch.mask, batch.resp, batch.signal)))
worst = {}
for kind in ("squares", "signal", "total"):
    a, b = getattr(got, kind), getattr(want, kind)
    worst[kind] = max(float((a[n].cpu() - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)) for n in b)
result = {"device": device, "model": name, "batch": "4 x 64 (32 response), one row left padded", "dtype": "float32",
          "max_relative_error": worst}
print(f"score_sums {device} vs cpu, fp32, 4 x 64: max relative error " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
json.dump(result, open(out, "w"), indent=1)
EOF

"$PY" - "$WORK" "$OUT" "$START" "$END" "${CAL_CMD[*]}" <<'EOF'
import glob, json, os, sys
work, out, start, end, command = sys.argv[1:]
tables = {os.path.basename(p)[len("engine-"):-len(".json")]: json.load(open(p))
          for p in sorted(glob.glob(f"{work}/engine-*.json"))}
json.dump(tables, open(f"{out}/engine.json", "w"), indent=1)
run = {}
if os.path.exists(f"{work}/run/report.json"):
    meta = json.load(open(f"{work}/run/report.json"))
    run = {k: meta.get(k) for k in ("num_samples", "num_prompts", "num_truncated", "checks", "config") if k in meta}
cal = {"command": command, "wall_s": float(end) - float(start), **run}
json.dump(cal, open(f"{out}/calibrate.json", "w"), indent=1)
sweep = json.load(open(f"{out}/sweep-length.json"))
lines = ["# engine tables"]
for key, t in tables.items():
    m = t["meta"]
    lines.append(f"{key}: " + ", ".join(f"{k} {r['vs_floor']:.2f}x" for k, r in t["modes"].items() if r["vs_floor"])
                 + f" ({m['batch']} x {m['length']}); " + (t.get("acceptance") or ""))
    compiled = t["modes"].get("compiled", {}).get("compile_s")
    if compiled:
        lines.append(f"  compile (first step): {compiled:.1f} s")
lines.append(f"# length sweep (batch {sweep['tables'][0]['meta']['batch']})")
for t in sweep["tables"]:
    lines.append(f"{t['value']} response tokens: " + ", ".join(
        f"{k} {r['vs_floor']:.2f}x" for k, r in t["modes"].items() if r["vs_floor"]) + "; " + (t.get("acceptance") or ""))
lines.append(f"# calibration: {cal['wall_s']:.1f} s wall: {command}")
cvc = json.load(open(f"{out}/cuda-vs-cpu.json"))
lines.append(f"# {cvc['device']} vs cpu: " + json.dumps(cvc["max_relative_error"]))
open(f"{out}/summary.txt", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
