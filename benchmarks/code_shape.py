"""Count what makes code hard to live in: long functions, long files, repeated blocks.

    python benchmarks/code_shape.py [--list] [PATH ...]     (default: lifecycle runtime models)

Functions are measured from `def` to their last line (AST); files by physical lines; a
repeated block is a run of six or more normalised lines (stripped, no blanks, no comments,
no docstring-only lines) that occurs again elsewhere, counted once per extra occurrence;
`Any` as every occurrence of the word in code and comments (what `grep -ow Any` counts).
Tests are excluded. Issues 13 and 21 state their targets against these counts.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import sys
from collections import defaultdict
from pathlib import Path

DEFAULT_ROOTS = ("lifecycle", "runtime", "models")
WINDOW = 6


def python_files(roots: list[str]) -> list[Path]:
    files: list[Path] = []
    for root in roots:
        path = Path(root)
        found = [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
        files.extend(f for f in found if "tests" not in f.parts)
    return files


def long_functions(path: Path, over: int) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > over:
                found.append((f"{path}:{node.lineno} {node.name}", length))
    return found


def any_count(path: Path) -> int:
    """Occurrences of the word `Any`, imports and comments included (as `grep -ow Any`)."""
    return len(re.findall(r"\bAny\b", path.read_text()))


def normalised_lines(path: Path) -> list[tuple[int, str]]:
    lines = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        text = raw.strip()
        if not text or text.startswith("#") or text in ('"""', "'''"):
            continue
        lines.append((number, text))
    return lines


def repeated_blocks(files: list[Path]) -> list[tuple[str, str]]:
    """(first place, repeated place) for each maximal repeated run of WINDOW+ lines."""
    seen: dict[str, tuple[Path, int]] = {}
    repeats: dict[Path, list[tuple[int, str]]] = defaultdict(list)
    for path in files:
        lines = normalised_lines(path)
        for start in range(len(lines) - WINDOW + 1):
            window = "\n".join(text for _, text in lines[start : start + WINDOW])
            digest = hashlib.sha1(window.encode()).hexdigest()
            if digest in seen:
                first, line = seen[digest]
                repeats[path].append((start, f"{first}:{line}"))
            else:
                seen[digest] = (path, lines[start][0])
    blocks = []
    for path, hits in repeats.items():
        lines = normalised_lines(path)
        previous = -2
        for start, first in sorted(hits):
            if start != previous + 1:  # a new maximal run starts here
                blocks.append((first, f"{path}:{lines[start][0]}"))
            previous = start
    return blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", default=list(DEFAULT_ROOTS))
    parser.add_argument("--list", action="store_true", help="list every finding")
    args = parser.parse_args(argv)
    files = python_files(args.paths)
    if not files:
        parser.error(f"no Python files under {args.paths}")
    total = sum(len(f.read_text().splitlines()) for f in files)
    over60 = [hit for f in files for hit in long_functions(f, 60)]
    over40 = [hit for f in files for hit in long_functions(f, 40)]
    big = [(str(f), n) for f in files if (n := len(f.read_text().splitlines())) > 600]
    blocks = repeated_blocks(files)
    anys = {f: n for f in files if (n := any_count(f))}
    print(f"files: {len(files)}  lines: {total}")
    print(f"functions over 60 lines: {len(over60)}  over 40: {len(over40)}")
    print(f"files over 600 lines: {len(big)}")
    print(f"repeated blocks of {WINDOW}+ lines: {len(blocks)}")
    in_scope = sum(n for f, n in anys.items() if f.parts[0] in ("runtime", "models"))
    print(f"Any: {sum(anys.values())} (runtime/ and models/: {in_scope})")
    if args.list:
        for name, length in sorted(over60, key=lambda hit: -hit[1]):
            print(f"  function {length:4d}  {name}")
        for name, length in sorted(big, key=lambda hit: -hit[1]):
            print(f"  file     {length:4d}  {name}")
        for first, again in blocks:
            print(f"  repeat   {again}  (first at {first})")
        for path, count in sorted(anys.items(), key=lambda hit: -hit[1]):
            print(f"  Any      {count:4d}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
