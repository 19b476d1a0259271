"""``python -m bench``: the benchmarks' one entry point lists every study and runs one by name
(as processes: the suite imports nothing from ``bench/``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


def test_every_runnable_script_is_listed_as_a_study() -> None:
    runnable = {
        path.stem
        for path in (ROOT / "bench").glob("*.py")
        if 'if __name__ == "__main__":' in path.read_text() and path.stem != "__main__"
    }

    listed = _bench()

    assert listed.returncode == 0, listed.stderr
    shown = {line.split()[0] for line in listed.stdout.splitlines()[1:]}
    assert shown == runnable


def test_a_study_runs_by_name_with_its_own_arguments_and_an_unknown_one_is_refused() -> None:
    helped = _bench("keep_cost", "--help")
    unknown = _bench("keep-cost")

    assert helped.returncode == 0, helped.stderr
    assert "--statements" in helped.stdout
    assert unknown.returncode == 2
    assert "no study 'keep-cost'; one of: ab, ablate," in unknown.stderr
