"""The Django project around the page's app ``ledger`` (tests/test_receipt_snippets.py): the
database from ``DATABASE_URL``, the app's URLs, the WSGI application with the test's faults."""

from __future__ import annotations

import os
from urllib.parse import parse_qs, unquote, urlsplit

_dsn = urlsplit(os.environ["DATABASE_URL"])
_query = parse_qs(_dsn.query)

SECRET_KEY = "test-receipt-snippets"
DEBUG = False
ALLOWED_HOSTS = ["*"]
INSTALLED_APPS = ["ledger"]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "tests.receipt_apps.django_urls"
WSGI_APPLICATION = "tests.receipt_apps.django_wsgi.application"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _dsn.path.lstrip("/"),
        "USER": unquote(_dsn.username or ""),
        "PASSWORD": unquote(_dsn.password or ""),
        "HOST": _query.get("host", [_dsn.hostname or ""])[0],
        "PORT": str(_dsn.port or ""),
    }
}
