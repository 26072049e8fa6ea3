"""A stage worker's GET /health (worker/health.py): 503 until it serves, 200 while it does, 503 once it stops."""

import urllib.error
import urllib.request

from trident.core.netutil import free_ports
from trident.worker.health import Health


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_health_follows_the_worker_s_state():
    port = free_ports(1)[0]
    health = Health("127.0.0.1", port)
    try:
        url = f"http://127.0.0.1:{port}"
        assert _get(f"{url}/health") == (503, "starting")
        health.state = "serving"
        assert _get(f"{url}/health") == (200, "serving")
        assert _get(f"{url}/")[0] == 404
        health.state = "stopping"
        assert _get(f"{url}/health") == (503, "stopping")
    finally:
        health.close()
