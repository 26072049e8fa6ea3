"""The OpenAI API's keys (``frontend.api_key_file``, as vLLM's server has ``--api-key``): with a key file, every
``/v1/...`` request must carry one of its keys as ``Authorization: Bearer <key>``; one without gets an OpenAI-shaped
401 before its body is read. ``/health`` and ``/metrics`` stay open (probes and scrapers)."""

from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from trident.frontend.responses import error_body


def load_keys(path: Path) -> list[bytes]:
    """The keys of a key file, one per line (a file group or others may read is refused, as for every secret)."""
    from trident.core.usage import read_secret_file

    keys = [line.strip().encode() for line in read_secret_file(str(path), "frontend.api_key_file").splitlines()]
    return [k for k in keys if k]


def require_keys(app: FastAPI, keys: list[bytes]) -> None:
    """Refuse every ``/v1/`` request that does not carry one of ``keys``."""

    @app.middleware("http")
    async def _check_key(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            given_bytes = given.strip().encode()
            if scheme.lower() != "bearer" or not any(hmac.compare_digest(given_bytes, k) for k in keys):
                return JSONResponse(error_body("invalid or missing API key: send Authorization: Bearer <key>", 401),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)
