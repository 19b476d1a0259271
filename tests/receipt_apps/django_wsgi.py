"""The Django project's WSGI application, with the test's faults around it."""

from __future__ import annotations

from django.core.wsgi import get_wsgi_application

from tests.receipt_apps import faults

application = faults.wsgi(get_wsgi_application())
