"""kvmem.redaction: the one function every URL goes through before it is shown, tested to the character."""

from __future__ import annotations

import pytest

from kvmem.redaction import redact, url_password


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://kvmem:PW@127.0.0.1:6399/0", "redis://kvmem:***@127.0.0.1:6399/0"),
        ("redis://:PW@h:1/0?prefix=x", "redis://:***@h:1/0?prefix=x"),
        ("rediss+cluster://u:PW@h1:1,h2:2/?prefix=x", "rediss+cluster://u:***@h1:1,h2:2/?prefix=x"),
        ("postgresql+psycopg://kvmem:PW@db:5432/kvmem", "postgresql+psycopg://kvmem:***@db:5432/kvmem"),
        # a password that was not percent-encoded: hidden whole, whatever a parser would make of it
        ("redis://u:p#ss/w?rd@Zq7@h:1/0", "redis://u:***@h:1/0"),
        ("postgresql+psycopg://u:p@ss@h/db", "postgresql+psycopg://u:***@h/db"),
        ("postgresql://user@tenant:PW@h/db", "postgresql://user@tenant:***@h/db"),  # an @ in the user name
        ("redis:/u:PW@h:1", "redis:***@h:1"),  # not a URL a parser takes, a password all the same
        # passwords given as query options (redis-py, libpq)
        ("redis://h:1/0?password=PW&prefix=x", "redis://h:1/0?password=***&prefix=x"),
        ("postgresql://u@h/db?sslmode=require&sslpassword=P#W", "postgresql://u@h/db?sslmode=require&sslpassword=***"),
        ("rediss://u:PW@h/0?ssl_password=KPW", "rediss://u:***@h/0?ssl_password=***"),
        # nothing to hide: unchanged
        ("redis://kvmem@h:1/0", "redis://kvmem@h:1/0"),
        ("rediss://h:1/0?prefix=x&ttl=60", "rediss://h:1/0?prefix=x&ttl=60"),
        ("sqlite:////data/a@b/catalog.sqlite3", "sqlite:////data/a@b/catalog.sqlite3"),
        ("", ""),
    ],
)
def test_redact_hides_every_password(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_an_at_in_a_query_value_hides_more_never_less() -> None:
    assert redact("redis://u:PW@h:1/0?prefix=a@b") == "redis://u:***@b"


@pytest.mark.parametrize(
    "url, password",
    [
        ("redis://u:p%40ss@h/0", "p%40ss"),
        ("redis://u:p@ss@h/0", "p@ss"),
        ("redis://:PW@h/0", "PW"),
        ("redis://u@h/0", ""),
        ("redis://h/0", ""),
    ],
)
def test_url_password_is_the_password_as_written(url: str, password: str) -> None:
    assert url_password(url) == password
