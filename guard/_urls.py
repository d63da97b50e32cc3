"""URLs as logs, errors and spans name them."""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["shown_url"]


def shown_url(url: str) -> str:
    """``url`` without userinfo (``user:password@``), query and fragment, which can hold credentials;
    ``[unparsable URL]`` when :func:`urllib.parse.urlsplit` refuses it."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "[unparsable URL]"
    return parts._replace(netloc=parts.netloc.rpartition("@")[2], query="", fragment="").geturl()
