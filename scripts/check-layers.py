#!/usr/bin/env python3
"""check-layers.py — every #include "..." of src/, bench/, tests/ and support/
against the layer table of docs/DESIGN.md (§3.1, the one definition): a file
may include files of its own folder and of the folders (or the single files)
its folder's row allows. Fails naming file, line and included path for each
include the table does not allow, a folder with sources but no row, and a
cycle between the table's folders.

An include resolves as the compiler does: relative to the including file's
folder first, then to the include roots (src/, include/, tests/, support/);
one that resolves to no file of the tree (a system header) is not checked.

usage: scripts/check-layers.py [ROOT]   (CTest `layers`; exit 0: clean)
"""
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
SCANNED = ("src", "bench", "tests", "support")
INCLUDE_ROOTS = ("src", "include", "tests", "support")
SOURCE = re.compile(r"\.(c|h|cu|cuh)$")
TABLE_START = "<!-- layer table: read by scripts/check-layers.py -->"


def read_table(problems):
    """{folder: set of allowed folders or files} from DESIGN.md's table; the
    row `*` holds what every folder may include. Cells name paths of the tree
    in backquotes; a quoted name without a slash that is no path (a file
    named in passing) is prose; one with a slash that is no path is a
    problem of the table."""
    path = os.path.join(ROOT, "docs", "DESIGN.md")
    with open(path) as f:
        text = f.read()
    at = text.find(TABLE_START)
    if at < 0:
        sys.exit(f"check-layers: no layer table in {path} (the line '{TABLE_START}' above it)")
    table = {}
    for line in text[at:].splitlines()[1:]:
        if not line.startswith("|"):
            if table:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or set(cells[0]) <= set("-: ") or cells[0] == "folder":
            continue
        names, allowed = (paths(c, problems) for c in cells[:2])
        for n in names:
            table[n] = set(allowed)
    if not table:
        sys.exit(f"check-layers: the layer table of {path} is empty")
    return table


def paths(cell, problems):
    out = []
    for name in re.findall(r"`([^`]+)`", cell):
        name = name.rstrip("/")
        if name == "*" or os.path.exists(os.path.join(ROOT, name)):
            out.append(name)
        elif "/" in name:
            problems.append(f"docs/DESIGN.md: the layer table names {name}, which is not in the tree")
    return out


def cycles(table):
    """A cycle among the table's folders (a list), or None."""
    def folder(a):  # a file entry stands for its folder
        return a if a in table else os.path.dirname(a)
    graph = {k: {folder(a) for a in v if folder(a) in table and folder(a) != k}
             for k, v in table.items() if k != "*"}
    state = {}

    def visit(n, stack):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                c = visit(m, stack)
                if c:
                    return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            c = visit(n, [])
            if c:
                return c
    return None


def resolve(src_dir, inc):
    for base in [src_dir] + [os.path.join(ROOT, r) for r in INCLUDE_ROOTS]:
        p = os.path.normpath(os.path.join(base, inc))
        if os.path.isfile(p):
            return os.path.relpath(p, ROOT)
    return None


def main():
    problems = []
    table = read_table(problems)
    c = cycles(table)
    if c:
        problems.append("docs/DESIGN.md: the layer table has a folder cycle: " + " -> ".join(c))
    every = table.get("*", set())
    n_files = n_includes = 0
    for top in SCANNED:
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs.sort()
            for f in sorted(files):
                if not SOURCE.search(f):
                    continue
                path = os.path.join(d, f)
                rel = os.path.relpath(path, ROOT)
                folder = os.path.dirname(rel)
                n_files += 1
                if folder not in table:
                    problems.append(f"{rel}: its folder {folder}/ has no row in the layer table of docs/DESIGN.md")
                    continue
                allowed = table[folder] | every
                with open(path, errors="replace") as fh:
                    for no, line in enumerate(fh, 1):
                        m = re.match(r'\s*#\s*include\s*"([^"]+)"', line)
                        if not m:
                            continue
                        target = resolve(d, m.group(1))
                        if target is None:
                            continue  # not a file of the tree
                        n_includes += 1
                        tdir = os.path.dirname(target)
                        if tdir == folder or tdir in allowed or target in allowed:
                            continue
                        problems.append(f"{rel}:{no}: includes \"{m.group(1)}\" ({target}): {folder}/ may include "
                                        f"{', '.join(sorted(allowed)) or 'nothing'} (docs/DESIGN.md, layer table)")
    for p in problems:
        print(p)
    print(f"check-layers: {n_files} files, {n_includes} includes of the tree, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
