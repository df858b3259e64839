"""The shared token: from ``NANOGRPO_TOKEN`` or a file, never the command line (where ``ps`` shows it)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from nanogrpo.errors import ConfigError

TOKEN_ENV = "NANOGRPO_TOKEN"
MIN_TOKEN_LEN = 16


def load_token(token_file: str | None = None) -> str | None:
    """The token from ``token_file`` when given, else from the environment; None when neither is set."""
    if token_file:
        p = Path(token_file).expanduser()
        if not p.is_file():
            raise ConfigError(f"token file not found: {p}")
        token = p.read_text().strip()
        if not token:
            raise ConfigError(f"token file {p} is empty")
    else:
        token = os.environ.get(TOKEN_ENV, "").strip() or None
    if token is not None and len(token) < MIN_TOKEN_LEN:
        raise ConfigError(f"the shared token must be at least {MIN_TOKEN_LEN} characters "
                          "(e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`)")
    if token is not None and not token.isascii() or (token and not token.isprintable()):
        raise ConfigError("the shared token must be printable ASCII")
    return token


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}
