"""bench/RESULTS.md holds each study's current figures, a level-2 section each; bench/run.py
rewrites its own section (``## run``) and keeps every other one as it is. bench/report.py's
splice runs as a process, as every bench script does here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
RUN = """# dedup-proxy benchmark results

History: `git log -p bench/RESULTS.md`.

## run

- Date: a new run

### The performance issue's figures

a new table
"""
SPLICE = (
    "import json, sys; from bench import report; "
    "print(report.splice(*json.load(sys.stdin)), end='')"
)


def splice(existing: str, run: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SPLICE],
        input=json.dumps([existing, run]),
        cwd=ROOT,
        capture_output=True,
        encoding="utf-8",
        timeout=60,
        check=True,
    )
    return done.stdout


def sections(text: str) -> list[str]:
    return re.findall(r"^## .*", text, re.M)


def outside_the_run(text: str) -> tuple[str, str]:
    start = text.index("\n## run\n")
    end = text.index("\n## ", start + 1)
    return text[:start], text[end:]


def test_a_run_replaces_its_own_section_and_keeps_every_other() -> None:
    existing = RESULTS.read_text(encoding="utf-8")
    spliced = splice(existing, RUN)
    assert sections(spliced) == sections(existing)
    assert outside_the_run(spliced) == outside_the_run(existing)
    assert "- Date: a new run" in spliced
    assert "\n### Every run\n" in existing
    assert "\n### Every run\n" not in spliced


def test_a_run_section_last_in_the_file_is_replaced_to_the_end() -> None:
    existing = "# dedup-proxy benchmark results\n\nby hand\n\n## run\n\n- Date: an old run\n"
    expected = "# dedup-proxy benchmark results\n\nby hand\n\n" + RUN[RUN.index("## run") :]
    assert splice(existing, RUN) == expected


def test_a_file_without_a_run_section_is_replaced_whole() -> None:
    assert splice("# notes\n\n## elsewhere\n", RUN) == RUN
