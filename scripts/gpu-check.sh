#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: run the cuda-marked tests and the GPU benchmarks, and
# write a report (device inventory, test log, benchmark output) into one folder.
#
#   scripts/gpu-check.sh [OUTDIR]      (default: benchmarks/results/gpu-check)
#
# It runs from the source tree (PYTHONPATH=src) with the python on PATH, so it needs no
# install step and no network: torch, psutil, rich, nvidia-ml-py and pytest must be there.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu-check}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0

{
  echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,driver_version,memory.total --format=csv
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$out/machine.txt" 2>&1

"$py" -m anydevice info --json > "$out/info.json" 2> "$out/info.err" || status=1
"$py" -m anydevice doctor --json > "$out/doctor.json" 2> "$out/doctor.err" || true

"$py" -m pytest -m cuda -q -p no:cacheprovider -o addopts="-ra --strict-markers" tests \
  2>&1 | tee "$out/cuda-tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ -f benchmarks/gpu.py ]; then
  "$py" benchmarks/gpu.py 2>&1 | tee "$out/gpu-benchmarks.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "report in $out (status $status)"
exit $status
