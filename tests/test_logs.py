"""What leaves in logs and answers: no credentials, no request bytes, no forged fields."""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

from proxy import config, log_line, logs
from tests.helpers import FakeUpstream, MakeProxy, connection, free_port, run_cli

PASSWORD = "S3cr3t-pw"


@pytest.fixture
def log_lines(request: pytest.FixtureRequest) -> Iterator[io.StringIO]:
    """The proxy's own log set-up (JSON, or text when the test is parametrized so), writing to a
    buffer; the root logger's handlers are put back afterwards."""
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    out = io.StringIO()
    log_format = getattr(request, "param", "json")
    logs.setup(config.LogConfig(level="info", format=log_format), stream=out)
    try:
        yield out
    finally:
        root.handlers[:] = saved
        root.setLevel(level)


async def test_a_credentialed_upstream_url_is_never_echoed_or_logged(
    make_proxy: MakeProxy, log_lines: io.StringIO
) -> None:
    dead = f"http://svc:{PASSWORD}@127.0.0.1:{free_port()}"
    client = await make_proxy(upstream={"url": dead, "timeout": "2s"})

    passthrough = await client.get("/anything")
    webhook = await client.post("/webhooks/corvel", data=b'{"id": "e1"}')
    logging.getLogger("proxy.test").error("quoting %s/x", dead)

    for response in (passthrough, webhook):
        assert response.status == 502
        assert await response.json() == {
            "status": "error",
            "error": "upstream_unavailable",
            "message": "The upstream could not be reached or dropped the connection.",
        }
    written = log_lines.getvalue()
    assert PASSWORD not in written
    assert "http://svc:***@127.0.0.1" in written


async def test_check_masks_the_upstream_password(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        f"upstream: {{url: 'http://svc:{PASSWORD}@app:3000'}}\n"
        f"database: {{dsn: 'postgresql://dedup:{PASSWORD}@db/app'}}\n"
        "routes: [{name: a, path: /a, upstream: 'http://u:" + PASSWORD + "@other:1', "
        "event_id: 'body:/id'}]\n"
    )
    code, out, err = await run_cli("check", "--config", str(path))

    assert code == 0, err
    assert PASSWORD not in out
    assert "http://svc:***@app:3000" in out
    assert "http://u:***@other:1" in out


async def test_a_request_the_parser_refuses_is_one_info_line_without_its_bytes(
    make_proxy: MakeProxy, upstream: FakeUpstream, log_lines: io.StringIO
) -> None:
    client = await make_proxy()
    card = b"4111111111111111"
    async with connection(client) as (reader, writer):
        writer.write(
            b"POST /webhooks/corvel HTTP/1.1\r\nHost: x\r\nStripe-Signature: t=1,v1=" + card
            + b"\r\nBad Header: \x01" + card + b"\r\nContent-Length: 2\r\n\r\n{}"
        )  # fmt: skip
        answer = await asyncio.wait_for(reader.read(), 5)

    assert answer.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")
    lines = [line for line in log_lines.getvalue().splitlines() if "aiohttp.server" in line]
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["level"] == "info"
    assert line["msg"].startswith("refused a malformed HTTP request")
    assert card.decode() not in log_lines.getvalue()
    assert "Traceback" not in log_lines.getvalue()
    assert upstream.requests == []


@pytest.mark.parametrize("log_lines", ["text"], indirect=True)
def test_text_lines_quote_values_so_none_can_forge_a_field(log_lines: io.StringIO) -> None:
    logging.getLogger("proxy.pipeline").info(
        "POST /x \x1b[31m\u202e -> processed",
        extra={"fields": {"request_id": "r1 outcome=duplicate event_id=evt_fake",
                          "event_id": "evt\x1b[2J\u202e", "status": 200}},
    )  # fmt: skip

    (line,) = log_lines.getvalue().splitlines()
    assert 'request_id="r1 outcome=duplicate event_id=evt_fake"' in line
    assert 'event_id="evt\\u001b[2J\\u202e"' in line
    assert "status=200" in line
    assert " outcome=" not in line.replace('"r1 outcome=', "")
    assert "\x1b" not in line
    assert "\u202e" not in line


@pytest.mark.parametrize(
    "fields",
    [
        {"event_id": "evt_1", "claim_ms": 0.25, "upstream_status": 200, "replayed": True},
        {"event_id": "caf\u00e9 \u202e", "path": "/x"},  # not ASCII: escaped, as before
        {"event_id": "x\ud800"},  # a lone surrogate, which orjson refuses
        {"event_id": 2**70},  # over 64 bits, which orjson refuses
        {"path": Path("/odd"), "error": ValueError("no")},  # not JSON types: str()
        {"at": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)},  # str(), as before
        {"event_id": "del\x7f"},  # DEL: escaped, as the json module does
    ],
)
def test_a_json_line_is_ascii_and_reads_back_as_its_fields(fields: dict[str, Any]) -> None:
    record = logging.LogRecord("proxy.pipeline", logging.INFO, "", 0, "m", (), None)
    record.fields = fields
    line = logs.JsonFormatter().format(record)
    assert line.isascii()
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["level"] == "info"
    for name, value in fields.items():
        expected = value if isinstance(value, str | int | float) else str(value)
        assert parsed[name] == expected


@pytest.mark.parametrize(
    ("line", "masked"),
    [
        # A raw '@' or '#' in the password: masked to the host's '@', not the first one.
        ("dsn postgresql://dedup:p@ss#word@db:5432/app", "dsn postgresql://dedup:***@db:5432/app"),
        # A raw '/' (openssl rand -base64): still all of it.
        ("postgresql://dedup:Xy7Qk9+LmN/a8bZ=@db/app x", "postgresql://dedup:***@db/app x"),
        ("http://svc:pw@app:3000/path@x", "http://svc:***@app:3000/path@x"),
        ("http://app:3000/path@x", "http://app:3000/path@x"),
        ("host=db user=dedup password=s3cr3t dbname=app",
         "host=db user=dedup password=*** dbname=app"),
        ("password='two words' host=db", "password=*** host=db"),
        ("postgresql://u@db/app?sslmode=require&password=s3cr3t&x=1",
         "postgresql://u@db/app?sslmode=require&password=***&x=1"),
        ("PASSWORD = s3cr3t", "PASSWORD = ***"),
        # The client key's passphrase, in either form.
        ("postgresql://u@db/app?sslkey=k.pem&sslpassword=s3cr3t",
         "postgresql://u@db/app?sslkey=k.pem&sslpassword=***"),
        ("host=db sslpassword='a b' user=u", "host=db sslpassword=*** user=u"),
    ],
)  # fmt: skip
def test_mask_hides_every_form_of_a_database_password(line: str, masked: str) -> None:
    assert logs.mask(line) == masked


def test_the_short_way_writes_the_line_the_ordinary_way_writes(log_lines: io.StringIO) -> None:
    """A request's line skips the logging chain (``logs.line``) only when nothing else would see
    the record, and is then the same line: fields in order, the worker's number, masking."""
    logs.setup(config.LogConfig(level="info", format="json"), stream=log_lines, worker=3)
    logger = logging.getLogger("proxy.pipeline")
    fields = {"route": "r", "path": "/x%s", "dsn": f"postgresql://u:{PASSWORD}@db/x", "n": 1}
    logs.line(logger, logging.WARNING, "POST /x%s -> mismatch", fields)
    seen: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    capture = Capture()
    logger.addHandler(capture)
    try:
        logs.line(logger, logging.WARNING, "POST /x%s -> mismatch", fields)
    finally:
        logger.removeHandler(capture)
    logs.line(logger, logging.DEBUG, "below the level", fields)
    short, ordinary = (json.loads(x) for x in log_lines.getvalue().splitlines())
    assert PASSWORD not in log_lines.getvalue()
    assert list(short) == ["ts", "level", "logger", "msg", "route", "path", "dsn", "n", "worker"]
    assert {**short, "ts": None} == {**ordinary, "ts": None}
    assert short["level"] == "warning"
    assert short["msg"] == "POST /x%s -> mismatch"
    assert short["worker"] == 3
    # The other handler got the record (which the worker's filter then tagged, as ever).
    assert [record.fields for record in seen] == [{**fields, "worker": 3}]  # type: ignore[attr-defined]


def test_new_request_ids_are_distinct_and_drawn_from_the_kernel_in_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request without an X-Request-Id gets 128 random bits in hex; a getrandom call per
    webhook was a system call the naive proxy does not make, so they come 256 at a time."""
    draws: list[int] = []
    urandom = os.urandom

    def counted(size: int) -> bytes:
        draws.append(size)
        return urandom(size)

    monkeypatch.setattr(os, "urandom", counted)
    request = make_mocked_request("POST", "/webhooks/stripe")
    ids = [log_line.start(request, "stripe", "stripe")["request_id"] for _ in range(600)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(draws) <= 3  # 600 IDs, 256 a draw (the first may find some ready)
    # The provider's own ID is kept, and draws nothing.
    before = len(draws)
    given = make_mocked_request("POST", "/webhooks/stripe", headers={"X-Request-Id": "req-9"})
    assert log_line.start(given, "stripe", "stripe")["request_id"] == "req-9"
    assert len(draws) == before


def test_a_forked_worker_draws_request_ids_of_its_own() -> None:
    """IDs drawn ahead in the parent are never a forked worker's: the two would log, and send
    the app, the same request IDs."""
    script = (
        "import os, sys\n"
        "from aiohttp.test_utils import make_mocked_request\n"
        "from proxy import log_line\n"
        "request = make_mocked_request('POST', '/hook')\n"
        "log_line.start(request, None, None)\n"  # the parent has IDs ready now
        "read, write = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.write(write, log_line.start(request, None, None)['request_id'].encode())\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "print(os.read(read, 64).decode(), log_line.start(request, None, None)['request_id'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )  # fmt: skip
    child, parent = done.stdout.split()
    assert len(child) == len(parent) == 32
    assert child != parent
