"""Compiled ``match`` blocks: cheap checks on method, path, host, headers, event and tool name (never the body)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import re2

from guard._json import is_json_media
from guard.policy._re2 import Pattern, compile_re2
from guard.policy.model import AgentMatchSpec, HttpMatchSpec, ResponseMatchSpec
from guard.subject import AgentSubject, HttpSubject

__all__ = ["TOOL_EVENTS", "AgentMatcher", "HttpMatcher", "ResponseMatcher", "compile_glob", "media_matches"]

#: A UTF-16 surrogate code point, which RE2 (UTF-8) cannot read: in a glob and in the text it is matched as U+FFFD.
_SURROGATE = re.compile("[\ud800-\udfff]")


#: Wildcard runs of a glob (``*``, ``**`` and what they touch): with two or more, a backtracking engine can take
#: time polynomial in the text (``/**/a/**/a/**/x``).
_WILD_RUN = re.compile(r"\*+")


def compile_glob(pattern: str, separator: str | None) -> Pattern:
    """Compile a glob: ``**`` matches anything, ``*`` anything but ``separator``, ``?`` one such character.

    Matching takes time linear in the text: a glob with two or more wildcard runs is compiled with RE2
    (:mod:`guard.policy._re2`; with Python's ``re``, ``/**/a/**/a/**/x`` backtracked for 9 s on a 4 KB path), one
    with at most one run, which cannot backtrack more than once per character, with Python's ``re`` (a call costs
    about a third of RE2's). Match with :func:`_fullmatch`.

    Args:
        pattern: the glob, e.g. ``/v1/*/chat/**``.
        separator: ``"/"`` for paths, ``"."`` for hosts, ``None`` when ``*`` may cross everything.

    Raises:
        ValueError: the glob is too large for RE2's memory budget (:data:`guard.policy._re2.MAX_MEM`).
    """
    return _either([pattern], separator)


def _either(globs: list[str], separator: str | None) -> Pattern | None:
    """One pattern that fully matches what any of ``globs`` fully matches (one call per request instead of one per
    glob; alternatives of at most one wildcard run each stay linear in ``re``); ``None`` for no globs, which means
    anything matches."""
    if not globs:
        return None
    globs = [_SURROGATE.sub("\ufffd", glob) for glob in globs]
    if all(len(_WILD_RUN.findall(glob)) <= 1 for glob in globs):
        return re.compile("(?s)" + "|".join(f"(?:{_glob_regex(glob, separator, re.escape)})" for glob in globs))
    return compile_re2("(?s)" + "|".join(f"(?:{_glob_regex(glob, separator, re2.escape)})" for glob in globs))


def _glob_regex(pattern: str, separator: str | None, escape: Callable[[str], str]) -> str:
    """The regular expression of the glob ``pattern`` (:func:`compile_glob`), for a pattern compiled with ``(?s)``,
    literal characters written with ``escape`` (``re.escape`` or ``re2.escape``)."""
    one = "." if separator is None else f"[^{escape(separator)}]"
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append(f"{one}*")
            i += 1
        elif pattern[i] == "?":
            out.append(one)
            i += 1
        else:
            out.append(escape(pattern[i]))
            i += 1
    return "".join(out)


def _fullmatch(pattern: Pattern, text: str) -> bool:
    """Whether ``text`` fully matches a compiled glob. RE2 reads UTF-8: the text is given as its UTF-8 bytes (the
    wrapper then skips mapping offsets back to characters: ~1 us a call instead of ~4 us), a lone surrogate in it,
    which UTF-8 cannot hold (a tool name decoded from JSON may), as U+FFFD, one character for one (as ``re`` reads
    it: one character)."""
    if isinstance(pattern, re.Pattern):
        return pattern.fullmatch(text) is not None
    try:
        encoded = text.encode()
    except UnicodeEncodeError:
        encoded = _SURROGATE.sub("\ufffd", text).encode()
    return pattern.fullmatch(encoded) is not None


def media_matches(media: str, wanted: frozenset[str]) -> bool:
    """Whether a media type (lower-case, without parameters; ``""`` for none) is one ``wanted`` lists (lower-case):
    the type itself, ``application/json`` for any ``+json`` type (guard parses those as JSON too), or a range
    holding it: ``text/*`` every ``text/`` type; ``*/*`` any media type and none (a body sent without a
    ``Content-Type``, which a browser sniffs and a JSON API may parse), as an empty list."""
    if "*/*" in wanted or media in wanted or (is_json_media(media) and "application/json" in wanted):
        return True
    kind, slash, _ = media.partition("/")
    return bool(kind and slash) and f"{kind}/*" in wanted


def _headers_match(
    patterns: tuple[tuple[str, Pattern], ...], headers: dict[str, str], repeated: tuple[str, ...] = ()
) -> bool:
    """Every named header is present and its value fully matches its glob, or is in ``repeated`` (sent more than
    once: its copies joined would match no glob, so the policy applies and refuses the request,
    :meth:`guard.policy.Policy.check_repeated`)."""
    for name, pattern in patterns:
        value = headers.get(name)
        if name in repeated:
            continue
        if value is None or not _fullmatch(pattern, value):
            return False
    return True


@dataclass(frozen=True)
class ResponseMatcher:
    """A compiled ``match.http.response`` block: status, headers and media type of the upstream's response."""

    status: frozenset[int]
    headers: tuple[tuple[str, Pattern], ...]
    content_types: frozenset[str]

    @classmethod
    def from_spec(cls, spec: ResponseMatchSpec) -> ResponseMatcher:
        return cls(
            status=frozenset(spec.status),
            headers=tuple((name.lower(), compile_glob(value, None)) for name, value in spec.headers.items()),
            content_types=frozenset(c.lower() for c in spec.content_types),
        )

    def matches(self, response: HttpSubject) -> bool:
        if self.status and response.status not in self.status:
            return False
        if self.content_types and not media_matches(response.content_type.lower(), self.content_types):
            return False
        return _headers_match(self.headers, response.headers)


#: Methods whose requests never stand for what a WebSocket message carries (no body, or one no message would be).
NON_MESSAGE_METHODS = frozenset({"HEAD", "OPTIONS", "TRACE", "CONNECT", "DELETE"})


def _with_head(methods: frozenset[str]) -> frozenset[str]:
    """``methods`` (upper-case) with HEAD added when they hold GET: servers answer a HEAD with the GET handler
    (Starlette, FastAPI, Flask, Rails and Express route it there; ``guard proxy`` forwards it), so a policy for GET
    that skipped HEAD would let the handler run on input it never judged."""
    return methods | {"HEAD"} if "GET" in methods else methods


@dataclass(frozen=True)
class HttpMatcher:
    """A compiled ``match.http`` block.

    ``methods`` holds HEAD wherever it holds GET (:func:`_with_head`). Paths are matched against the subject's
    canonical path (percent-decoded, dot segments removed, slashes merged: ``guard/asgi/_target.py``), the same path
    the application routes on and the proxy forwards. Hosts are matched against the client's ``Host`` header, which
    the client chooses (docs/http.md).

    With ``response`` set it belongs to a response policy: it never matches a request; it :meth:`watches` the
    requests its other conditions accept, and matches their responses on ``response`` alone.
    """

    methods: frozenset[str]
    paths: Pattern | None
    hosts: Pattern | None
    headers: tuple[tuple[str, Pattern], ...]
    content_types: frozenset[str]
    #: The globs as written (paths, hosts lower-cased, header name -> value glob), for ``guard policy check``'s
    #: overlap report (:mod:`guard.policy.overlap`).
    globs: tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, str], ...]] = field(default=((), (), ()))
    response: ResponseMatcher | None = None

    @classmethod
    def from_spec(cls, spec: HttpMatchSpec) -> HttpMatcher:
        headers = tuple((name.lower(), value) for name, value in spec.headers.items())
        return cls(
            methods=_with_head(frozenset(m.upper() for m in spec.methods)),
            paths=_either(spec.paths, "/"),
            hosts=_either([h.lower() for h in spec.hosts], "."),
            headers=tuple((name, compile_glob(value, None)) for name, value in headers),
            content_types=frozenset(c.lower() for c in spec.content_types),
            globs=(tuple(spec.paths), tuple(h.lower() for h in spec.hosts), headers),
            response=ResponseMatcher.from_spec(spec.response) if spec.response is not None else None,
        )

    def matches(self, subject: HttpSubject) -> bool:
        """A request: its conditions hold and this is not a response matcher; a response: ``response`` holds."""
        if subject.phase == "response":
            return self.response is not None and self.response.matches(subject)
        return self.response is None and self._request_matches(subject)

    def watches(self, request: HttpSubject) -> bool:
        """This is a response matcher and ``request``'s response is to be judged."""
        return self.response is not None and self._request_matches(request)

    def may_judge_messages(self, upgrade: HttpSubject) -> bool:
        """Whether requests this matcher accepts (or whose responses it watches) could carry what the WebSocket
        ``upgrade`` would: its path, host and headers hold, whatever the media type and ``Content-Type`` header (a
        message has neither), and the matcher names no method or one not in :data:`NON_MESSAGE_METHODS` (GET, POST,
        PUT, PATCH, or any other that may carry a body: QUERY, REPORT, ...)."""
        if self.methods and self.methods <= NON_MESSAGE_METHODS:
            return False
        if self.paths is not None and not _fullmatch(self.paths, upgrade.path):
            return False
        if self.hosts is not None and not _fullmatch(self.hosts, upgrade.host.lower()):
            return False
        return _headers_match(tuple(h for h in self.headers if h[0] != "content-type"), upgrade.headers,
                              upgrade.repeated_headers)

    def _request_matches(self, subject: HttpSubject) -> bool:
        if self.methods and subject.method.upper() not in self.methods:
            return False
        if self.content_types and not media_matches(subject.content_type.lower(), self.content_types):
            return False
        if self.paths is not None and not _fullmatch(self.paths, subject.path):
            return False
        if self.hosts is not None and not _fullmatch(self.hosts, subject.host.lower()):
            return False
        return _headers_match(self.headers, subject.headers, subject.repeated_headers)


#: The agent events that name a tool: a ``match.agent.tools`` list matches only these.
TOOL_EVENTS = frozenset({"tool_call", "tool_result"})


@dataclass(frozen=True)
class AgentMatcher:
    """A policy's ``match.agent``: the agent events it judges (empty = every event) and, for tool events, the tools
    (globs compiled into one pattern; ``None`` = every tool)."""

    events: frozenset[str]
    tools: Pattern | None
    #: The tool globs as written, for the overlap report.
    tool_globs: tuple[str, ...] = ()

    @classmethod
    def from_spec(cls, spec: AgentMatchSpec) -> AgentMatcher:
        return cls(
            events=frozenset(spec.events),
            tools=_either(spec.tools, None),
            tool_globs=tuple(spec.tools),
        )

    def matches(self, subject: AgentSubject) -> bool:
        if self.events and subject.event not in self.events:
            return False
        if self.tools is None:
            return True
        return subject.tool_name is not None and _fullmatch(self.tools, subject.tool_name)
