"""What a reviewer sees of a held body: the bytes an approval releases, as the application will read them, masked only
where a secret is, and whether that is all of it.

An approval releases the whole held body, so its view is the body as sent (``text``), with, for JSON and forms, the
decoded view beside it where escapes or percent-encoding spell what the application reads (``decoded``). A JSON or
urlencoded body is masked by its structure: the value of a secret-named field (:data:`SECRET_NAME`) is shown as
``[redacted]``, token by token, whatever escapes the client wrote (a JSON Web Token with its header and payload shown
decoded and only its signature masked), and nothing else is hidden on its account. Anything
not shown as the application reads it makes the view not ``complete`` (an approval then needs the reviewer's
``accept_unseen_body``, :mod:`guard.asgi.review_api`), with ``not_shown`` saying what and how much:

* a masked value of a secret-named field that does not read as a credential (:func:`_credential_shaped`: a value
  inside an object or array under such a field, a number, text such as an ``email_signature``, a URL, words joined
  by ``_`` or camelCase or run together, any token not shaped like a key, an identifier such as an ``iban``), each
  listed by its path (``$.session.messages[0].content``); a
  credential (a token, a password) is masked and not counted;
* the view is cut at :data:`MAX_SHOWN_BODY_BYTES`;
* a value that repeats a secret of the request (a credential header's, a secret-named field's) is masked where it is
  not that field's own value, and so is a secret its shape gives away anywhere (a key by its known prefix, a JWT, a
  URL's password or credential parameter's value; a Twilio account SID, an identifier, is kept): a client can make
  any text repeat a secret or take a key's shape, so the mask may hide what it approves;
* in any other body (text, multipart), the secret values are masked wherever the text repeats them;
* invisible and format characters (bidi controls, zero-width and tag characters, variation selectors, C1 controls,
  line and paragraph separators) are shown as ``\\u202e`` escapes, and counted;
* a body that is not UTF-8 text, or sent with a ``Content-Encoding``, is not shown at all (``text: null``).
"""

from __future__ import annotations

import base64
import codecs
import collections
import functools
import itertools
import json
import os
import re
import string
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote_plus, unquote_plus

from guard._english import english_words
from guard._json import is_json_media, json_unescaped, loads
from guard._readable import INVISIBLE, base64_bytes
from guard.asgi._media import is_textual
from guard.engine.telemetry import (
    _KEY_PREFIX,
    _KEY_SHAPE,
    SECRET_NAME,
    Scrubber,
    _scrub_shapes,
    body_secrets,
    credential_name,
    credential_value,
    redact_secrets,
    secret_values,
)
from guard.errors import InvalidJson
from guard.subject import HttpSubject, is_plain_key

__all__ = ["MAX_JUDGED_CHARS", "MAX_PREVIEW_BYTES", "MAX_SHOWN_BODY_BYTES", "body_preview", "shown_body"]

MAX_SHOWN_BODY_BYTES = 32_768
"""Most UTF-8 bytes of each view of a held body an item shows (``text``, and ``decoded`` where there is one); the
rest is counted, not shown."""
MAX_JUDGED_CHARS = 8_192
"""Most characters of secret-named fields' values a view reads for a credential's shape (:func:`_credential_shaped`,
milliseconds for each token of hundreds of characters; a value counts at most the 512 characters a credential may
have); the rest of the body after them is counted, not shown."""
#: Most characters of a secret (a key, a JWT, a URL, a repeated value) that a string read only in part
#: (:func:`_scrubbed`) never shows in part, where it runs past the end of what is read: a PEM private key's 16 KB
#: between its BEGIN and END lines (as the decision log finds it), and 1 KB for those lines.
_SECRET_CHARS = 17_408
#: Most characters of a string (a text body, a JSON string, a form's value) masked for the secrets it repeats or its
#: shape gives away: what a view shows (:data:`MAX_SHOWN_BODY_BYTES`, a character is a byte or more) and
#: :data:`_SECRET_CHARS` more; the rest is never shown.
_SCRUBBED_CHARS = MAX_SHOWN_BODY_BYTES + _SECRET_CHARS
MAX_PREVIEW_BYTES = 2_048
"""Most UTF-8 bytes of each view of a held body in a listing (:func:`body_preview`); the item itself carries them
whole."""
MASK = "[redacted]"

#: Control characters that make a body "not text" for a reviewer: invisible when shown, never in JSON or a form.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
#: Most paths of masked values that do not read as a credential that ``not_shown`` lists (the rest are counted).
MAX_LISTED_PATHS = 10
#: Names of password fields, whose values may hold blank space and still be a credential.
_PASSWORD_NAME = re.compile(r"(?:new_|old_|current_)?password|passphrase|pwd", re.IGNORECASE)
#: Names of auth header fields, whose values may be an auth scheme and its credential (``Bearer eyJ...``).
_AUTH_NAME = re.compile(r"(?:proxy-)?authorization|auth", re.IGNORECASE)
#: The auth schemes such a value may start with, and the credential after it.
_AUTH_SCHEME = re.compile(r"(?:Bearer|Basic|Digest|Token|ApiKey|AWS4-HMAC-SHA256|Negotiate) (\S+)", re.IGNORECASE)
_LINE_BREAK = re.compile(r"[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]")
#: Most characters of a credential read as one (a token, a password's line).
_CREDENTIAL_CHARS = 512
#: One credential token: key, JWT and base64 characters, at most :data:`_CREDENTIAL_CHARS` of them.
_TOKEN = re.compile(rf"[A-Za-z0-9._~+/=-]{{1,{_CREDENTIAL_CHARS}}}")
#: Hex of 16 digits or more (a digest, a key), or a UUID: credentials by their shape, which no words can spell.
_HEX_OR_UUID = re.compile(r"[0-9a-fA-F]{16,}|[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
#: A base64, base64url or alphanumeric run, padding included, which reads as a credential with enough characters of
#: enough kinds (:func:`_key_shaped`).
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]+={0,2}")
#: Twelve small letters (or capitals) in a row: words run together (``ignoreallprevious``), which a random key rarely
#: holds (under 0.3 % of 40-character base64 keys; a known prefix's capitals, ``AKIA...``, may).
_LOWER_RUN = re.compile(r"[a-z]{12}")
_UPPER_RUN = re.compile(r"[A-Z]{12}")
#: Eight capitals or more in a row, read for words run together (:func:`_capitals_read_as_words`): after a key's
#: prefix (``sk-APPROVEREFUNDNOW``, ``AKIAWIRETOMALLORYNOW``) capitals are not judged by :data:`_UPPER_RUN`.
_CAPITALS = re.compile(r"[A-Z]{8,}")
#: What parts a token into segments: words joined by them (``grant_admin_role``, ``ignore-the-policy``) are text.
_SEPARATORS = re.compile(r"[._~+/=-]+")
#: A segment shaped as a word: small letters, capitalised or not, or capitals only (not ``pQfprqNI``, as random
#: characters between two separators are).
_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+")
#: Characters of each window of a token read as words (:func:`_reads_as_text`): a random run before or after them
#: does not dilute the words.
_WORDS_WINDOW = 16
#: What is not a letter: taken out of a token before its letters are read as words run together
#: (``ign2ore5all8pri1orr4ule7s`` is ``ignoreallpriorrules``).
_NOT_LETTER = re.compile(r"[^A-Za-z]+")
#: Letters mirrored (Atbash: ``a`` is ``z``) and rotated by each shift of 0 to 25 (a Caesar shift), read back as
#: words (:func:`_reads_as_text`).
_ATBASH = str.maketrans(string.ascii_lowercase + string.ascii_uppercase,
                        string.ascii_lowercase[::-1] + string.ascii_uppercase[::-1])
_ROTATIONS = [str.maketrans(string.ascii_letters, string.ascii_lowercase[s:] + string.ascii_lowercase[:s]
                            + string.ascii_uppercase[s:] + string.ascii_uppercase[:s]) for s in range(26)]
#: The most common trigrams of English text, by which the rotation of a token's letters that reads as English is
#: chosen (:func:`_best_rotation`).
_TRIGRAMS = ("the", "and", "ing", "ion", "tio", "ent", "ati", "for", "her", "ter", "hat", "tha", "ere", "ate", "his",
             "con", "res", "ver", "all", "ons", "nce", "men", "ith", "ted", "ers", "pro", "thi", "wit", "are", "ess",
             "not", "ive", "was", "ect", "rea", "com", "eve", "per", "int", "est", "sta", "cti", "ica", "ist", "ear",
             "ain", "one", "our", "iti", "rat", "ore", "ove", "nor", "pre", "ble", "out", "ill", "you", "now")
#: Letters of a token (16 or more) read as words run together (:func:`_letters_read_as_words`), and of each window
#: of it.
_LETTERS_MIN = 16
_LETTERS_WINDOW = 24
#: A JSON Web Token: base64url header and payload (each a JSON object, ``eyJ`` is ``{"``) and signature.
_JWT = re.compile(r"(eyJ[A-Za-z0-9_-]+)\.(eyJ[A-Za-z0-9_-]+)\.([A-Za-z0-9_-]*)")
#: Base64url characters (unpadded) of a JWT signature: HMAC SHA-256, -384, -512 (32, 48, 64 bytes), ECDSA P-256,
#: P-384, P-521 (64, 96, 132), Ed448 (114) and RSA of 2048 or 3072 bits (256, 384; with a header and payload a
#: 2048-bit one is near 700 characters, over a token's 512).
_SIGNATURE_LENGTHS = frozenset(-(-4 * size // 3) for size in (32, 48, 64, 96, 114, 132, 256, 384))
#: Hex of 8 bytes or more, and base32 (one case) of 10 or more: encodings a token's text may be decoded from
#: (:func:`_decoded_text`), besides base64 and base64url.
_HEX_BYTES = re.compile(r"(?:[0-9a-fA-F]{2}){8,}")
_BASE32 = re.compile(r"[A-Z2-7]{16,}=*|[a-z2-7]{16,}=*")
#: Fewest characters of decoded text (:func:`_decoded_text`), and most decodings of a token read one inside another
#: (base64 of base64 of text).
_DECODED_MIN = 12
_MAX_DECODINGS = 3
#: A run of 20 printable ASCII characters or more in a token's decoded bytes (:func:`_holds_text`): ASCII, Latin-1
#: and cp1252 text share these bytes, so text in any of them, after random bytes, before a stray byte or NUL padding,
#: holds such runs; random bytes hold one hardly ever (none in 100,000 random base64 keys of 24 to 128 bytes).
_ASCII_RUN = re.compile(rb"[\x20-\x7e]{20,}")
#: Four runs of letters or more, each of two letters or more, bytes that are not letters between each two (blanks,
#: tabs, CRLF, NULs, Latin-1 bytes, as many as there are): text whose words are split by bytes that end an
#: :data:`_ASCII_RUN` (:func:`_holds_words`).
_WORD_RUN = re.compile(rb"(?<![A-Za-z])[A-Za-z]{2,}(?:[^A-Za-z]+[A-Za-z]{2,}){3,}")
#: Separators a token's groups may be joined by (``SWdub3Jl-IGFsbCBw``, ``4967-6e6f``), taken out before it is decoded.
_GROUP_SEPARATORS = re.compile(r"[-_.~]")
_HEX_DIGITS = re.compile(r"[0-9a-fA-F]+")
#: How gzip data (``1f 8b 08``) and zlib data (``78`` and a header check for each compression level) start, and most
#: bytes a token's decoded text is inflated to (:func:`_decodings`): compressed text is read as that text.
_DEFLATE_START = re.compile(rb"\x1f\x8b\x08|\x78[\x01\x5e\x9c\xda]")
_MAX_INFLATED = 4_096
#: Chinese or Japanese text (ideographs, kana) and Korean text (Hangul syllables), each with ASCII, CJK punctuation and
#: full-width forms: UTF-16 text in scripts whose blocks span many high bytes (:func:`_one_script`).
_HAN_TEXT = re.compile(r"[\x00-\x7f\u3000-\u30ff\u4e00-\u9fff\uff00-\uffef]+")
_HANGUL_TEXT = re.compile(r"[\x00-\x7f\u3000-\u303f\uac00-\ud7a3\uff00-\uffef]+")
#: One piece of a token read as words: a word (capitalised or not), a run of capitals (an acronym), a run of digits.
_PIECE = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
#: Secret-named fields (:data:`~guard.engine.telemetry.SECRET_NAME`, which the decision log and the state mask too)
#: whose values identify what a request acts on (an IBAN, an account or routing number, an object's ``key``): masked,
#: but never read as a credential, so an approval of such a body names ``accept_unseen_body``.
_IDENTIFIER_NAME = re.compile(r"^iban$|(?:^|[-_])(?:account|routing)[-_]?num(?:ber)?(?:$|[-_])|^key$", re.IGNORECASE)
#: One token of JSON text: a string (escapes included), a bracket or separator, a bare value (number, literal), blank
#: space, or any other character (the view reads a body a strict parser accepted; it never fails on one it did not).
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]:,]|[^\s{}\[\]:,"]+|\s+|.', re.DOTALL)
_LITERALS = frozenset({"true", "false", "null"})


def shown_body(subject: HttpSubject, body: bytes) -> dict[str, Any]:
    """The held ``body`` (the bytes a release gives the application) as a reviewer sees it (see the module)::

        {"size_bytes": 40012, "text": "{\\"message\\": ...", "decoded": None, "complete": False,
         "not_shown": "7244 more bytes not shown"}

    ``text``: the body as sent, read as UTF-8, secrets masked, invisible characters as escapes, at most
    :data:`MAX_SHOWN_BODY_BYTES` bytes; ``None`` when it is not text (not UTF-8, C0 control characters: a binary
    file, a multipart body with one; or sent with a ``Content-Encoding``). ``decoded``: for a JSON body with ``\\u``
    escapes, or a form with percent-encoding, what the application decodes (JSON strings with their escapes read;
    a form's fields one a line, ``"name": "value"``), masked and cut the same way; else ``None``. ``complete``: whether
    the views show all the application reads; ``not_shown``: what they leave out, ``None`` when complete."""
    coding = subject.headers.get("content-encoding", "").strip()
    encoded = coding.lower() not in ("", "identity")
    try:
        text = None if encoded else body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or _CONTROL.search(text):
        how = f"sent with Content-Encoding {coding}" if encoded else "that are not text"
        media = subject.content_type or "a body without Content-Type"
        return {"size_bytes": len(body), "text": None, "decoded": None, "complete": False,
                "not_shown": f"{len(body)} bytes of {media} {how}: not shown"}
    is_json = _is_json(subject, text)
    if is_json or subject.content_type == "application/x-www-form-urlencoded":
        repeats = _Repeats(subject)
        view = (_json_view if is_json else _form_view)(text, repeats, MAX_SHOWN_BODY_BYTES)
        view.cut = repeats.cut
    else:
        view = _text_view(text, subject)
    return view.shown(len(body))


def body_preview(shown: dict[str, Any]) -> dict[str, Any]:
    """A :func:`shown_body` view as a listing carries it: ``text`` and ``decoded`` cut to :data:`MAX_PREVIEW_BYTES`
    bytes each, and ``preview``, whether either was cut (the item itself, ``GET /{id}``, has them whole); ``complete``
    and ``not_shown`` stay those of the whole view."""
    out = dict(shown)
    cut = False
    for name in ("text", "decoded"):
        if isinstance(out.get(name), str):
            out[name], left = _cut(out[name], MAX_PREVIEW_BYTES)
            cut = cut or left > 0
    out["preview"] = cut
    return out


def _is_json(subject: HttpSubject, text: str) -> bool:
    """Whether the body is one JSON document the application reads as such: sent as JSON (or without a media type and
    parsed as JSON), or text that is one document (an application may parse any body as JSON)."""
    media = subject.content_type
    if is_json_media(media) or (not media and text and not isinstance(subject.body, str)):
        return True
    if not is_textual(media) or text.lstrip()[:1] not in ("{", "["):
        return False
    try:
        loads(text, duplicate_keys="collect")
    except InvalidJson:
        return False
    return True


class _Repeats:
    """The request's secret values (its credentials: the headers and query parameters named or shaped like one, and
    the credentials inside them; the values of the body's secret-named fields), found where a body repeats them; and
    the secrets a value's shape gives away (:func:`~guard.engine.telemetry._scrub_shapes`, card numbers aside: a key
    by its known prefix, a JWT, a URL holding a password or a credential-named parameter), wherever they are."""

    def __init__(self, subject: HttpSubject) -> None:
        pairs = [*subject.headers.items(), *((name, v) for name, values in subject.query.items() for v in values)]
        credentials = [value for name, value in pairs if credential_name(name) or credential_value(value)]
        self._values = set(secret_values([*credentials, *body_secrets(subject.body)]))
        self._scrub = Scrubber(list(self._values)) if self._values else None
        self.cut = 0  # UTF-8 bytes of the values' rests past their head, each put as one MASK (not shown)

    def __call__(self, value: str) -> str | None:
        """``value`` with the secrets it holds masked (all of it, :data:`MASK`, when it is one of the request's; in a
        URL, its password or credential parameters' values; a Twilio account SID is an identifier, kept), read as
        :func:`_scrubbed` reads it, what that leaves out shown as one more :data:`MASK` and its bytes added to
        ``cut``; ``None`` when it holds none."""
        if value in self._values:
            return MASK
        masked, cut = _scrubbed(value, self._masked)
        if masked == value:
            return None
        self.cut += cut
        return masked + MASK if cut else masked

    def _masked(self, text: str) -> str:
        """``text`` with the request's secret values and the secrets its shape gives away masked."""
        return _scrub_shapes(self._scrub(text) if self._scrub is not None else text, cards=False, account_ids=False)


def _scrubbed(text: str, scrub: Callable[[str], str]) -> tuple[str, int]:
    """``text`` masked by ``scrub`` as a view shows it, and the UTF-8 bytes it leaves out. Its first
    :data:`_SCRUBBED_CHARS` characters are read. Where ``text`` is longer and masking changes them, masking may shorten
    them enough to bring their end into view, so only the common start of the two readings, those characters masked
    and the first :data:`_SECRET_CHARS` fewer masked, is kept: a secret of up to :data:`_SECRET_CHARS` characters
    that runs past the longer reading's end is not in the shorter one, one that runs past the shorter's end is masked
    whole in the longer one, and either way the readings part at its start. What is left out (counted): ``text``
    past the shorter reading, and what that reading shows past the common start. Where masking changes nothing,
    ``text`` is returned whole (what is past the part read is past what a view shows too)."""
    head = text[:_SCRUBBED_CHARS]
    masked = scrub(head)
    if len(text) == len(head) or masked == head:
        return masked + text[len(head):], 0
    shorter = scrub(head[:-_SECRET_CHARS])
    same = len(os.path.commonprefix([masked, shorter]))
    left = len(text[len(head) - _SECRET_CHARS:].encode("utf-8")) + len(shorter[same:].encode("utf-8"))
    return masked[:same], left


@dataclass
class _View:
    """A body's views as built, before invisible characters are escaped and the views cut.

    Attributes:
        text: the body as sent, masked.
        decoded: what the application decodes, masked, or ``None`` when it is ``text``.
        masked: how many values (or places, in a text body) were masked outside a secret-named field's own value.
        credentials: how many secret-named fields' own values were masked as credentials (not counted as unseen).
        unread: characters of the body not read (the views were past the cut already).
        cut: UTF-8 bytes left out past the characters read for secrets (:func:`_scrubbed`), a value's rest shown as
            one :data:`MASK`.
        hidden: the paths of the secret-named fields' masked values that do not read as a credential.
    """

    text: str
    decoded: str | None = None
    masked: int = 0
    unread: str = ""
    hidden: list[str] = field(default_factory=list)
    credentials: int = 0
    cut: int = 0

    def shown(self, size: int) -> dict[str, Any]:
        """The view as an item shows it (:func:`shown_body`), for a body of ``size`` bytes."""
        text, left, invisible = _shown(self.text)
        decoded = None
        if self.decoded is not None:
            decoded, decoded_left, hidden = _shown(self.decoded)  # what escapes decode to as well
            invisible, left = max(invisible, hidden), max(left, decoded_left)
        left += len(self.unread.encode("utf-8")) + self.cut
        why = []
        if self.hidden:
            listed = ", ".join(self.hidden[:MAX_LISTED_PATHS])
            more = len(self.hidden) - MAX_LISTED_PATHS
            why.append(f"{len(self.hidden)} {'value' if len(self.hidden) == 1 else 'values'} of secret-named fields "
                       f"masked as {MASK} that do not read as a credential: {listed}"
                       + (f" and {more} more" if more > 0 else ""))
        if left:
            why.append(f"{left} more bytes not shown")
        if self.masked:
            why.append(f"{self.masked} {'place' if self.masked == 1 else 'places'} masked as {MASK} where the body "
                       "repeats a secret of the request, or holds a key, a URL's password or a JWT claim's secret, "
                       "outside a secret-named field's own value (the mask may hide other text)")
        if invisible:
            why.append(f"{invisible} invisible or format {'character' if invisible == 1 else 'characters'} (bidi, "
                       "zero-width, tag) shown as \\u escapes")
        return {"size_bytes": size, "text": text, "decoded": decoded, "complete": not why,
                "not_shown": "; ".join(why) or None}


def _shown(text: str) -> tuple[str, int, int]:
    """``text`` as a view shows it: each :data:`INVISIBLE` character written as an escape (``\\u202e``,
    ``\\U000e0041``), cut to :data:`MAX_SHOWN_BODY_BYTES` UTF-8 bytes; the bytes it leaves out, and how many
    invisible characters the part shown holds."""
    head, rest = text[:MAX_SHOWN_BODY_BYTES], text[MAX_SHOWN_BODY_BYTES:]  # a character is a byte or more
    head, invisible = INVISIBLE.subn(_escape, head)
    head, left = _cut(head, MAX_SHOWN_BODY_BYTES)
    return head, left + len(rest.encode("utf-8")), invisible


def _credential_shaped(name: str, value: str) -> bool:
    """Whether the string value of secret-named field ``name`` (its own value, not one inside an object or array under
    it) reads as a credential, so that masking it hides nothing a reviewer must read:

    * one token (:func:`_is_token`: at most 512 characters of ``A-Z a-z 0-9 . _ ~ + / = -``): hex, a UUID, or
      shaped like a key (:func:`_key_shaped`: a known key prefix, a JWT, a long base64 run of mixed case and digits)
      with no text in it (:func:`_reads_as_text`: ``grant_admin_role``, ``PleaseApproveThisRequest2024``, words
      after a random run); no blank space, no invisible character, no ``:`` (a URL), ``$``, ``*`` or ``{``; a token
      that decodes to text (hex, base64, base32) only if that text is such a token;
    * under an auth header's name (:data:`_AUTH_NAME`), a known scheme (:data:`_AUTH_SCHEME`: ``Bearer``, ``Basic``,
      ...) and one such token (``Bearer eyJ...``; after ``Basic``, base64 of ``user:password``, the token as written:
      :func:`_shaped_token`);
    * under a password's name (:data:`_PASSWORD_NAME`), any line of at most 512 characters without an invisible
      character (a passphrase has spaces).

    Never under a name that holds an identifier a reviewer must read (:data:`_IDENTIFIER_NAME`: ``iban``,
    ``account_number``, ``key``: where money goes, what is deleted)."""
    if _IDENTIFIER_NAME.search(name) is not None:
        return False
    if _is_token(value):
        return True
    if _AUTH_NAME.fullmatch(name) is not None:
        scheme = _AUTH_SCHEME.fullmatch(value)
        if scheme is None:
            return False
        if value[:6].lower() == "basic ":  # base64 of user:password: the credential is that text
            return _shaped_token(scheme.group(1))
        return _is_token(scheme.group(1))
    return (_PASSWORD_NAME.fullmatch(name) is not None and len(value) <= _CREDENTIAL_CHARS
            and not _LINE_BREAK.search(value) and INVISIBLE.search(value) is None)


def _is_token(value: str, depth: int = 0) -> bool:
    """Whether ``value`` is one credential token (:func:`_shaped_token`). A token, or a key's part after its known
    prefix, that decodes to text (:func:`_decoded_text`: hex, base64, base64url, base32 of UTF-8 or UTF-16) is judged
    as that text, ``depth`` decodings deep, at most :data:`_MAX_DECODINGS`: a credential only if the text is itself
    one token that is (base64 of a random key is a key; of a sentence, or of words run together, is not). Nor is a
    token (but a JWT, whose signature :func:`_jwt_shaped` reads) whose bytes hold text anywhere (:func:`_holds_text`:
    after a random prefix, before a stray byte, in Latin-1)."""
    if _TOKEN.fullmatch(value) is None:
        return False
    prefix = _KEY_PREFIX.match(value)
    key = value[prefix.end():] if prefix is not None and _KEY_SHAPE.fullmatch(value) else value
    text = _decoded_text(key)
    if text is not None:
        return depth < _MAX_DECODINGS and _is_token(text, depth + 1)
    return _shaped_token(value) and (_JWT.fullmatch(value) is not None or not _holds_text(key))


def _shaped_token(value: str) -> bool:
    """Whether ``value`` is one token (:data:`_TOKEN`) that is hex or a UUID (:data:`_HEX_OR_UUID`), or shaped like a
    key (:func:`_key_shaped`), as written (no decoding of it is read)."""
    if _TOKEN.fullmatch(value) is None:
        return False
    return _HEX_OR_UUID.fullmatch(value) is not None or _key_shaped(value)


def _key_shaped(value: str) -> bool:
    """Whether ``value`` has a key's shape and does not read as text (:func:`_reads_as_text`):

    * a JWT (:data:`_JWT`) whose header and payload are base64url of JSON objects (which a view shows decoded,
      :func:`_shown_secret`) and whose signature has a signature's length (:data:`_SIGNATURE_LENGTHS`) and neither
      reads as text nor decodes to text;
    * a key of a known prefix (the decision log's :data:`~guard.engine.telemetry._KEY_SHAPE`: ``sk_live_``,
      ``ghp_``, ``xoxb-``, ``SK`` and hex) whose part after the prefix (:data:`~guard.engine.telemetry._KEY_PREFIX`)
      is hex (:data:`_HEX_OR_UUID`) or does not read as text;
    * a base64, base64url or alphanumeric run (:data:`_BASE64_RUN`) of 20 characters or more holding upper case,
      lower case and digits, or of 32 or more holding two of them, that changes kind (upper case, lower case, digit,
      other) at least once in every 2.5 characters (3.5 with two kinds), as random characters do (words change kind
      only where they meet), holds no 12 capitals in a row and does not read as text.

    Anything else (``transferirTodoAlAtacante2024``, ``Wire5000ToAcct99887766X``, ``Go2Bank4Me``) is text."""
    jwt = _JWT.fullmatch(value)
    if jwt is not None:
        return _jwt_shaped(*jwt.groups())
    prefix = _KEY_PREFIX.match(value)
    if prefix is not None and _KEY_SHAPE.fullmatch(value):
        key = value[prefix.end():]
        return _HEX_OR_UUID.fullmatch(key) is not None or not _reads_as_text(key)
    if _BASE64_RUN.fullmatch(value) is None or _UPPER_RUN.search(value) or _reads_as_text(value):
        return False
    kinds = [_kind(c) for c in value]
    changes = sum(a != b for a, b in itertools.pairwise(kinds))
    if len(set(kinds) & {0, 1, 2}) == 3 and len(value) >= 20:
        return changes * 2.5 >= len(value)
    return len(set(kinds)) >= 2 and len(value) >= 32 and changes * 3.5 >= len(value)


def _jwt_shaped(header: str, payload: str, signature: str) -> bool:
    """Whether a JWT's three parts (base64url) are those of a signed token: the header and payload decode to JSON
    objects (:func:`_jwt_part`), and the signature has a signature's length (:data:`_SIGNATURE_LENGTHS`), does not
    read as text and does not decode to text (:func:`_decoded_text`: a signature is random bytes). The claims are
    not judged: a view shows them (:func:`_shown_secret`)."""
    for part in (header, payload):
        try:
            claims = json.loads(_jwt_part(part))
        except ValueError:  # not base64, not UTF-8, not JSON
            return False
        if not isinstance(claims, dict):
            return False
    return (len(signature) in _SIGNATURE_LENGTHS and not _reads_as_text(signature)
            and _decoded_text(signature) is None and not _holds_text(signature))


def _jwt_part(part: str) -> str:
    """A JWT's header or payload (base64url, unpadded) decoded: its JSON text. Raises ``ValueError`` when it is not
    base64url of UTF-8."""
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)).decode("utf-8")


def _shown_secret(name: str, value: str, repeats: _Repeats) -> tuple[str, int]:
    """What a view shows of the value of secret-named field ``name`` that reads as a credential
    (:func:`_credential_shaped`): :data:`MASK`; but a JWT (after an auth scheme too, under an auth header's name) as
    its header and payload decoded and its signature masked (``Bearer {"alg":"HS256"}.{"sub":"42"}.[redacted]``):
    the claims are what the application reads, and without its signature the token cannot be used. The claims are
    masked as a JSON body's view masks them (:func:`_json_view`: the values of secret-named claims, the secrets of
    the request they repeat, keys and URL passwords by their shape); and how many places were, each counted (the
    mask may hide text the application reads)."""
    scheme = _AUTH_SCHEME.fullmatch(value) if _AUTH_NAME.fullmatch(name) is not None else None
    head, token = (value[:scheme.start(1)], scheme.group(1)) if scheme is not None else ("", value)
    jwt = _JWT.fullmatch(token)
    if jwt is None:
        return MASK, 0
    views = [_json_view(_jwt_part(part), repeats, MAX_SHOWN_BODY_BYTES) for part in jwt.group(1, 2)]
    shown = f"{head}{views[0].text}.{views[1].text}.{MASK}"
    return shown, sum(view.masked + view.credentials + len(view.hidden) for view in views)


def _encodes_text(value: str) -> bool:
    """Whether ``value`` decodes to text (:func:`_decoded_text`) that holds blank space
    (``SWdub3JlIGFsbCBwcmV2aW91cyBydWxlcw`` is ``Ignore all previous rules``); ``aladdin:opensesame``
    (``Basic YWxhZGRpbjpvcGVuc2VzYW1l``) holds none."""
    text = _decoded_text(value)
    return text is not None and any(char.isspace() for char in text)


def _decoded_text(value: str) -> str | None:
    """``value`` decoded to text, or ``None``: read as hex (:data:`_HEX_BYTES`), base64 or base64url (padded or not)
    or base32 (:data:`_BASE32`), bytes that are UTF-8, or UTF-16 of one script (:func:`_one_script`), a byte order
    mark and a character cut at the end left out, of :data:`_DECODED_MIN` characters or more, at least 95 % printable
    (blank space counts) and at least half letters or digits, in any script. The bytes of a random key hardly ever
    are."""
    for data in _decodings(value):
        for coding in ("utf-8", "utf-16-le", "utf-16-be"):
            try:
                # not final: a character cut at the end is left out; so is a byte order mark
                text = codecs.getincrementaldecoder(coding)().decode(data).removeprefix("\ufeff")
            except UnicodeDecodeError:
                continue
            if (len(text) >= _DECODED_MIN and sum(c.isprintable() or c.isspace() for c in text) >= 0.95 * len(text)
                    and sum(c.isalnum() for c in text) * 2 >= len(text)
                    and (coding == "utf-8" or _one_script(text))):
                return text
    return None


def _holds_text(value: str) -> bool:
    """Whether the bytes ``value`` decodes to hold text anywhere in them, not only from the first byte as
    :func:`_decoded_text` reads it: a run of printable ASCII (:data:`_ASCII_RUN`) with two spaces or more, or at least
    80 % letters, or a run of common English words split by other bytes (:func:`_holds_words`), in the bytes of hex
    (from either of its first two digits) or of base64 or base64url (from any of its first four characters, the
    characters a last partial byte takes left out), as written and with the separators of groups taken out
    (:data:`_GROUP_SEPARATORS`). So text after random bytes (``\\xff``, a random prefix), before a
    stray byte, with NUL padding, in Latin-1 or cp1252, with words split by tabs or control bytes, or in groups is
    found; random bytes hardly ever are."""
    for chars in dict.fromkeys((value.rstrip("="), _GROUP_SEPARATORS.sub("", value).rstrip("="))):
        datas = []
        if _HEX_DIGITS.fullmatch(chars):
            datas += [bytes.fromhex(chars[skip:len(chars) - (len(chars) - skip) % 2]) for skip in (0, 1)]
        for skip in range(4):
            part = chars[skip:]
            try:
                datas.append(base64_bytes(part[:len(part) & ~3]))
            except ValueError:  # a character outside base64
                break
        for data in datas:
            for run in _ASCII_RUN.finditer(data):
                text = run.group()
                if text.count(b" ") >= 2 or sum(chr(c).isalpha() for c in text) * 5 >= len(text) * 4:
                    return True
            if _holds_words(data):
                return True
    return False


def _holds_words(data: bytes) -> bool:
    """Whether ``data`` holds a run of words (:data:`_WORD_RUN`) that reads as text: its pieces (:data:`_PIECE`,
    camelCase split) hold three or more common English words (:func:`~guard._english.english_words`) of three letters
    or more, with 70 % of the run's letters or more, or its letters read as words run together
    (:func:`_letters_read_as_words`: ``IGNOREALLPREVIOUS``). So words split by tabs, CRLF, NULs or other control or
    Latin-1 bytes, one or many, are found, camelCase or in capitals; random bytes hardly ever are (none in 300,000
    random keys of 16 to 128 bytes in base64, base64url and hex)."""
    common = english_words()
    for run in _WORD_RUN.finditer(data):
        text = run.group().decode("latin-1")
        pieces = [piece for piece in _PIECE.findall(text) if not piece.isdigit()]
        found = [piece for piece in pieces if len(piece) >= 3 and piece.lower() in common]
        if len(found) >= 3 and sum(map(len, found)) * 10 >= sum(map(len, pieces)) * 7:
            return True
        if _letters_read_as_words(text):
            return True
    return False


def _one_script(text: str) -> bool:
    """Whether ``text`` (decoded UTF-16) keeps to one script, as text does and random bytes read as UTF-16 hardly
    ever do: half its characters or more in one block of 256 code points (ASCII and Latin-1, Cyrillic, Greek, Arabic,
    Hebrew, Devanagari, Thai, kana), or all of them Chinese or Japanese, or Korean (:data:`_HAN_TEXT`,
    :data:`_HANGUL_TEXT`: those blocks are wide, a third and a sixth of UTF-16's code points)."""
    blocks = collections.Counter(ord(c) >> 8 for c in text)
    return (blocks.most_common(1)[0][1] * 2 >= len(text) or _HAN_TEXT.fullmatch(text) is not None
            or _HANGUL_TEXT.fullmatch(text) is not None)


def _decodings(value: str) -> list[bytes]:
    """The bytes ``value`` decodes to as hex, base64 or base64url, and base32, where it is written in each; and where
    those bytes start as gzip or zlib data does (:data:`_DEFLATE_START`), what they inflate to, at most
    :data:`_MAX_INFLATED` bytes of it."""
    out = []
    if _HEX_BYTES.fullmatch(value):
        out.append(bytes.fromhex(value))
    try:
        out.append(base64_bytes(value))
    except ValueError:  # a character outside base64, a length no encoding has
        pass
    if _BASE32.fullmatch(value):
        data = value.rstrip("=").upper()
        try:
            out.append(base64.b32decode(data + "=" * (-len(data) % 8)))
        except ValueError:  # a length no encoding has
            pass
    for data in [data for data in out if _DEFLATE_START.match(data)]:
        try:
            out.append(zlib.decompressobj(wbits=47).decompress(data, _MAX_INFLATED))  # 47: a gzip or a zlib header
        except zlib.error:  # not deflate data after all
            pass
    return out


def _kind(char: str) -> int:
    """A character's kind for :func:`_key_shaped`: 0 upper case, 1 lower case, 2 digit, 3 other."""
    return 0 if char.isupper() else 1 if char.islower() else 2 if char.isdigit() else 3


def _reads_as_text(value: str) -> bool:
    """Whether a token (or a key's part after its prefix) holds text, anywhere in it: 12 small letters in a row
    (:data:`_LOWER_RUN`: words run together), two segments next to each other (parted by :data:`_SEPARATORS`) of two
    letters or more shaped as words (:data:`_WORD`: ``grant_admin_role``, ``x9Qz-Ignora-las-reglas``), common English
    words that spell a part of it (:func:`_spells_words`), as written or with its letters rotated by 13 (rot13:
    ``VtaberNyyCerivbhfEhyrf`` is ``IgnoreAllPreviousRules``), reversed, mirrored (Atbash: ``a`` for ``z``) or
    rotated by the Caesar shift that reads most as English (:func:`_best_rotation`); or the whole token decodes to
    text with blank space (:func:`_encodes_text`). Words spelled with digits for letters (``Ign0r3Pr3v10us``) are not read."""
    if _LOWER_RUN.search(value) or _encodes_text(value):
        return True
    segments = _SEPARATORS.split(value)
    if any(_is_word(a) and _is_word(b) for a, b in itertools.pairwise(segments)):
        return True
    readings = (value, codecs.encode(value, "rot13"), value[::-1], value.translate(_ATBASH), _best_rotation(value))
    return any(_spells_words(reading) for reading in readings)


def _best_rotation(value: str) -> str:
    """``value`` with its letters rotated by the shift (1 to 25, 13 aside: rot13 is read anyway) under which they hold
    the most common English trigrams (:data:`_TRIGRAMS`): a Caesar shift of text read back (``LjqruhDoo`` is
    ``IgnoreAll``), so only that one rotation is read for words."""
    letters = _NOT_LETTER.sub("", value).lower()
    shifts = _trigram_shifts()
    hits = collections.Counter(s for i in range(len(letters) - 2) for s in shifts.get(letters[i:i + 3], ()))
    shift = max((s for s in range(1, 26) if s != 13), key=lambda s: hits[s])
    return value.translate(_ROTATIONS[shift])


@functools.cache
def _trigram_shifts() -> dict[str, list[int]]:
    """For each trigram of small letters, the shifts (1 to 25) that rotate it into one of :data:`_TRIGRAMS`."""
    out: dict[str, list[int]] = collections.defaultdict(list)
    for shift in range(1, 26):
        for trigram in _TRIGRAMS:
            out[trigram.translate(_ROTATIONS[26 - shift])].append(shift)
    return dict(out)


def _spells_words(value: str) -> bool:
    """Whether common English words spell a part of ``value``: the whole of it or any :data:`_WORDS_WINDOW`
    characters read as words (:func:`_reads_as_words`: ``x9QzR2...IgnoreThePolicyAndWire``), a run of capitals that
    does (:func:`_capitals_read_as_words`: ``APPROVEREFUNDNOW``), or its letters with digits and separators taken out
    (:func:`_letters_read_as_words`: ``ign2ore5all8pri1orr4ule7s``)."""
    if any(_capitals_read_as_words(run.group()) for run in _CAPITALS.finditer(value)):
        return True
    if _letters_read_as_words(value) or _reads_as_words(value):
        return True
    # starts[i]: places in value[:i] where a common word starts; a window with fewer than two holds no two words
    starts = list(itertools.accumulate((bool(ends) for ends in _word_ends(value.lower())), initial=0))
    windows = range(max(len(value) - _WORDS_WINDOW, 0) + 1)
    return any(_reads_as_words(value[i:i + _WORDS_WINDOW]) for i in windows
               if starts[min(i + _WORDS_WINDOW, len(value))] - starts[i] >= 2)


def _is_word(segment: str) -> bool:
    """Whether a segment of a token is shaped as a word of two letters or more (:data:`_WORD`)."""
    return len(segment) >= 2 and _WORD.fullmatch(segment) is not None


def _reads_as_words(value: str) -> bool:
    """Whether ``value`` holds two or more common English words (:func:`~guard._english.english_words`) of three
    letters or more and most of its letters are in them, read piece by piece (:data:`_PIECE`: camelCase, separators
    and digit runs part them): ``WireAll5000USDToAcct99887766`` does, a random key (``sk_live_51HxYzAbCdEf0123``, a
    JWT, hex) does not."""
    common = english_words()
    letters = english = words = 0
    for piece in _PIECE.findall(value):
        if piece.isdigit():
            continue
        letters += len(piece)
        if len(piece) >= 3 and piece.lower() in common:
            english += len(piece)
            words += 1
    return words >= 2 and english * 2 > letters


def _capitals_read_as_words(run: str) -> bool:
    """Whether common English words (:func:`~guard._english.english_words`) of three letters or more, split where
    they cover most, cover at least 70 % of the letters of ``run`` (capitals run together, :data:`_CAPITALS`, which
    :data:`_PIECE` reads as one piece): ``IGNOREALLPRIORRULES`` does; the random capitals of a key (``AKIA`` and 16 of
    ``A-Z 2-7``) hardly ever do."""
    return _words_cover(_word_ends(run.lower()), 0, len(run))


def _letters_read_as_words(value: str) -> bool:
    """Whether the letters of ``value`` (digits and separators taken out, case folded), once there are
    :data:`_LETTERS_MIN` or more, read as words run together (as :func:`_capitals_read_as_words` reads capitals), all
    of them or any :data:`_LETTERS_WINDOW` in a row: ``IGNOREA6LLPRIOR3RULESAN0D``, ``ign2ore5all8pri1orr4ule7san0d``;
    the letters of a random key hardly ever do (0.4 % of 40-character base64 keys, as without this reading). The
    words are looked up once for all the windows."""
    letters = _NOT_LETTER.sub("", value).lower()
    if len(letters) < _LETTERS_MIN:
        return False
    ends = _word_ends(letters)
    if _words_cover(ends, 0, len(letters)):
        return True
    # in_words[i]: letters of letters[:i] inside any word; a window they cover less than 70 % of is not read
    in_words = [0]
    reach = 0
    for i, word_ends in enumerate(ends):
        reach = max(reach, word_ends[-1]) if word_ends else reach
        in_words.append(in_words[-1] + (reach > i))
    windows = range(max(len(letters) - _LETTERS_WINDOW, 0) + 1)
    return any(_words_cover(ends, i, stop) for i in windows
               if (in_words[stop := min(i + _LETTERS_WINDOW, len(letters))] - in_words[i]) * 10 >= (stop - i) * 7)


def _word_ends(letters: str) -> list[list[int]]:
    """For each index of ``letters`` (case folded), the ends, ascending, of the common English words
    (:func:`~guard._english.english_words`) of three letters or more that start there: ``letters[i:end]`` is one.
    Each start is read only as far as a word's beginning (:func:`_word_prefixes`) goes on."""
    common = english_words()
    prefixes = _word_prefixes()
    out = []
    for start in range(len(letters)):
        ends = []
        end = start + 1
        while end <= len(letters) and letters[start:end] in prefixes:
            if end - start >= 3 and letters[start:end] in common:
                ends.append(end)
            end += 1
        out.append(ends)
    return out


def _words_cover(ends: list[list[int]], start: int, stop: int) -> bool:
    """Whether the words of :func:`_word_ends` (``ends``) inside ``[start, stop)``, split where they cover most, cover
    at least 70 % of those letters."""
    covered = [0] * (stop - start + 1)  # covered[i - start]: most letters of [i, stop) that words cover
    for i in range(stop - 1, start - 1, -1):
        best = covered[i + 1 - start]
        for end in ends[i]:
            if end > stop:
                break
            best = max(best, end - i + covered[end - start])
        covered[i - start] = best
    return covered[0] * 10 >= (stop - start) * 7


@functools.cache
def _word_prefixes() -> frozenset[str]:
    """Every beginning of each of :func:`~guard._english.english_words` (the words themselves included)."""
    return frozenset(word[:end] for word in english_words() for end in range(1, len(word) + 1))


def _path(stack: list[list[Any]]) -> str:
    """The JSON path of the value being read (``$.session.messages[0]``): a key that is not an identifier quoted, with
    what it cannot show as a JSON escape."""
    parts = ["$"]
    for frame in stack:
        key = frame[4]
        if not frame[0]:
            parts.append(f"[{frame[5]}]")
        elif key.isidentifier() and key.isascii():
            parts.append(f".{key}")
        else:
            parts.append(f"[{json.dumps(key)}]")
    return "".join(parts)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _cut(text: str, limit: int) -> tuple[str, int]:
    """``text`` cut to at most ``limit`` UTF-8 bytes (at a character's end), and how many bytes it leaves out."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text, 0
    head = data[:limit].decode("utf-8", "ignore")
    return head, len(data) - len(head.encode("utf-8"))


def _text_view(text: str, subject: HttpSubject) -> _View:
    """A body that is neither JSON nor a form: the request's secret values masked wherever the text repeats them
    (:func:`redact_secrets`, as the item's state is masked), each place counted; read as :func:`_scrubbed` reads it,
    what that leaves out counted as ``cut``."""
    masked, left = _scrubbed(text, lambda head: redact_secrets(head, subject))
    places = masked.count(MASK) - text[:_SCRUBBED_CHARS].count(MASK)
    return _View(masked, masked=max(places, 1) if masked != text else 0, cut=left)


def _json_view(text: str, repeats: _Repeats, limit: int) -> _View:
    """A JSON document's views, read token by token up to ``limit`` characters of view and
    :data:`MAX_JUDGED_CHARS` of values read for a credential's shape: each string and number under
    a secret-named key (at any depth below it) shown as :data:`MASK` (a credential key's own value as
    :func:`_shown_secret` shows it), and the keys there that are not plain
    identifiers, the path of each such value listed in ``hidden`` unless it is the key's own value and reads as a
    credential (:func:`_credential_shaped`); any other string, key or number that holds a secret of the request
    (``repeats``) masked and counted; a string with ``\\u`` escapes also decoded (``decoded``)."""
    out: list[str] = []
    decoded: list[str] = []
    hidden: list[str] = []
    escapes = False
    masked = credentials = 0
    size = judged = 0
    # one frame per open object or array: [is an object, under a secret-named key, expects a key, the value's key
    # is secret-named, the member's key as shown, the element's index]
    stack: list[list[Any]] = []
    for match in _JSON_TOKEN.finditer(text):
        if size > limit or judged > MAX_JUDGED_CHARS:
            return _View("".join(out), "".join(decoded) if escapes else None, masked, text[match.start():], hidden,
                         credentials)
        token = match.group()
        first = token[0]
        frame = stack[-1] if stack else None
        is_key = frame is not None and frame[0] and frame[2]
        secret = frame is not None and (frame[3] if frame[0] else frame[1])
        # a value masked without being listed: the secret-named key's own value, a credential
        credential = frame is not None and frame[0] and frame[3] and not frame[1]
        shown = plain = token
        if first == "{" or first == "[":
            stack.append([first == "{", secret, first == "{", False, "", 0])
        elif first == "}" or first == "]":
            if stack:
                stack.pop()
        elif first == ":" or first == ",":
            if frame is not None and frame[0]:
                frame[2] = first == ","
            elif frame is not None and first == ",":
                frame[5] += 1
        elif first == '"':
            value = json_unescaped(token[1:-1]) if "\\" in token else token[1:-1]
            if is_key:
                assert frame is not None
                frame[3] = frame[1] or SECRET_NAME.search(value) is not None
                secret = frame[1] and not is_plain_key(value)
            named = value
            if secret:
                shown = plain = f'"{MASK}"'
                named = MASK
                judged += min(len(value), _CREDENTIAL_CHARS) if credential and not is_key else 0
                if credential and not is_key and frame is not None and _credential_shaped(frame[4], value):
                    claims, repeated = _shown_secret(frame[4], value, repeats)
                    shown = plain = json.dumps(claims, ensure_ascii=False)
                    masked += repeated
                    credentials += 1
                elif not is_key:
                    hidden.append(_path(stack))
            elif (found := repeats(value)) is not None:
                shown = plain = json.dumps(found, ensure_ascii=False)
                named = found
                masked += 1
            elif "\\u" in token:
                escapes = True
                plain = json.dumps(value, ensure_ascii=False)
            if is_key:
                assert frame is not None
                frame[4] = named
        elif not first.isspace() and token not in _LITERALS:  # a number (or a stray character)
            if secret:  # a number is never read as a credential: an amount or account number may hide there
                shown = plain = MASK
                hidden.append(_path(stack))
            elif (found := repeats(token)) is not None:
                shown = plain = found
                masked += 1
        out.append(shown)
        decoded.append(plain)
        size += len(shown)
    return _View("".join(out), "".join(decoded) if escapes else None, masked, hidden=hidden, credentials=credentials)


def _form_view(text: str, repeats: _Repeats, limit: int) -> _View:
    """A urlencoded form's views, read field by field (``&``-separated, as the application splits it) up to
    ``limit`` characters of view and :data:`MAX_JUDGED_CHARS` of values read for a credential's shape: the value of
    a secret-named field shown as :data:`MASK` (its name listed in
    ``hidden`` unless the value reads as a credential, :func:`_credential_shaped`); any other name or value that
    holds a secret of the request (``repeats``) masked (written again percent-encoded) and counted; and when the form
    holds percent-encoding or ``+``, ``decoded``: each field on a line, ``"name": "value"``."""
    out: list[str] = []
    lines: list[str] = []
    hidden: list[str] = []
    encoded = False
    masked = 0
    size = judged = 0
    at = 0
    for piece in text.split("&"):
        if size > limit or judged > MAX_JUDGED_CHARS:
            return _View("&".join(out), "\n".join(lines) if encoded else None, masked, text[at:], hidden)
        at += len(piece) + 1
        encoded = encoded or "%" in piece or "+" in piece
        raw_name, equals, raw_value = piece.partition("=")
        name, value = unquote_plus(raw_name, errors="replace"), unquote_plus(raw_value, errors="replace")
        if raw_value and SECRET_NAME.search(name) is not None:
            judged += min(len(value), _CREDENTIAL_CHARS)
            if _credential_shaped(name, value):
                value, repeated = _shown_secret(name, value, repeats)
                raw_value = quote_plus(value, safe="[]")
                masked += repeated
                encoded = encoded or value != MASK  # a JWT's claims: shown decoded too
            else:
                hidden.append(json.dumps(name))
                raw_value = value = MASK
        elif (found := repeats(value)) is not None:
            raw_value, value = quote_plus(found, safe="[]"), found
            masked += 1
        if (found := repeats(name)) is not None:
            raw_name, name = quote_plus(found, safe="[]"), found
            masked += 1
        out.append(f"{raw_name}{equals}{raw_value}")
        if piece:
            lines.append(f"{json.dumps(name, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
        size += len(out[-1]) + 1
    return _View("&".join(out), "\n".join(lines) if encoded else None, masked, hidden=hidden)
