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
# The cuda tests run one module per pytest call, each under its own limit with
# faulthandler's stack dump before it, so a hung test (an NCCL collective) costs its module,
# not the step: every module leaves a JUnit file (a synthetic one when it was killed), and
# they are merged into cuda-tests.xml.
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
  "$py" -m pip list 2>/dev/null | grep -iE '^(torch|pytest|pytest-timeout|hypothesis|numpy|psutil|rich|nvidia-ml-py|accelerate|lightning|triton|ninja) '
  echo "ninja: $(ninja --version 2>&1 | head -n 1 || true)"
  echo "g++: $(g++ --version 2>&1 | head -n 1 || true)"
  echo "nvcc: $(nvcc --version 2>&1 | grep -i release || echo 'not found')"
  "$py" -c "import torch.utils.cpp_extension as c; print('CUDA_HOME', c.CUDA_HOME)" 2>&1 | tail -n 1
} > "$out/machine.txt" 2>&1

step info 60 "$py" -m anydevice info --json > "$out/info.json" 2> "$out/info.err" || status=1

# Looking must not initialise CUDA: info --torch, describe and doctor --no-measure in one
# process, torch imported, then torch's flag and the driver's own state are read.
step looking 120 "$py" - > "$out/looking.json" 2> "$out/looking.err" <<'PY' || status=1
import contextlib, io, json, sys
import torch
import anydevice as ad
from anydevice.cli import commands as cli
from anydevice.hardware.backends.cuda import driver_initialized

def state():
    return {"torch": torch.cuda.is_initialized(), "driver": driver_initialized()}

calls = {
    "info --torch": lambda: cli.main(["info", "--torch", "--json"]),
    "describe": lambda: ad.describe().spec,
    "doctor --no-measure": lambda: cli.main(["doctor", "--no-measure", "--json"]),
}
report, clean = {}, True
for name, call in calls.items():
    with contextlib.redirect_stdout(io.StringIO()):
        result = call()
    report[name] = {"result": result, "cuda_initialised": state()}
    clean = clean and not any(report[name]["cuda_initialised"].values())
report["ok"] = clean
print(json.dumps(report, indent=2))
sys.exit(0 if clean else 1)
PY
step doctor 300 "$py" -m anydevice doctor --json > "$out/doctor.json" 2> "$out/doctor.err" || true

# Only the modules that hold cuda tests: the rest may import what this machine lacks. One
# pytest call per module, each bounded, all inside the step's 540 s.
mapfile -t modules < <(grep -rl --include='test_*.py' "pytest.mark.cuda" tests | grep -v '^tests/infra/' | sort)
mkdir -p "$out/junit"
: > "$out/cuda-tests.log"
tests_started=$SECONDS
for module in "${modules[@]}"; do
  name=$(basename "$module" .py)
  left=$((540 - (SECONDS - tests_started)))
  limit=$((left < 240 ? left : 240))
  if [ "$limit" -lt 20 ]; then
    echo "$name: not run, the step's 540 s are spent" | tee -a "$out/cuda-tests.log" >> "$out/steps.txt"
    continue
  fi
  echo "##### $module (limit $limit s)" >> "$out/cuda-tests.log"
  step "cuda-tests $name" "$limit" "$py" -m pytest -m cuda -q -p no:cacheprovider -o addopts="-ra" \
    -o faulthandler_timeout=$((limit > 60 ? limit - 30 : limit / 2)) --junitxml="$out/junit/$name.xml" "$module" \
    >> "$out/cuda-tests.log" 2>&1
  rc=$?
  # 5: no cuda test collected in it (none selected); anything else but 0 fails the check
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=1; fi
  if [ ! -s "$out/junit/$name.xml" ]; then  # killed before pytest wrote it: say so there
    "$py" - "$out/junit/$name.xml" "$name" "$rc" "$limit" <<'PY'
import sys
from xml.sax.saxutils import quoteattr
path, name, rc, limit = sys.argv[1:]
text = f"pytest exited {rc} without a report (time limit {limit} s): see cuda-tests.log"
with open(path, "w") as f:
    f.write(f'<?xml version="1.0" encoding="utf-8"?>\n<testsuites><testsuite name={quoteattr(name)} '
            f'tests="1" errors="1" failures="0" skipped="0"><testcase classname={quoteattr(name)} '
            f'name="module"><error message={quoteattr(text)}/></testcase></testsuite></testsuites>\n')
PY
  fi
done
"$py" - "$out/cuda-tests.xml" "$out"/junit/*.xml <<'PY'
import sys
import xml.etree.ElementTree as ET
merged = ET.Element("testsuites")
for path in sys.argv[2:]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"{path}: unreadable JUnit file ({e})", file=sys.stderr)
        continue
    merged.extend(root.iter("testsuite"))
ET.ElementTree(merged).write(sys.argv[1], encoding="utf-8", xml_declaration=True)
PY
tail -n 40 "$out/cuda-tests.log"

if [ -f benchmarks/gpu.py ]; then
  step gpu-benchmarks 480 "$py" benchmarks/gpu.py > "$out/gpu-benchmarks.log" 2>&1 || status=1
  grep -E '^(#####|==|  note|Traceback|[A-Za-z]*Error)' "$out/gpu-benchmarks.log" | tail -n 60
fi
echo "total: $((SECONDS - started)) s, status $status" >> "$out/steps.txt"
cat "$out/steps.txt"
echo "report in $out (status $status)"
exit $status
