"""The aiohttp (and prometheus-client) internals the proxy relies on are still there.

pyproject.toml pins aiohttp to the tested range (>=3.14.4,<3.15). Widening that range means
running this file first: each check names the module that relies on the internal, so a failure
says what to rework rather than surfacing as a subtle misbehaviour under load.
"""

from __future__ import annotations

from importlib.metadata import version

from aiohttp import http_exceptions, http_parser, web, web_protocol
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, Histogram

from proxy import connections as proxy_handler


def test_aiohttp_is_in_the_tested_range() -> None:
    major, minor, patch = (int(part) for part in version("aiohttp").split(".")[:3])
    assert (3, 14, 4) <= (major, minor, patch) < (3, 15, 0), (
        "aiohttp outside the range pyproject.toml pins: run this file and tests/ before widening it"
    )


def test_the_c_request_parser_can_be_told_apart() -> None:
    # server.serve refuses to start on the pure-Python parser (request smuggling fixes).
    assert http_parser.HttpRequestParser is http_parser.HttpRequestParserC


def test_parser_refusals_are_logged_the_way_logs_filters_them() -> None:
    # logs._RefusedRequests rewrites aiohttp's error line for a malformed request: it matches
    # the logger's name and the exception's type and code.
    assert vars(web_protocol)["server_logger"].name == "aiohttp.server"
    assert http_exceptions.BadHttpMessage("x").code == 400
    assert issubclass(http_exceptions.BadHttpMessage, http_exceptions.HttpProcessingError)


async def test_request_handler_internals_the_connection_bound_reads() -> None:
    # limits.ConnectionLimit: runner.server is the protocol factory, Server.connections the
    # open connections in order, and three private attributes of RequestHandler.
    runner = web.AppRunner(web.Application(), keepalive_timeout=7.0)
    await runner.setup()
    try:
        server = runner.server
        assert server is not None
        handler = server()
        assert isinstance(handler, web.RequestHandler)
        for name in ("_request_count", "_waiter", "_next_keepalive_close_time"):
            assert name in web.RequestHandler.__slots__, f"RequestHandler.{name} is gone"
        assert handler._request_count == 0
        assert isinstance(server.connections, list)
        assert callable(handler.force_close)
        # proxy.handler: a handler made as Server.__call__ makes one, from Server._kwargs (the
        # runner's settings, such as its keep-alive timeout).
        assert server._kwargs["keepalive_timeout"] == 7.0
        made = proxy_handler.factory(server, send_timeout=1.0, max_head=16384)
        assert (made._keepalive_timeout, handler._keepalive_timeout) == (7.0, 7.0)
    finally:
        await runner.cleanup()


def test_the_test_server_hook_conftest_overrides() -> None:
    # tests/conftest.ProxyTestServer passes the proxy's runner options through _make_runner.
    assert callable(getattr(TestServer, "_make_runner", None))


def test_the_histogram_internals_metrics_timings_writes_into() -> None:
    # metrics.Timings adds a flush's counts into a Histogram child's per-bucket values and its
    # sum, in the order of its upper bounds (tests/test_metrics.py checks the result).
    child = Histogram("h", "", ["route"], buckets=(1, 2), registry=CollectorRegistry()).labels("r")
    assert list(child._upper_bounds) == [1, 2, float("inf")]
    assert len(child._buckets) == 3
    assert all(callable(value.inc) for value in [child._sum, *child._buckets])
