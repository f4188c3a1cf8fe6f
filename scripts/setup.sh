#!/usr/bin/env bash
# Install adloco (and with --dev the test/lint tools) into the active Python environment.
#
# torch is installed first and pinned, so that pip never resolves it to a multi-GB CUDA build on a machine
# without a GPU. Where pip's own configuration does not already serve a CPU wheel, point
# ADLOCO_TORCH_INDEX at a CPU wheel index. With a CUDA GPU, any torch >= 2.4 with CUDA works.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
if [ "${1:-}" = "--dev" ]; then
  extras="[dev]"
fi

if python -c "import torch" 2>/dev/null; then
  echo "torch $(python -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  python -m pip install "torch>=2.4"
elif [ -n "${ADLOCO_TORCH_INDEX:-}" ]; then
  python -m pip install "torch==2.13.0" --index-url "$ADLOCO_TORCH_INDEX"
else
  python -m pip install "torch==2.13.0"
fi
python -m pip install -e ".${extras}"
