#!/usr/bin/env bash
# The outcome study's core, kind after kind in priority order, within MINUTES of wall time (default 120).
# Resumable: every finished cell is skipped, so run it again (in a later session) until it prints "core done".
# Run it alone on the machine (no test suite, no other torch job); commit bench/results/cells/ after it.
#
#   bash bench/outcomes_core.sh 150
set -u
MINUTES=${1:-120}
THREADS=${THREADS:-2}
export HF_HUB_OFFLINE=1
end=$(( $(date +%s) + 60 * MINUTES ))
run() {  # kind recipe cells [extra args]: exit 0 = the kind's cells are all done, 3 = the time ran out
  local kind=$1 recipe=$2 cells=$3; shift 3
  local left=$(( (end - $(date +%s)) / 60 ))
  if [ "$left" -lt 3 ]; then echo "out of time before $kind"; exit 3; fi
  echo "== $kind: up to $left minutes"
  python bench/outcomes.py --v2 --recipe "$recipe" --kind "$kind" --cells "$cells" \
      --threads "$THREADS" --budget-minutes "$left" "$@"
  local rc=$?
  if [ $rc -ne 0 ]; then echo "$kind not finished (exit $rc)"; exit $rc; fi
}
run sft sft-demonstrations bench/results/cells/sft
run opd-pg opd-pg-arithmetic bench/results/cells/opd-pg --prompts fisher_select/recipes/data/arithmetic_chat.jsonl
# RL again, with no reward for a cut response: under rl-arithmetic-graded (its cells: bench/results/cells/rl)
# full fine-tuning learned to run to the token limit in 3 of 6 replicates (docs/OUTCOMES.md, "RL result").
run rl rl-arithmetic-graded-ended bench/results/cells/rl-ended
echo "core done: assemble each kind (docs/OUTCOMES.md, Commands)"
