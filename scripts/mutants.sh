#!/usr/bin/env bash
# mutants.sh — the deliberate-bug score of the CPU test suite.
#
# Applies each deliberate bug ("mutant") listed in tests/mutants/*.txt, one at
# a time, to a scratch copy of this tree (tracked and untracked, not ignored,
# files), builds it CPU-only and runs the CPU suite. Reports per mutant:
#   caught      the expected test failed (other failing tests are listed too)
#   elsewhere   the expected test passed but another test failed
#   MISSED      the whole CPU suite passed: a hole in the tests
#   STALE       the text to find is no longer in the tree (the code moved or
#               changed): update the entry, never delete it to get a score
#   AMBIGUOUS   the text is found more than once: make it longer or add `in:`
#   NO-BUILD    the mutated tree does not compile: not a bug the suite can see
#   NO-TEST     `expect:` names no CPU test
# and the score "caught N / total M". Exits 0 only when every mutant is caught.
#
# usage: scripts/mutants.sh [--check] [NAME_REGEX]
#   --check      only check that every entry applies (found exactly once);
#                builds nothing (CTest runs this as `mutants_apply`)
#   NAME_REGEX   only the mutants whose name matches (grep -E)
#   MST_MUTANTS_DIR  scratch directory (default: a fresh mktemp -d, removed at
#                    the end unless MST_MUTANTS_KEEP=1)
#   MST_JOBS         build parallelism (default 2)
#   MST_MUTANTS_GPU=1  the GPU list instead (tests/mutants/gpu/*.txt: bugs
#                    only a `gpu`-labelled test can see, e.g. in a cuDNN
#                    graph): a CUDA build, the `gpu` tests as the suite (a
#                    GPU machine: scripts/gpu-check.sh's environment).
#                    --check checks both lists.
#
# ---- the list: tests/mutants/*.txt -----------------------------------------
# One file per area (any name ending in .txt). Entries are blocks of
# `key: value` lines separated by blank lines; lines starting with `#` are
# comments. Keys:
#   name:    unique id, e.g. bf16-truncate
#   find:    the exact text to find (one line, compared byte for byte, leading
#            and trailing spaces included after the single space that follows
#            the colon). It must occur exactly once in the files searched.
#   replace: its replacement (may be empty: the text is deleted)
#   |        a line starting with "| " continues the previous find: or
#            replace: value on a new line (multi-line texts)
#   in:      optional ERE on the repository path narrowing the search (e.g.
#            `src/lib/backend/cpu/`); default: every file under src/ and include/.
#            No file name is needed: the find text locates the file, so
#            entries survive files being moved or split.
#   expect:  the CTest name expected to catch it (e.g. test_dtype_cpu); a regex
#            for `ctest -R`
#   why:     what the bug is and why that test must see it
# Example:
#   name: bf16-truncate
#   find:     u += 0x7fffu + ((u >> 16) & 1u);
#   replace:
#   expect: test_dtype_cpu
#   why: fp32 -> bf16 truncates instead of rounding to nearest even
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
check_only=0 filter=""
for a in "$@"; do
  case "$a" in
    --check) check_only=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "mutants.sh: unknown option '$a' (see --help)" >&2; exit 2 ;;
    *) filter="$a" ;;
  esac
done
jobs=${MST_JOBS:-2}

# ---- parse every entry into parallel arrays
names=() finds=() repls=() ins=() expects=() whys=() origins=()
parse_error=0
add_entry() { # uses cur_* ; $1 origin
  [ -z "$cur_name$cur_find$cur_repl$cur_expect" ] && return
  if [ -z "$cur_name" ] || [ "$have_find" = 0 ] || [ "$have_repl" = 0 ] || [ -z "$cur_expect" ]; then
    echo "mutants.sh: $1: entry '${cur_name:-?}' needs name:, find:, replace: and expect:" >&2
    parse_error=1; return
  fi
  local n
  for n in "${names[@]}"; do
    [ "$n" = "$cur_name" ] && { echo "mutants.sh: $1: name '$cur_name' used twice" >&2; parse_error=1; return; }
  done
  names+=("$cur_name"); finds+=("$cur_find"); repls+=("$cur_repl"); ins+=("$cur_in")
  expects+=("$cur_expect"); whys+=("$cur_why"); origins+=("$1")
}
reset_entry() { cur_name="" cur_find="" cur_repl="" cur_in="" cur_expect="" cur_why="" have_find=0 have_repl=0 last_key=""; }
shopt -s nullglob
gpu=${MST_MUTANTS_GPU:-0}
if [ "$check_only" = 1 ]; then lists=("$root"/tests/mutants/*.txt "$root"/tests/mutants/gpu/*.txt)
elif [ "$gpu" = 1 ]; then lists=("$root"/tests/mutants/gpu/*.txt)
else lists=("$root"/tests/mutants/*.txt)
fi
[ ${#lists[@]} -gt 0 ] || { echo "mutants.sh: no tests/mutants/*.txt" >&2; exit 2; }
# the suite: the CPU tests (a CPU-only build), or the gpu tests (MST_MUTANTS_GPU=1)
if [ "$gpu" = 1 ]; then sel=(-L gpu) cuda_flag=() kind=GPU; export MST_TEST_REQUIRE_GPU=1; else sel=(-LE 'gpu|mutants') cuda_flag=(-DMST_CUDA=OFF) kind=CPU; fi
for f in "${lists[@]}"; do
  rel=${f#"$root"/}
  reset_entry
  lineno=0 start=0
  while IFS= read -r line || [ -n "$line" ]; do
    lineno=$((lineno + 1))
    case "$line" in
      '#'*) continue ;;
      '') add_entry "$rel:$start"; reset_entry; continue ;;
    esac
    [ -z "$last_key" ] && [ -z "$cur_name$cur_find" ] && start=$lineno
    if [ "${line:0:1}" = "|" ]; then
      rest=${line:1}; rest=${rest# }
      case "$last_key" in
        find) cur_find+=$'\n'"$rest" ;;
        replace) cur_repl+=$'\n'"$rest" ;;
        *) echo "mutants.sh: $rel:$lineno: '|' continues only find: or replace:" >&2; parse_error=1 ;;
      esac
      continue
    fi
    key=${line%%:*}
    val=${line#*:}; val=${val# }
    case "$key" in
      name) cur_name=$val ;;
      find) cur_find=$val; have_find=1 ;;
      replace) cur_repl=$val; have_repl=1 ;;
      in) cur_in=$val ;;
      expect) cur_expect=$val ;;
      why) cur_why=$val ;;
      *) echo "mutants.sh: $rel:$lineno: unknown key '$key'" >&2; parse_error=1 ;;
    esac
    last_key=$key
  done < "$f"
  add_entry "$rel:$start"
done
[ "$parse_error" = 0 ] || exit 2

# ---- locating a mutant: prints the one file holding the text, or returns
# 1 (stale) / 2 (ambiguous, files on stdout)
locate() { # $1 tree, $2 find text, $3 path ERE (optional)
  local tree=$1 text=$2 where=${3:-} first_line files=() f hits=0 content rest
  first_line=${text%%$'\n'*}
  while IFS= read -r f; do
    [ -n "$where" ] && ! [[ "$f" =~ $where ]] && continue
    content=$(cat "$tree/$f"; printf x); content=${content%x}
    rest=${content//"$text"/}
    local n=$(( (${#content} - ${#rest}) / ${#text} ))
    [ "$n" -gt 0 ] && { files+=("$f"); hits=$((hits + n)); }
  done < <(cd "$tree" && grep -rlF -- "$first_line" src include 2>/dev/null | sort)
  if [ "$hits" = 0 ]; then return 1; fi
  if [ "$hits" -gt 1 ]; then printf '%d hits in %s ' "$hits" "${files[*]}"; return 2; fi
  printf '%s' "${files[0]}"
}

selected=()
for i in "${!names[@]}"; do
  [ -n "$filter" ] && ! [[ "${names[$i]}" =~ $filter ]] && continue
  selected+=("$i")
done
[ ${#selected[@]} -gt 0 ] || { echo "mutants.sh: no mutant matches '$filter'" >&2; exit 2; }

if [ "$check_only" = 1 ]; then
  bad=0
  for i in "${selected[@]}"; do
    where=$(locate "$root" "${finds[$i]}" "${ins[$i]}"); rc=$?
    case $rc in
      0) printf '%-34s applies   %s\n' "${names[$i]}" "$where" ;;
      1) printf '%-34s STALE     text not found (%s)\n' "${names[$i]}" "${origins[$i]}"; bad=1 ;;
      *) printf '%-34s AMBIGUOUS %s(%s)\n' "${names[$i]}" "$where" "${origins[$i]}"; bad=1 ;;
    esac
  done
  echo "${#selected[@]} mutants checked"
  exit $bad
fi

# ---- scratch copy, baseline build and suite
scratch=${MST_MUTANTS_DIR:-$(mktemp -d /tmp/mst-mutants.XXXXXX)}
mkdir -p "$scratch/tree"
cleanup() { [ "${MST_MUTANTS_KEEP:-0}" = 1 ] || [ -n "${MST_MUTANTS_DIR:-}" ] || rm -rf "$scratch"; }
trap cleanup EXIT
(cd "$root" && git ls-files -z --cached --others --exclude-standard |
   tar -cf - --null --ignore-failed-read -T - 2>/dev/null) |
  tar -xf - -C "$scratch/tree" || { echo "mutants.sh: copy into $scratch failed" >&2; exit 2; }
tree=$scratch/tree build=$scratch/build log=$scratch/log
echo "mutants.sh: scratch copy in $scratch"
cmake -S "$tree" -B "$build" "${cuda_flag[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$log" 2>&1 &&
  cmake --build "$build" -j"$jobs" >>"$log" 2>&1 || { echo "mutants.sh: the unmutated tree does not build:" >&2; tail -n 20 "$log" >&2; exit 2; }
suite() { # $1: extra ctest args; prints the failing test names
  (cd "$build" && ctest "${sel[@]}" --timeout 300 "$@" >"$log" 2>&1)
  local rc=$?
  sed -n 's/^[[:space:]]*[0-9][0-9]* - \([^ ]*\) (.*/\1/p' "$log" | sort -u | tr '\n' ' '
  return $rc
}
base_fail=$(suite); [ $? = 0 ] || { echo "mutants.sh: the unmutated suite fails: $base_fail" >&2; exit 2; }

caught=0 total=0 problems=()
for i in "${selected[@]}"; do
  total=$((total + 1))
  name=${names[$i]}
  where=$(locate "$tree" "${finds[$i]}" "${ins[$i]}"); rc=$?
  if [ $rc = 1 ]; then printf '%-34s STALE     text not found (%s)\n' "$name" "${origins[$i]}"; problems+=("$name"); continue; fi
  if [ $rc != 0 ]; then printf '%-34s AMBIGUOUS %s(%s)\n' "$name" "$where" "${origins[$i]}"; problems+=("$name"); continue; fi
  if ! (cd "$build" && ctest -N "${sel[@]}" -R "${expects[$i]}" | grep -q '^Total Tests: [1-9]'); then
    printf '%-34s NO-TEST   expect: %s names no %s test (%s)\n' "$name" "${expects[$i]}" "$kind" "${origins[$i]}"; problems+=("$name"); continue
  fi
  file=$tree/$where
  cp -p "$file" "$scratch/orig"
  content=$(cat "$file"; printf x); content=${content%x}
  printf '%s' "${content/"${finds[$i]}"/"${repls[$i]}"}" >"$file"
  if ! cmake --build "$build" -j"$jobs" >"$log" 2>&1; then
    printf '%-34s NO-BUILD  %s (%s)\n' "$name" "$where" "${origins[$i]}"; problems+=("$name")
  else
    failed=$(suite -R "${expects[$i]}")
    if [ $? != 0 ]; then
      printf '%-34s caught    by %s (%s)\n' "$name" "$failed" "$where"; caught=$((caught + 1))
    else
      failed=$(suite)
      if [ $? != 0 ]; then
        printf '%-34s elsewhere by %s, not %s (%s)\n' "$name" "$failed" "${expects[$i]}" "$where"; caught=$((caught + 1))
      else
        printf '%-34s MISSED    %s: %s\n' "$name" "$where" "${whys[$i]}"; problems+=("$name")
      fi
    fi
  fi
  cp -p "$scratch/orig" "$file"
  touch "$file" # the restored file is rebuilt before the next mutant
done
echo "caught $caught / total $total"
[ ${#problems[@]} = 0 ] || echo "not caught: ${problems[*]}"
[ "$caught" = "$total" ]
