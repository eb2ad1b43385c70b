#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: run the cuda-marked tests and the GPU benchmarks, and
# write a report (device inventory, doctor, test log, benchmark output and results) into
# one folder:
#
#   scripts/gpu-check.sh [OUTDIR]   (default: benchmarks/results/gpu-check/<gpu-model>-x<count>)
#
# It runs from the source tree (PYTHONPATH=src) with the python on PATH ($PYTHON to choose
# another), so it needs no install step and no network: torch, psutil, rich, nvidia-ml-py
# and pytest must be there; hypothesis, numpy and pytest-timeout need not be (only the
# test modules with cuda tests are collected, and none of them imports those). Each step
# has a time limit (23 minutes in all), so the check ends inside 25 minutes whatever happens.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
count=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
slug=$(printf '%s' "${gpu:-no-gpu}" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
out=${1:-benchmarks/results/gpu-check/${slug}-x${count}}
mkdir -p "$out/results"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export ANYDEVICE_BENCH_RESULTS="$out/results"  # benchmark JSON files land here too
status=0
started=$SECONDS

step() {  # step NAME LIMIT_SECONDS COMMAND...: run it, log its time and exit status
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@"
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" >> "$out/steps.txt"
  return $rc
}

: > "$out/steps.txt"
{
  echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,driver_version,memory.total --format=csv
  "$py" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  "$py" -m pip list 2>/dev/null | grep -iE '^(torch|pytest|pytest-timeout|hypothesis|numpy|psutil|rich|nvidia-ml-py|accelerate|lightning|triton) '
} > "$out/machine.txt" 2>&1

step info 60 "$py" -m anydevice info --json > "$out/info.json" 2> "$out/info.err" || status=1
step doctor 300 "$py" -m anydevice doctor --json > "$out/doctor.json" 2> "$out/doctor.err" || true

# Only the modules that hold cuda tests: the rest may import what this machine lacks.
mapfile -t modules < <(grep -l "pytest.mark.cuda" tests/test_*.py)
step cuda-tests 540 "$py" -m pytest -m cuda -q -p no:cacheprovider -o addopts="-ra" \
  --junitxml="$out/cuda-tests.xml" "${modules[@]}" > "$out/cuda-tests.log" 2>&1 || status=1
tail -n 40 "$out/cuda-tests.log"

if [ -f benchmarks/gpu.py ]; then
  step gpu-benchmarks 480 "$py" benchmarks/gpu.py > "$out/gpu-benchmarks.log" 2>&1 || status=1
  grep -E '^(#####|==|  note|Traceback|[A-Za-z]*Error)' "$out/gpu-benchmarks.log" | tail -n 60
fi
echo "total: $((SECONDS - started)) s, status $status" >> "$out/steps.txt"
cat "$out/steps.txt"
echo "report in $out (status $status)"
exit $status
