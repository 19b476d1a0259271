"""The shell sessions in README.md and docs/*.md, run as shown against ``dedup-proxy serve``.

A session is a fenced ``console``/``sh`` block with ``$ `` command lines (a trailing ``\\``
continues one), or any such block that runs ``curl``. Each one is run: a fresh ``serve``
process on ``config.example.yaml`` (its ports, database and table replaced by the test's) with
the routes of the nearest YAML block above it in the same section added, in front of a fresh
``examples/upstream.py``; every command with the real ``curl``, ``localhost:8080`` pointed at
that proxy and ``localhost:9901`` at its admin listener, or ``dedup-proxy`` (as ``python -m
proxy``, its ``--config`` the proxy's, exit status 0 required); its stdout compared with the
lines under it. A block the test cannot run says so in an HTML comment just above it,
``<!-- not run: why -->``, which a test requires of every block it does not run: none is
passed over in silence. ``<!-- session env: NAME=value … -->``
there sets the proxy's environment (a secret the shown route reads).

Normalisation, so that only what varies is let through:

- the answer's ``Date`` and ``Server`` headers (the clock, the aiohttp version) and its
  ``Content-Length`` (it follows from the body shown) are dropped, and CRLF is read as LF;
- the proxy's, its admin listener's and the app's real ports are written back as 8080, 9901
  and 3000;
- in the shown output, a line ``...`` stands for any number of lines, and ``<...>`` for any
  text within a line (a request ID, a date, a timing).
"""

from __future__ import annotations

import asyncio
import re
import shlex
import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import accepts, free_port, run_cli, start_serve, wait_until

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"console", "sh", "shell", "bash", ""}
DOC_PORT, DOC_ADMIN_PORT, DOC_APP_PORT = "8080", "9901", "3000"
# Headers whose values vary from run to run, or follow from the body shown.
VARYING_HEADERS = re.compile(r"^(date|server|content-length):", re.IGNORECASE)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
SESSION_ENV = re.compile(r"<!--\s*session env:\s*(.+?)\s*-->")
CURL = shutil.which("curl")


@dataclass
class Command:
    line: int
    text: str
    expected: list[str] = field(default_factory=list)


@dataclass
class Session:
    page: Path
    line: int
    commands: list[Command]
    routes: list[dict[str, Any]]
    env: dict[str, str]
    not_run: str | None

    def __repr__(self) -> str:
        return f"Session({self.where})"

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def sessions(page: Path) -> Iterator[Session]:
    """The sessions of one Markdown page, with the routes and markers that go with them."""
    lines = page.read_text().splitlines()
    routes: list[dict[str, Any]] = []
    comments: list[str] = []
    number = 0
    while number < len(lines):
        text = lines[number]
        if text.startswith("#"):
            routes, comments = [], []
        elif text.startswith("<!--"):
            comments.append(text)
        elif text.startswith("```"):
            lang = text[3:].strip()
            end = next(i for i in range(number + 1, len(lines)) if lines[i].startswith("```"))
            body = lines[number + 1 : end]
            if lang == "yaml":
                routes = _routes(body) or routes
            elif lang in SHELL and (found := _session(page, number + 1, body, " ".join(comments))):
                found.routes = routes
                yield found
            comments = []
            number = end
        elif text.strip():
            comments = []
        number += 1


def _routes(body: list[str]) -> list[dict[str, Any]]:
    """The routes a YAML snippet shows: a list of route mappings (``- name: …``)."""
    try:
        loaded = yaml.safe_load("\n".join(body))
    except yaml.YAMLError:
        return []
    if isinstance(loaded, list) and all(isinstance(r, dict) and "name" in r for r in loaded):
        return loaded
    return []


def _session(page: Path, start: int, body: list[str], marks: str) -> Session | None:
    commands: list[Command] = []
    continued = False
    for number, text in enumerate(body, start + 1):
        if continued:
            commands[-1].text += "\n" + text
        elif text.startswith("$ "):
            commands.append(Command(number, text[2:]))
        elif commands:
            commands[-1].expected.append(text)
        continued = text.endswith("\\") and bool(commands) and not commands[-1].expected
    if not commands and not any(re.match(r"\s*curl\s", text) for text in body):
        return None
    not_run = found[1] if (found := NOT_RUN.search(marks)) else None
    env = (
        dict(item.split("=", 1) for item in shlex.split(found[1]))
        if (found := SESSION_ENV.search(marks))
        else {}
    )
    return Session(page, start, commands, [], env, not_run)


ALL = [session for page in PAGES for session in sessions(page)]


def normalised(output: str, port: int, admin_port: int, app_port: int) -> str:
    """curl's output as the docs show it (the module docstring's rules)."""
    text = output.replace("\r\n", "\n")
    text = re.sub(rf"\b{port}\b", DOC_PORT, text)
    text = re.sub(rf"\b{admin_port}\b", DOC_ADMIN_PORT, text)
    text = re.sub(rf"\b{app_port}\b", DOC_APP_PORT, text)
    head, blank, rest = text.partition("\n\n")
    if head.startswith("HTTP/"):
        kept = [line for line in head.split("\n") if not VARYING_HEADERS.match(line)]
        text = "\n".join(kept) + blank + rest
    return text.strip("\n")


def pattern(expected: list[str]) -> re.Pattern[str]:
    """The shown output as a regular expression: ``...`` lines and ``<...>`` let through."""
    lines = list(expected)
    while lines and not lines[-1].strip():
        lines.pop()
    parts = []
    for line in lines:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(map(re.escape, line.split("<...>"))) + r"\n")
    return re.compile("".join(parts), re.DOTALL)


def matches(expected: list[str], actual: str) -> bool:
    return pattern(expected).fullmatch(actual + "\n") is not None


class Stack:
    """The example app and ``serve`` on config.example.yaml, as a session assumes them."""

    def __init__(self, tmp_path: Path, pg_dsn: str, table: str, session: Session) -> None:
        self.port, self.admin_port, self.app_port = free_port(), free_port(), free_port()
        self.logs = tmp_path / "serve.log", tmp_path / "app.log"
        raw = yaml.safe_load((ROOT / "config.example.yaml").read_text())
        raw["listen"] = f"127.0.0.1:{self.port}"
        raw["admin"] = {**raw.get("admin", {}), "listen": f"127.0.0.1:{self.admin_port}"}
        raw["upstream"]["url"] = f"http://127.0.0.1:{self.app_port}"
        database = {k: v for k, v in raw["database"].items() if k not in ("dsn", "data_dir")}
        raw["database"] = {**database, "dsn": pg_dsn, "table": table}
        raw["routes"] = [*raw["routes"], *session.routes]
        self.config = tmp_path / "config.yaml"
        self.config.write_text(yaml.safe_dump(raw))
        self.env = session.env
        self.processes: list[asyncio.subprocess.Process] = []

    async def start(self) -> None:
        with self.logs[1].open("wb") as log:
            app = await asyncio.create_subprocess_exec(
                sys.executable,
                str(ROOT / "examples" / "upstream.py"),
                str(self.app_port),
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
            )
        self.processes.append(app)
        await wait_until(lambda: accepts(self.app_port), "the example app to listen", within=30)
        served = await start_serve(self.config, self.logs[0], env=self.env, cwd=ROOT)
        self.processes.append(served.process)

    async def stop(self) -> None:
        for process in reversed(self.processes):
            if process.returncode is None:
                process.kill()
            await process.wait()

    async def run(self, command: Command) -> str:
        argv = shlex.split(command.text.replace("\\\n", " "), comments=True)
        ports = {DOC_PORT: self.port, DOC_ADMIN_PORT: self.admin_port}
        argv = [
            re.sub(r"localhost:(8080|9901)\b", lambda m: f"localhost:{ports[m[1]]}", arg)
            for arg in argv
        ]
        if argv[0] == "dedup-proxy":
            return await self.operate(command, argv[1:])
        assert argv[0] == "curl", f"line {command.line}: only curl runs here, not {argv[0]}"
        assert CURL is not None, "curl is not installed (.ci/run must install it)"
        curl = await asyncio.create_subprocess_exec(
            CURL, *argv[1:], stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(curl.communicate(), timeout=30)
        assert curl.returncode == 0, f"line {command.line}: curl failed: {err.decode()}"
        return normalised(out.decode(), self.port, self.admin_port, self.app_port)

    async def operate(self, command: Command, argv: list[str]) -> str:
        """An operator command, on this proxy's configuration (``--config`` replaced)."""
        assert "--config" in argv, f"line {command.line}: dedup-proxy without --config"
        argv[argv.index("--config") + 1] = str(self.config)
        code, out, err = await run_cli(*argv)
        assert code == 0, f"line {command.line}: dedup-proxy exited {code}: {err}"
        return normalised(out, self.port, self.admin_port, self.app_port)


@pytest.fixture
async def stack(
    request: pytest.FixtureRequest, tmp_path: Path, pg_dsn: str, table: str
) -> AsyncIterator[Stack]:
    running = Stack(tmp_path, pg_dsn, table, request.param)
    try:
        await running.start()
        yield running
    finally:
        await running.stop()


def _runnable(session: Session) -> bool:
    """Whether every command is one ``Stack.run`` runs: ``curl`` or ``dedup-proxy``."""
    return bool(session.commands) and all(
        shlex.split(c.text, comments=True)[:1] in (["curl"], ["dedup-proxy"])
        for c in session.commands
    )


RUN = [s for s in ALL if s.not_run is None and _runnable(s)]
SKIPPED = [s for s in ALL if s not in RUN]


@pytest.mark.parametrize("stack", RUN, ids=[s.where for s in RUN], indirect=True)
async def test_the_session_answers_as_the_doc_shows(
    stack: Stack, request: pytest.FixtureRequest
) -> None:
    session: Session = request.node.callspec.params["stack"]
    for command in session.commands:
        actual = await stack.run(command)
        if not matches(command.expected, actual):
            shown = "\n".join(command.expected).strip("\n")
            pytest.fail(
                f"{session.page.relative_to(ROOT)}:{command.line}: the output differs from the "
                f"doc's\n--- shown\n{shown}\n--- got\n{actual}"
            )


@pytest.mark.parametrize("session", SKIPPED, ids=[s.where for s in SKIPPED])
def test_a_session_not_run_says_why(session: Session) -> None:
    assert session.not_run, (
        f"{session.where}: a session the test cannot run (not curl and dedup-proxy only, or no "
        "output shown) "
        "needs '<!-- not run: why -->' just above it"
    )


def test_the_docs_have_sessions_to_run() -> None:
    # The extractor finding nothing would pass every doc.
    assert len(RUN) >= 3, [s.where for s in ALL]
