"""Run a real Alertmanager for tests: the proof that an alert reaches the webhook is Alertmanager delivering it.

:class:`AlertmanagerServer` starts Debian's ``prometheus-alertmanager`` on loopback with a temporary config and
data directory (no clustering), waits until it is ready, and stops it (and removes its files) on exit. Its config is
the shipped example (``grafana/alertmanager.yml``) rewritten by :func:`example_config`: the webhook URL pointed at
the sidecar under test, the bearer token file at the test's, and the grouping timers shortened so a test does not
wait 30 minutes for a notification. Everything else (routes, matchers, receivers, inhibit rules) is the example's,
so a test of the chain tests the file an operator installs::

    cfg = example_config(Path("grafana/alertmanager.yml"), webhook_url=f"{control}/remap", token_file=token)
    with AlertmanagerServer(cfg) as am:
        prom = PrometheusServer([...], alertmanager_url=am.url)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx

from pinsidecar.testing._loopback_server import LoopbackServer

__all__: list[str] = []  # nothing here is another package's business

# The example's receiver that calls the sidecar's webhook.
REMAP_RECEIVER = "pinsidecar-remap"


def alertmanager_binary() -> str | None:
    return shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


def _walk_routes(route: dict[str, Any]) -> list[dict[str, Any]]:
    out = [route]
    for child in route.get("routes") or []:
        out += _walk_routes(child)
    return out


def example_config(path: Path, *, webhook_url: str, token_file: Path, group_wait: str = "0s",
                   group_interval: str = "2s", repeat_interval: str = "1h") -> dict[str, Any]:
    """The shipped example, with the remap receiver's URL and token file replaced and every route's grouping
    timers set to the given (short) values. Raises ``ValueError`` if the example has no remap receiver."""
    import yaml  # only tests build configs; the daemon never needs yaml

    cfg = yaml.safe_load(Path(path).read_text())
    receivers = {r["name"]: r for r in cfg.get("receivers", [])}
    if REMAP_RECEIVER not in receivers or not receivers[REMAP_RECEIVER].get("webhook_configs"):
        raise ValueError(f"{path}: no {REMAP_RECEIVER!r} receiver with a webhook_configs entry")
    for hook in receivers[REMAP_RECEIVER]["webhook_configs"]:
        hook["url"] = webhook_url
        hook.setdefault("http_config", {}).setdefault("authorization", {})["credentials_file"] = str(token_file)
    for route in _walk_routes(cfg["route"]):
        for key, value in (("group_wait", group_wait), ("group_interval", group_interval),
                           ("repeat_interval", repeat_interval)):
            if key in route or route is cfg["route"]:
                route[key] = value
    return cfg


class AlertmanagerServer(LoopbackServer):
    """A throw-away Alertmanager with ``config`` (a dict, written as JSON, which is YAML)."""

    name = "alertmanager"
    install_hint = "apt-get install -y prometheus-alertmanager"

    def __init__(self, config: dict[str, Any], *, port: int | None = None, binary: str | None = None) -> None:
        super().__init__(port=port, binary=binary or alertmanager_binary())
        self.config = config

    def write_config(self, directory: Path) -> Path:
        cfg = directory / "alertmanager.yml"
        cfg.write_text(json.dumps(self.config, indent=1))
        return cfg

    def argv(self, config: Path, directory: Path) -> list[str]:
        assert self.binary is not None
        return [self.binary, f"--config.file={config}", f"--storage.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=", "--log.level=info"]

    # ------------------------------------------------------------------------------------------------ API
    def alerts(self, **filters: str) -> list[dict[str, Any]]:
        """The alerts it holds now (``/api/v2/alerts``), e.g. ``alerts(active="true")``."""
        r = httpx.get(f"{self.url}/api/v2/alerts", params=filters, timeout=10)
        r.raise_for_status()
        return r.json()

    def post_alerts(self, alerts: list[dict[str, Any]]) -> None:
        """Inject alerts as Prometheus would (``POST /api/v2/alerts``)."""
        r = httpx.post(f"{self.url}/api/v2/alerts", json=alerts, timeout=10)
        r.raise_for_status()
