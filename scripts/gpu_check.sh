#!/usr/bin/env bash
# The GPU evidence kit (benchmarks/gpu_kit.py; docs/performance.md, "GPU evidence kit") in one call.
#   bash scripts/gpu_check.sh --prepare                 # here, before the call: .gpu_kit/ (wheels, built-in task)
#   bash scripts/gpu_check.sh "$OUT"                     # on the GPU machine, with .gpu_kit carried
#   bash scripts/gpu_check.sh outputs/gpu_kit_dry --device cpu --dry_run   # the same parts, tiny, on a CPU
# On the machine it installs the carried wheels into /tmp/gpu_kit_site first (no registry there), then runs the kit:
# about 8 minutes, each part time-boxed; gpu_kit.json, gpu_kit.md and logs.tar.gz land in the output folder.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ "${1:-}" = --prepare ]; then
  shift
  exec "$python" benchmarks/gpu_kit.py --prepare "$@"
fi
out=${1:?usage: bash scripts/gpu_check.sh OUTPUT_DIR [gpu_kit.py flags] | --prepare}
shift
# the carried wheels, unless this Python already has the versions they hold (a development machine)
if ls .gpu_kit/wheels/*.whl >/dev/null 2>&1 && ! "$python" - <<'PY' 2>/dev/null
import glob, importlib.metadata as md, os
for path in glob.glob(".gpu_kit/wheels/*.whl"):
    name, version = os.path.basename(path).split("-")[:2]
    assert md.version(name) == version
PY
then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_kit_site \
    .gpu_kit/wheels/*.whl || { echo "gpu_check: installing .gpu_kit/wheels failed" >&2; exit 1; }
  # compiled once, in parallel: without .pyc files (and with PYTHONDONTWRITEBYTECODE set) every process of the kit
  # would compile transformers and TRL again at import
  "$python" -m compileall -q -j 0 /tmp/gpu_kit_site >/dev/null || echo "gpu_check: compileall failed (slower imports)" >&2
  export PYTHONPATH=/tmp/gpu_kit_site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p "$out"
PYTHONUNBUFFERED=1 "$python" benchmarks/gpu_kit.py --output_dir "$out" "$@"
