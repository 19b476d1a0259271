"""The application's keys (aiohttp's typed ``web.AppKey``): what ``app`` puts on the
application at its start and the handler (``pipeline``), the admin listener (``admin``) and the
worker (``server``) read of it, in one module below all of them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import jinja2
from aiohttp import web

from proxy import (
    app_limit,
    config,
    database,
    delivery,
    errors,
    flights,
    memory,
    metrics,
    route_holds,
    tracing,
)
from proxy.upstream import forwarder


class Start:
    """How the claim store's start ended, for ``serve``: ``failed`` is set, with ``error``, when
    it cannot succeed (the table or the grants are wrong, or the database did not answer
    within ``database.start_timeout``); ``serve`` then drains and exits 1."""

    def __init__(self) -> None:
        self.failed = asyncio.Event()
        self.error: errors.ProxyError | None = None

    def fail(self, error: errors.ProxyError) -> None:
        self.error = error
        self.failed.set()


@dataclass(frozen=True, slots=True)
class Services:
    """What every request of a worker uses, built once at its start (``app``) and handed to
    each request's cycle (``pipeline.Cycle``), as uvicorn's protocol hands its
    ``RequestResponseCycle`` the transport: the cycle looks nothing up on the application."""

    store: database.Store
    executor: delivery.Executor  # the attempt, and what it leads to (receipts, holds)
    forwarder: forwarder.Forwarder
    room: app_limit.Room
    holds: route_holds.Holds  # which scopes are held now, read without a round trip
    flights: flights.Flights
    budget: memory.Budget
    metrics: metrics.Metrics


CONFIG = web.AppKey("config", config.Config)
DSN = web.AppKey("dsn", str)
TRACING = web.AppKey("tracing", tracing.Tracing)
START = web.AppKey("start", Start)
STORE = web.AppKey("store", database.Store)
FORWARDER = web.AppKey("forwarder", forwarder.Forwarder)
FLIGHTS = web.AppKey("flights", flights.Flights)
# This worker's copy of the route holds: ``held(scope)`` answers without a database round trip.
HOLDS = web.AppKey("holds", route_holds.Holds)
METRICS = web.AppKey("metrics", metrics.Metrics)
DRAINING = web.AppKey("draining", asyncio.Event)
BUDGET = web.AppKey("budget", memory.Budget)
ROOM = web.AppKey("room", app_limit.Room)
# The receipts' databases (``database.receipts``), by the name of each route with ``receipt``.
RECEIPTS = web.AppKey("receipts", dict[str, database.Receipts])
# This worker's attempts at the app and what each leads to (receipts, Retry-After holds).
EXECUTOR = web.AppKey("executor", delivery.Executor)
# What every request uses (the above, once the worker has started), handed to its cycle.
SERVICES = web.AppKey("services", Services)
# On the admin listener's application (``admin``): the proxy's, whose keys above it reads.
PROXY = web.AppKey("proxy", web.Application)
# On the console's (``console``): its settings and its page templates.
CONSOLE = web.AppKey("console", config.console.ConsoleConfig)
CONSOLE_TEMPLATES = web.AppKey("console_templates", jinja2.Environment)
