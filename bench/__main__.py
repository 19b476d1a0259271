"""One entry point for the benchmarks: ``python -m bench`` lists the studies, each with what it
measures; ``python -m bench STUDY [ARGS...]`` runs one with its own arguments (``--help`` for
them), as ``python bench/STUDY.py ARGS...`` does. bench/RESULTS.md holds their figures.

The studies are this package's scripts; ``loads``, ``procs`` and ``report`` are their shared
core, and ``naive`` and ``upstream`` the services they start (runnable alone too).
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The shared core: imported by the studies, never run.
CORE = frozenset({"__init__", "__main__", "loads", "procs", "report"})
# What the studies start: the naive proxy (the baseline) and the stand-in app.
SERVICES = frozenset({"naive", "upstream"})


def studies() -> dict[str, str]:
    """Each study by name, with its docstring's first sentence."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        if path.stem in CORE:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        first = " ".join(doc.split("\n\n")[0].split()).partition(". ")[0].rstrip(".")
        found[path.stem] = first if len(first) <= 100 else first[:99] + "…"
    return found


def main(argv: list[str]) -> int:
    known = studies()
    if not argv or argv[0] in ("-h", "--help", "list"):
        width = max(map(len, known))
        print("python -m bench STUDY [ARGS...] runs one (STUDY --help: its arguments); the "
              "studies, whose figures bench/RESULTS.md holds:")  # fmt: skip
        for name, what in known.items():
            kind = " (a service the studies start)" if name in SERVICES else ""
            print(f"  {name:<{width}}  {what}{kind}")
        return 0
    name, args = argv[0], argv[1:]
    if name not in known:
        print(f"python -m bench: no study {name!r}; one of: {', '.join(known)}", file=sys.stderr)
        return 2
    sys.argv = [str(HERE / f"{name}.py"), *args]
    try:
        runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
