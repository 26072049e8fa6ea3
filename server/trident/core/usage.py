"""A mistake of the user's (a config file, a secret file): :class:`UsageError`, which the ``trident`` command prints
as one line with exit code 2; and secrets read from files only their owner may read."""

from __future__ import annotations

import os
import stat

from trident.core import auth


class UsageError(Exception):
    """A mistake of the user's (a config file, a secret file): printed as one line, exit code 2."""


def read_secret_file(path: str, flag: str) -> str:
    """A secret from a file that only its owner may read or write (as ssh wants of a private key)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise UsageError(f"{flag} {path}: {e.strerror or e}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{flag} {path}: not a regular file")
        if st.st_mode & 0o077:
            raise UsageError(f"{flag} {path}: group or others may read or write it (mode "
                             f"{stat.S_IMODE(st.st_mode):o}); make it yours alone: chmod 600 {path}")
        secret = f.read().strip()
    if not secret:
        raise UsageError(f"{flag} {path}: the file is empty")
    if flag == "--transfer-secret-file":
        strong_secret(secret, f"{flag} {path}")
    return secret


def strong_secret(value: str, where: str) -> None:
    """A :class:`UsageError` when the deployment secret is weak (:func:`trident.core.auth.check_secret`)."""
    try:
        auth.check_secret(value, where)
    except ValueError as e:
        raise UsageError(str(e)) from None
