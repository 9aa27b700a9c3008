#!/usr/bin/env bash
# The install test (CTest `install`, CPU): installs the build into a scratch
# prefix, checks that the shared library exports exactly the functions the
# installed header marks MST_API, then builds tests/install/consumer.c
# against the installed package four ways — find_package shared and static,
# pkg-config shared and static — and runs each (a grouped linear on the CPU
# against a float64 reference). A static build must not need libmoestash.so.
# usage: test_install.sh CMAKE BUILD_DIR C_COMPILER
set -euo pipefail
cmake=$1 build=$2 cc=$3
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

"$cmake" --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; exit 1; }
libdir=$(dirname "$(find "$prefix" -name moestash.pc)")/..
so=$(find "$prefix" -name 'libmoestash.so.*.*.*')
# the licence travels with the package
[ -n "$(find "$prefix/share/doc" -name LICENSE 2>/dev/null)" ] || { echo "FAIL: no LICENSE under $prefix/share/doc"; exit 1; }

# exports == MST_API functions of the installed header
nm -D --defined-only "$so" | awk '{print $3}' | sort >"$tmp/exported"
grep -oE '^MST_API [^(]*\(' "$prefix/include/moestash.h" | grep -oE 'mst_[a-z0-9_]+\($' | tr -d '(' | sort >"$tmp/api"
if ! diff "$tmp/exported" "$tmp/api" >"$tmp/diff"; then
  echo "FAIL: exported symbols differ from the header's MST_API functions (< exported only, > header only):"
  cat "$tmp/diff"
  exit 1
fi
# the SONAME carries the header's major and minor version (a layout change bumps the minor)
ver() { grep -oE "^#define MST_VERSION_$1 [0-9]+" "$prefix/include/moestash.h" | grep -oE '[0-9]+$'; }
soname="libmoestash.so.$(ver MAJOR).$(ver MINOR)"
readelf -d "$so" | grep -qF "Library soname: [$soname]" \
  || { echo "FAIL: SONAME is not $soname: $(readelf -d "$so" | grep SONAME)"; exit 1; }
echo "exports: $(wc -l <"$tmp/exported") symbols, all MST_API; SONAME $(readelf -d "$so" | grep -oE 'libmoestash[^]]*')"

needs_so() { readelf -d "$1" | grep -q 'NEEDED.*libmoestash'; }
check() { # NAME BINARY shared|static
  needs_so "$2" && [ "$3" = static ] && { echo "FAIL: $1 links libmoestash.so"; exit 1; }
  needs_so "$2" || [ "$3" = static ] || { echo "FAIL: $1 does not link libmoestash.so"; exit 1; }
  LD_LIBRARY_PATH="$libdir" "$2" || { echo "FAIL: $1"; exit 1; }
  echo "$1: ok"
}

# find_package
"$cmake" -S "$here" -B "$tmp/fp" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" >"$tmp/fp.log" 2>&1 \
  && "$cmake" --build "$tmp/fp" >>"$tmp/fp.log" 2>&1 || { cat "$tmp/fp.log"; exit 1; }
check "find_package shared" "$tmp/fp/consumer_shared" shared
check "find_package static" "$tmp/fp/consumer_static" static

# pkg-config (static: libmoestash.a by name, then Libs.private)
export PKG_CONFIG_PATH="$libdir/pkgconfig"
pc_cflags=$(pkg-config --cflags moestash)
"$cc" "$here/consumer.c" -o "$tmp/pc_shared" $pc_cflags $(pkg-config --libs moestash) -lm
check "pkg-config shared" "$tmp/pc_shared" shared
"$cc" "$here/consumer.c" -o "$tmp/pc_static" $pc_cflags $(pkg-config --static --libs moestash | sed 's/-lmoestash\b/-l:libmoestash.a/') -lm
check "pkg-config static" "$tmp/pc_static" static
