"""How an HTML or XML parser reads markup: character references decoded, CDATA sections unwrapped.

The bytes of an HTML or XML body are what is sent on (and masked); what a parser reads from them
(``ElementTree.fromstring(body).text``, a browser's text) is judged too, so markup cannot spell past a rule or the
model what the application or the client reads (``&#65;TTACK``, ``AT<![CDATA[TACK]]>``), and a redact rule whose span
only that reading holds is refused rather than sent on unmasked (:meth:`guard.policy.redact.Redactor.leaves`).
"""

from __future__ import annotations

import html
import re

__all__ = ["is_markup", "is_xml", "markup_reading", "with_markup_reading"]


def is_xml(media: str) -> bool:
    """``application/xml``, ``text/xml`` and ``+xml`` types."""
    return media in ("application/xml", "text/xml") or media.endswith("+xml")


def is_markup(media: str) -> bool:
    """Whether a body of ``media`` (a media type without parameters, lower-case) is read as markup: HTML or XML."""
    return media == "text/html" or is_xml(media)


#: A numeric character reference of nine digits or more (leading zeros included), and its ``;`` if any.
_LONG_REFERENCE = re.compile(r"&#(?:([xX])([0-9a-fA-F]{9,})|([0-9]{9,}))(;?)")


def _shortened(match: re.Match[str]) -> str:
    """A long numeric reference without its leading zeros, or U+FFFD (what ``html.unescape`` reads past U+10FFFF)
    when more than eight digits remain: ``html.unescape`` calls ``int()`` on the digits, which raises past 4,300."""
    x, hex_digits, decimal_digits, end = match.groups()
    digits = (hex_digits or decimal_digits).lstrip("0") or "0"
    return "\ufffd" if len(digits) > 8 else f"&#{x or ''}{digits}{end}"


def markup_reading(text: str) -> str:
    """``text`` as a parser reads it: CDATA markers removed and character references decoded (``html.unescape``,
    long numeric references shortened first: :func:`_shortened`); linear, whatever is left unclosed."""
    text = text.replace("<![CDATA[", "").replace("]]>", "")
    return html.unescape(_LONG_REFERENCE.sub(_shortened, text) if "&#" in text else text)


def with_markup_reading(text: str) -> str:
    """What markup ``text`` is judged as: the text, then on a line of its own what a parser reads from it
    (:func:`markup_reading`) where that differs. For judging only: what is sent on (and masked) is ``text``."""
    parsed = markup_reading(text)
    return text if parsed == text else f"{text}\n{parsed}"
