#!/usr/bin/env bash
# The README's test command: set-up, every CPU test, then every CPU test again
# under ASan+UBSan. Ends with the plain line "N passed, N failed" (CTest tests).
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh asan || { echo "0 passed, 1 failed"; exit 1; }

passed=0 failed=0
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
# they count in the total. Where the PyTorch venv ($MST_TORCH_VENV) exists,
# every test (about 35 s). PyTorch from PyPI is 5.4 GB, about 3 min to install
# on this machine: only MST_TORCH_INSTALL=1 installs it. Without it the
# PyTorch-free binding test (test_binding.py) runs, in a venv with pytest
# alone, and the GPU run (scripts/gpu-check.sh python) covers the rest.
echo "== Python package tests (python/tests, CPU backend)"
venv=${MST_TORCH_VENV:-$HOME/.cache/moestash/venv-torch}
if ! "$venv/bin/python" -c 'import torch, pytest' 2>/dev/null; then
  if [ "${MST_TORCH_INSTALL:-0}" = 1 ]; then
    python3 -m venv "$venv" && "$venv/bin/pip" install -q torch pytest
  else
    echo "no PyTorch in $venv (MST_TORCH_INSTALL=1 installs it): the binding test alone"
    venv=$HOME/.cache/moestash/venv-pytest
    "$venv/bin/python" -c 'import pytest, setuptools.command.bdist_wheel' 2>/dev/null \
      || { python3 -m venv "$venv" && "$venv/bin/pip" install -q --upgrade pytest setuptools; }
  fi
fi
log=$(mktemp)
MOESTASH_BUNDLE_LIB="$PWD/build/libmoestash.so" "$venv/bin/pip" install -q --no-deps --no-build-isolation \
  --force-reinstall ./python >"$log" 2>&1 || cat "$log"
(unset MOESTASH_LIB; "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests) 2>&1 | tee "$log"
py_passed=$(grep -oE '[0-9]+ passed' "$log" | tail -n 1 | cut -d' ' -f1)
py_failed=$(grep -oE '[0-9]+ (failed|error)' "$log" | awk '{n += $1} END {print n + 0}')
[ -n "$py_passed" ] || py_failed=$((py_failed + 1))
passed=$((passed + ${py_passed:-0}))
failed=$((failed + py_failed))
rm -f "$log"
# ---- end of the Python package block -----------------------------------------

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
