"""`ray-ple ready`: wait until a Serve application can serve, under Ray's token auth as Ray
2.60 starts a cluster by default (no RAY_* variable needed).

Readiness is Serve's own application status (the dashboard's `GET /api/serve/applications/`):
RUNNING once every replica's constructor returned, which for an offloaded model is after its
pairs are attached and its engine started (`PleLLMServer.start()`). The request carries the
cluster's token where one exists (`RAY_AUTH_TOKEN`, the file `RAY_AUTH_TOKEN_PATH` names, or
`~/.ray/auth_token`, which a local cluster writes when it starts with token auth), so the
check works with auth on or off. One JSON line per status seen; exit 0 at RUNNING, 1 when
the application failed to deploy, 124 at the timeout.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

FAILED = ("DEPLOY_FAILED", "UNHEALTHY")


def token() -> str | None:
    """The cluster's auth token as Ray's own clients find it, or None (auth off)."""
    if tok := os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return tok
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def app_status(address: str, app: str, timeout_s: float = 5.0) -> tuple[str | None, str]:
    """(status, message) of `app` from the dashboard; status None while it is not listed or
    the dashboard does not answer yet."""
    req = urllib.request.Request(f"{address.rstrip('/')}/api/serve/applications/")
    if tok := token():
        req.add_header("Authorization", f"Bearer {tok}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            apps = json.loads(r.read()).get("applications") or {}
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            why = ("the token was refused" if token() else "no token found (RAY_AUTH_TOKEN, "
                   "RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)")
            raise PermissionError(f"the dashboard at {address} refused the request "
                                  f"({exc.code}): {why}") from None
        return None, f"dashboard answered {exc.code}"
    except (OSError, ValueError) as exc:
        return None, f"dashboard not answering ({type(exc).__name__})"
    info = apps.get(app)
    if not isinstance(info, dict):
        return None, f"application {app!r} not deployed yet"
    return info.get("status"), str(info.get("message") or "")


def main(app: str, address: str, timeout_s: float, interval_s: float) -> int:
    t0 = time.monotonic()
    last = object()
    while True:
        try:
            status, message = app_status(address, app)
        except PermissionError as exc:
            print(f"ray-ple ready: {exc}", file=sys.stderr, flush=True)
            return 1
        if status != last:
            print(json.dumps({"ray_ple": "app_status", "app": app, "status": status,
                              "after_s": round(time.monotonic() - t0, 1),
                              "message": message[:300]}), flush=True)
            last = status
        if status == "RUNNING":
            return 0
        if status in FAILED:
            print(f"ray-ple ready: application {app!r} is {status}: {message}",
                  file=sys.stderr, flush=True)
            return 1
        if time.monotonic() - t0 >= timeout_s:
            print(f"ray-ple ready: application {app!r} not RUNNING after {timeout_s:g} s "
                  f"(last status {status})", file=sys.stderr, flush=True)
            return 124
        time.sleep(interval_s)
