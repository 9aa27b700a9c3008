#!/usr/bin/env bash
# The README's test command: set-up, every CPU test, then every CPU test again
# under ASan+UBSan. Ends with the plain line "N passed, N failed" (CTest tests).
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh asan || { echo "0 passed, 1 failed"; exit 1; }

# ---- the PyTorch venv: the Python package tests and CTest's hf_oracle (the
# Hugging Face transformers oracle, tests/hf) run in it. Installed when
# missing into $MST_TORCH_VENV (default ~/.cache/moestash/venv-torch, kept
# between runs): PyTorch from PyPI (5.4 GB with its CUDA libraries, about
# 3 min; MST_TORCH_INDEX=URL takes it from another index, e.g. PyTorch's CPU
# wheels, about 200 MB, where that host is reachable), transformers,
# safetensors, pytest. MST_TORCH_INSTALL=0: no
# install; then hf_oracle skips and the package tests run the binding test
# alone. A failed install counts as a failed test.
venv=${MST_TORCH_VENV:-$HOME/.cache/moestash/venv-torch}
torch_ok() { "$venv/bin/python" -c 'import torch, transformers, safetensors, pytest' 2>/dev/null; }
if ! torch_ok && [ "${MST_TORCH_INSTALL:-1}" != 0 ]; then
  echo "== installing torch, transformers, safetensors, pytest into $venv"
  { [ -x "$venv/bin/pip" ] || python3 -m venv "$venv"; } &&
    "$venv/bin/pip" install -q ${MST_TORCH_INDEX:+--index-url "$MST_TORCH_INDEX"} torch &&
    "$venv/bin/pip" install -q transformers safetensors pytest ||
    { echo "installing into $venv failed (counted as a failure): hf_oracle skips"; install_failed=1; }
fi
export MST_TORCH_VENV=$venv

passed=0 failed=${install_failed:-0}
run_suite() { # $1 build dir
  local log
  log=$(mktemp)
  (cd "$1" && ctest -LE gpu --output-on-failure -j"$(nproc)") 2>&1 | tee "$log"
  local line total bad
  line=$(grep -oE '[0-9]+ tests failed out of [0-9]+' "$log" | tail -n 1)
  if [ -z "$line" ]; then failed=$((failed + 1)); rm -f "$log"; return; fi
  bad=${line%% tests*}
  total=${line##* }
  passed=$((passed + total - bad))
  failed=$((failed + bad))
  rm -f "$log"
}
echo "== CPU tests (build/)"
run_suite build
echo "== CPU tests under ASan+UBSan (build-asan/)"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 run_suite build-asan
# ---- Python package (python/): pytest on the CPU backend ----------------------
# The package from ./python with build/libmoestash.so bundled in it, its tests;
# they count in the total. In the PyTorch venv (above), every test (about
# 35 s); without it the PyTorch-free binding test (test_binding.py), in a venv
# with pytest alone, and the GPU run (scripts/gpu-check.sh python) covers the
# rest.
echo "== Python package tests (python/tests, CPU backend)"
if ! torch_ok; then
  echo "no PyTorch in $venv: the binding test alone"
  venv=$HOME/.cache/moestash/venv-pytest
  "$venv/bin/python" -c 'import pytest, setuptools.command.bdist_wheel' 2>/dev/null \
    || { python3 -m venv "$venv" && "$venv/bin/pip" install -q --upgrade pytest setuptools; }
fi
log=$(mktemp)
MOESTASH_BUNDLE_LIB="$PWD/build/libmoestash.so" "$venv/bin/pip" install -q --no-deps --no-build-isolation \
  --force-reinstall ./python >"$log" 2>&1 || cat "$log"
(unset MOESTASH_LIB; "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests; echo "pytest exit $?") 2>&1 | tee "$log"
py_passed=$(grep -oE '[0-9]+ passed' "$log" | tail -n 1 | cut -d' ' -f1)
py_failed=$(grep -oE '[0-9]+ (failed|error)' "$log" | awk '{n += $1} END {print n + 0}')
py_rc=$(sed -n 's/^pytest exit //p' "$log" | tail -n 1)
# exit 5: no test collected, not a failure; any other exit without a pass count is one
[ -n "$py_passed" ] || [ "$py_rc" = 5 ] || py_failed=$((py_failed + 1))
passed=$((passed + ${py_passed:-0}))
failed=$((failed + py_failed))
rm -f "$log"
# ---- end of the Python package block -----------------------------------------

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
