"""What kvmem shows of a URL: its passwords replaced by ``***``.

Every URL kvmem is given (``remote_url``: Redis; ``catalog_url``: SQLAlchemy)
reaches errors, log lines, ``repr`` and ``kvmem config`` only through
:func:`redact`. It works on the text as written, parsed or not, so a URL that
no library could parse is hidden as well as a good one.
"""

from __future__ import annotations

import re

__all__ = ["HIDDEN", "redact", "url_password"]

HIDDEN = "***"
# redis-py and libpq also take a password as a query option (?password=, ssl_password=, sslpassword=)
_SECRET_OPTION = re.compile(r"([?&][^=&]*(?:password|passwd|secret|token)[^=&]*=)[^&]*", re.IGNORECASE)


def _split(url: str) -> tuple[str, str | None, str]:
    """``url`` cut around the password of its user info: ``(before, password as written, after)``.

    NOTE: the user info runs to the last ``@``, not to where ``urlsplit`` (the first ``/ ? #``) or
    SQLAlchemy (the first ``@``) would end it: a password that was not percent-encoded is cut whole.
    An ``@`` in a query value makes the cut wider than the password, never narrower.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:  # not a URL anyone parses, but it may still hold a password
        scheme, rest = "", url
    userinfo, at, hosts = rest.rpartition("@")
    user, colon, password = userinfo.partition(":")
    if not (at and colon):
        return url, None, ""
    return f"{scheme}{sep}{user}:", password, f"@{hosts}"


def url_password(url: str) -> str:
    """The password in ``url``'s user info as written (percent-encoded or not), or ``""``."""
    return _split(url)[1] or ""


def redact(url: str) -> str:
    """``url`` with its password and the values of its password-like query options replaced by ``***``.

    Args:
        url: a Redis, SQLAlchemy or any ``scheme://[user[:password]@]host...`` URL, well-formed or not.

    Returns:
        ``redis://kvmem:***@host:6379/0``, ``postgresql+psycopg://kvmem:***@db/kvmem?sslpassword=***``.
    """
    before, password, after = _split(url)
    shown = url if password is None else f"{before}{HIDDEN}{after}"
    return _SECRET_OPTION.sub(rf"\g<1>{HIDDEN}", shown)
