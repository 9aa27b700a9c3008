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
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
