"""The stand-in app of compose.yaml: examples/upstream.py's handler, served on 0.0.0.0.

examples/upstream.py binds 127.0.0.1 only (its port is its one option), which another
container cannot reach. This loads that file without running its ``__main__`` block and serves
its ``handle`` on all interfaces:

    python app.py [PORT [HOST]]        # defaults: 3000, 0.0.0.0
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from aiohttp import web

# deploy/compose/app.py -> examples/upstream.py, in the repository and in the container alike.
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "upstream.py"


def main() -> None:
    example = runpy.run_path(str(EXAMPLE))  # run_name is not "__main__": it does not serve
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", example["handle"])
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    host = sys.argv[2] if len(sys.argv) > 2 else "0.0.0.0"
    web.run_app(application, host=host, port=port, print=None)


if __name__ == "__main__":
    main()
