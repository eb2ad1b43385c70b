#!/usr/bin/env bash
# Prove anydevice on a real XLA runtime: build a virtualenv with torch_xla and the one torch
# it needs, run the xla-marked tests, the inventory and the doctor on its device, and write
# a report into one folder:
#
#   scripts/xla-check.sh [OUTDIR]   (default: benchmarks/results/xla-check/<pjrt-type>-torch_xla-<version>)
#
# torch_xla pins torch exactly (torch_xla 2.9.0 needs torch 2.9.0, and PyPI's torch 2.9.0
# for Linux is the CUDA build: about 2.7 GB installed), so this lives in .xla-venv, apart
# from .venv and out of `make test`. The package runs from the source tree
# (PYTHONPATH=src). Without a TPU it runs on torch_xla's CPU PJRT device (PJRT_DEVICE=CPU):
# the same lazy tensors, graph cuts and transfers, executed by XLA on the CPU. On a TPU VM
# set PJRT_DEVICE=TPU and TORCH_XLA_SPEC='torch_xla[tpu]==2.9.0'.
set -uo pipefail
cd "$(dirname "$0")/.."

torch_spec=${TORCH_SPEC:-torch==2.9.0}
xla_spec=${TORCH_XLA_SPEC:-torch_xla==2.9.0}
venv=${XLA_VENV:-.xla-venv}
export PJRT_DEVICE=${PJRT_DEVICE:-CPU}
py=$venv/bin/python
started=$SECONDS

if [ ! -f "$venv/.stamp" ]; then
  python3 -m venv "$venv" || exit 1
  "$py" -m pip install --quiet --disable-pip-version-check "$torch_spec" "$xla_spec" \
    numpy psutil rich nvidia-ml-py pytest pytest-timeout || exit 1
  touch "$venv/.stamp"
fi
installed=$((SECONDS - started))

export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
version=$("$py" -c "import importlib.metadata as m; print(m.version('torch_xla'))" 2>/dev/null)
kind=$(printf '%s' "$PJRT_DEVICE" | tr '[:upper:]' '[:lower:]')
out=${1:-benchmarks/results/xla-check/${kind}-torch_xla-${version:-unknown}}
mkdir -p "$out"
status=0

step() {  # step NAME LIMIT_SECONDS COMMAND...: run it, log its time and exit status
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@"
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" >> "$out/steps.txt"
  return $rc
}

echo "install: $installed s (0 when $venv was already built)" > "$out/steps.txt"
{
  echo "# XLA check $(date -u +%Y-%m-%dT%H:%MZ), PJRT_DEVICE=$PJRT_DEVICE"
  "$py" - <<'EOF'
import platform, sys
import torch, torch_xla, torch_xla.runtime as xr
print("python", sys.version.split()[0], "on", platform.machine(), platform.processor() or "")
print("torch", torch.__version__, "torch_xla", torch_xla.__version__)
print("PJRT device type", xr.device_type(), "devices", xr.global_runtime_device_count())
EOF
  grep -m 1 "model name" /proc/cpuinfo 2>/dev/null
  "$py" -m pip list 2>/dev/null | grep -iE '^(torch|torch_xla|torch-xla|pytest|numpy|psutil|rich) '
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

step info 120 "$py" -m anydevice info --json > "$out/info.json" 2> "$out/info.err" || status=1
step xla-tests 600 "$py" -m pytest -m xla -q -p no:cacheprovider -o addopts="-ra" \
  --junitxml="$out/xla-tests.xml" tests/test_xla.py > "$out/xla-tests.log" 2>&1 || status=1
tail -n 20 "$out/xla-tests.log"
step doctor 300 "$py" -m anydevice doctor --device xla --quick --json \
  > "$out/doctor.json" 2> "$out/doctor.err" || status=1

echo "total: $((SECONDS - started)) s, status $status" >> "$out/steps.txt"
cat "$out/steps.txt"
echo "report in $out (status $status)"
exit $status
