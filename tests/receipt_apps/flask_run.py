"""The page's Flask app (its ``app.py``), with the test's faults around it, on Flask's own
server at ``PORT``."""

from __future__ import annotations

import os

from app import app  # type: ignore[import-not-found]

from tests.receipt_apps import faults

app.wsgi_app = faults.wsgi(app.wsgi_app)
app.run(host="127.0.0.1", port=int(os.environ["PORT"]), threaded=True)
