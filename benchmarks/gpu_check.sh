#!/usr/bin/env bash
# The GPU check (`make gpu-check`): the `cuda` tests and the GPU benchmark, on a machine with an
# NVIDIA GPU and a CUDA torch but maybe no network and no project environment. fastload is used
# from this checkout's src/; dependencies the machine lacks travel as wheels in .whl/
# (`make gpu-wheels` fetches them where pip works). Results: $OUT (default benchmarks/results):
# gpu-tests.xml, gpu-tests.log and gpu.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/fastload-gpu-site .whl/*.whl
fi
export PYTHONPATH="$PWD/src:$PWD:/tmp/fastload-gpu-site${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 3)'
status=0
"$PY" -m pytest -m cuda -p no:cacheprovider -W "ignore::DeprecationWarning" tests/test_device.py \
    --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log" || status=$?
"$PY" -m benchmarks.gpu --out "$OUT/gpu.json" || status=$?
exit $status
