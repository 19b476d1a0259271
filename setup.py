"""The build's one option: ``DEDUP_PROXY_COMPILE=1`` compiles the modules every webhook runs
through with mypyc, as black and mypy ship themselves; without it (the default, and the README's
commands) the package is pure Python and installs where there is no C compiler.

The compiled modules are the same source, type-checked by mypy and turned into C: about 13 %
fewer instructions per webhook (bench/RESULTS.md, "meter"). The image is built compiled
(Dockerfile); so is the checkout for CI's PostgreSQL 15 pass (.ci/run). To build it yourself
(a C compiler and Python's headers needed)::

    pip install '.[compile]'         # mypyc, and what it type-checks the modules against
    DEDUP_PROXY_COMPILE=1 pip install --no-build-isolation .

Everything else is in pyproject.toml.
"""

import os

from setuptools import setup

# What a webhook runs through, from the request to the app and back, and its log line. A module
# left out runs as Python beside them: the database's store and places (async generators, which
# mypyc cannot compile), the signatures (mypyc takes a dataclass's ClassVar for a field), the
# errors (compiled, the suite crashed in them), the claim (tests/test_demo.py replaces a method of
# its class, which a compiled caller would not see).
COMPILED = [
    "proxy/app_limit.py",
    "proxy/delivery.py",
    "proxy/event_ids.py",
    "proxy/flights.py",
    "proxy/idempotency.py",
    "proxy/log_line.py",
    "proxy/logs.py",
    "proxy/memory.py",
    "proxy/metrics.py",
    "proxy/ordering.py",
    "proxy/pipeline.py",
    "proxy/request_body.py",
    "proxy/route_holds.py",
    "proxy/semantics.py",
    "proxy/server.py",
    "proxy/tracing/__init__.py",
    "proxy/tracing/spans.py",
    "proxy/database/sql.py",
    "proxy/upstream/forwarder.py",
    "proxy/upstream/http1.py",
    "proxy/upstream/proxy_headers.py",
    "proxy/upstream/transports.py",
]


def ext_modules() -> list[object]:
    if os.environ.get("DEDUP_PROXY_COMPILE", "") != "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        raise SystemExit(
            "DEDUP_PROXY_COMPILE=1 needs mypyc in the build's environment: "
            "pip install '.[compile]', then build with --no-build-isolation"
        ) from None
    # One C file per module, so that ``build_ext -j`` compiles them side by side. The runtime
    # they share is a top-level module, dedup_proxy__mypyc (mypyc cannot put it in the package).
    # Errors in the modules they import but are not compiled (an extra's, not installed) are not
    # theirs: mypy reads those modules silently (CI's mypy checks them all).
    extensions = mypycify(
        ["--follow-imports=silent", *COMPILED],
        opt_level="3", debug_level="0", group_name="dedup_proxy", multi_file=True,
    )  # fmt: skip
    return list(extensions)


setup(ext_modules=ext_modules())
