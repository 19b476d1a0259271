"""Every proxy configuration the repository ships loads, and the production ones expose only the
webhooks: their port is public (an ingress, a Service), so a pass-through would publish the app's
whole HTTP surface past the signature check and the claim."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from proxy import config

ROOT = Path(__file__).resolve().parent.parent
# What the images, Compose and Kubernetes run. config.example.yaml is the local demo, where the
# app's own pages stay usable through the proxy: it keeps passthrough: all, and says so.
PRODUCTION = (
    "deploy/config.yaml",
    "deploy/compose/config.yaml",
    "deploy/kubernetes/config/config.yaml",
)
DEMO = ("config.example.yaml",)
ENVIRONMENT = {
    "DATABASE_URL": "postgresql://dedup:pw@db:5432/app",
    "UPSTREAM_URL": "http://127.0.0.1:3000",
    "STRIPE_WEBHOOK_SECRET": "whsec_dGVzdA==",
    "GITHUB_WEBHOOK_SECRET": "github-secret",
}


def proxy_config_text(relative: str) -> str:
    """The proxy configuration in a shipped file (a ConfigMap's ``config.yaml`` entry)."""
    text = (ROOT / relative).read_text(encoding="utf-8")
    document = yaml.safe_load(text)
    if isinstance(document, dict) and document.get("kind") == "ConfigMap":
        return str(document["data"]["config.yaml"])
    return text


def is_proxy_config(path: Path) -> bool:
    documents = yaml.safe_load_all(path.read_text(encoding="utf-8"))
    return any(isinstance(d, dict) and {"upstream", "routes"} <= d.keys() for d in documents)


def load(relative: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> config.Config:
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    # Kubernetes: the role from the pod, the password from a file mounted from a Secret.
    password = tmp_path / "password"
    password.write_text("pw\n", encoding="utf-8")
    monkeypatch.setenv("DATABASE_USER", "dedup_proxy")
    monkeypatch.setenv("DATABASE_PASSWORD_FILE", str(password))
    copy = tmp_path / Path(relative).name
    copy.write_text(proxy_config_text(relative), encoding="utf-8")
    return config.load(copy)


def test_every_shipped_proxy_config_is_classified() -> None:
    candidates = [
        *ROOT.glob("*.yaml"),
        *ROOT.glob("deploy/**/*.yaml"),
        *ROOT.glob("examples/**/*.y*ml"),
    ]
    found = {
        str(path.relative_to(ROOT))
        for path in candidates
        if is_proxy_config(path) or "dedup-proxy-config" in path.read_text(encoding="utf-8")
    }
    # These only name the ConfigMap.
    found -= {
        "deploy/kubernetes/config/kustomization.yaml",
        "deploy/kubernetes/migrate/kustomization.yaml",
        "deploy/kubernetes/migrate/stable-config/kustomization.yaml",
        "deploy/kubernetes/migrate/job.yaml",
        "deploy/kubernetes/proxy/deployment.yaml",
    }

    assert found == set(PRODUCTION + DEMO)


@pytest.mark.parametrize("relative", PRODUCTION)
def test_a_production_config_passes_nothing_through(
    relative: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load(relative, tmp_path, monkeypatch)

    assert cfg.passthrough == (), f"{relative} forwards paths that are no route"
    assert cfg.routes
    assert re.search(r"^\s*passthrough: none\b", proxy_config_text(relative), re.MULTILINE)


@pytest.mark.parametrize("relative", PRODUCTION + DEMO)
def test_no_shipped_config_shows_the_console_beyond_loopback_unless_it_says_so(
    relative: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load(relative, tmp_path, monkeypatch)

    if cfg.admin.open_console:
        # The local stack only, whose ports compose.yaml publishes on the host's loopback.
        assert relative == "deploy/compose/config.yaml"
        assert cfg.admin.console.unauthenticated
    elif relative != "config.example.yaml":
        assert not cfg.admin.console.enabled, f"{relative} serves the console beyond loopback"


@pytest.mark.parametrize("relative", DEMO)
def test_the_local_demo_passes_everything_through_and_says_so(
    relative: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load(relative, tmp_path, monkeypatch)

    assert cfg.passthrough is None
    comments = " ".join(
        line.strip().lstrip("# ") for line in proxy_config_text(relative).splitlines()
    )
    assert "In production, where the proxy's port is public, ship none" in comments
