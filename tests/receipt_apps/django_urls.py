"""The Django project's URLs: the route's path to the page's view."""

from __future__ import annotations

from django.urls import path
from ledger import views  # type: ignore[import-not-found]

urlpatterns = [path("pay", views.credit)]
