"""Which policies can match the same subject (``guard policy check`` lists them: every matching policy decides, so
an overlap is where verdicts combine, ``docs/policies.md``).

Two ``match`` blocks overlap when some subject passes both: the HTTP methods, content types, path and host globs and
required headers all admit a common request, or the agent events and tool globs a common event. Glob against glob is
decided exactly (:func:`globs_intersect`: is there a string both match), not by sampling. Under
``GuardMiddleware(path_case="fold", trailing_slash="strip")`` (the defaults) a request is matched on its path
lower-cased and without a trailing slash and on its path as sent, so a path glob also meets another when it meets
that one lower-cased and without its trailing ``/`` (``/v1/**`` and ``/V1/Admin/**`` both judge
``/V1/Admin/users``; ``/v1/items`` and ``/v1/items/`` both judge ``/v1/items/``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

from guard._json import is_json_media
from guard.policy._match import TOOL_EVENTS, AgentMatcher, HttpMatcher, ResponseMatcher
from guard.policy.policy import Policy

__all__ = ["globs_intersect", "overlapping_pairs", "overlaps"]

_ANY = "**"  # any run of characters
_RUN = "*"  # any run of characters other than the separator
_ONE = "?"  # one character other than the separator
_STARS = (_ANY, _RUN)


def _tokens(glob: str, separator: str | None) -> tuple[str, ...]:
    """``glob`` as tokens: :data:`_ANY`, :data:`_RUN`, :data:`_ONE` or a one-character literal (as
    :func:`guard.policy._match.compile_glob` reads it; without a separator ``*`` crosses everything)."""
    out: list[str] = []
    i = 0
    while i < len(glob):
        if glob.startswith("**", i):
            out.append(_ANY)
            i += 2
        elif glob[i] == "*":
            out.append(_ANY if separator is None else _RUN)
            i += 1
        else:
            out.append(glob[i])
            i += 1
    return tuple(out)


def globs_intersect(a: str, b: str, separator: str | None) -> bool:
    """Whether some string fully matches both globs (``**`` anything, ``*`` anything but ``separator``, ``?`` one
    such character; ``separator`` ``None``: ``*`` and ``?`` cross everything)."""
    x, y = _tokens(a, separator), _tokens(b, separator)

    def single_fits(star: str, token: str) -> bool:  # can ``star`` eat one character ``token`` stands for
        return star == _ANY or token == _ONE or token != separator

    def singles_meet(s: str, t: str) -> bool:  # is there one character both stand for
        if s == _ONE or t == _ONE:
            other = t if s == _ONE else s
            return other == _ONE or other != separator
        return s == t

    # A search over (i, j), the tokens of x and y consumed so far: both globs spent means a common string exists.
    # Depth-first with a stack and the states seen, so long globs need no recursion and each state is left once.
    n, m = len(x), len(y)
    todo, seen = [(0, 0)], set()
    while todo:
        i, j = todo.pop()
        if i == n and j == m:
            return True
        if (i, j) in seen:
            continue
        seen.add((i, j))
        s = x[i] if i < n else None
        t = y[j] if j < m else None
        # A star may match nothing; when both are stars, skipping the one that matches less is enough.
        if s in _STARS:
            todo.append((i + 1, j))
        if t in _STARS:
            todo.append((i, j + 1))
        if s is None or t is None or (s in _STARS and t in _STARS):
            continue
        if s in _STARS:
            if single_fits(s, t):  # the star eats t's character
                todo.append((i, j + 1))
        elif t in _STARS:
            if single_fits(t, s):
                todo.append((i + 1, j))
        elif singles_meet(s, t):
            todo.append((i + 1, j + 1))
    return False


def _lists_meet(a: Sequence[str], b: Sequence[str], separator: str | None) -> bool:
    """Two glob lists (empty = anything) admit a common string."""
    return not a or not b or any(globs_intersect(p, q, separator) for p in a for q in b)


def _media_meet(a: frozenset[str], b: frozenset[str]) -> bool:
    """Two ``content_types`` lists (empty = any) admit a common media type (as
    :func:`guard.policy._match.media_matches` reads them)."""
    return not a or not b or any(_media_types_meet(x, y) for x in a for y in b)


def _media_types_meet(x: str, y: str) -> bool:
    """Some media type matches both entries: types or ranges (``text/*``, ``*/*``)."""
    if x == y or "*/*" in (x, y):
        return True
    (kind_x, sub_x), (kind_y, sub_y) = x.split("/", 1), y.split("/", 1)
    if "*" in (sub_x, sub_y):  # every range holds +json types (text/x+json), which application/json matches too
        return kind_x == kind_y or "application/json" in (x, y)
    # "application/json" also matches every +json type (guard parses those as JSON)
    return (x == "application/json" and is_json_media(y)) or (y == "application/json" and is_json_media(x))


def _paths_meet(a: Sequence[str], b: Sequence[str], fold_case: bool, strip_slash: bool) -> bool:
    """Two path glob lists admit a common request: some path both match as sent, or one list matches the path as
    sent and the other its view (with ``fold_case`` lower-cased, with ``strip_slash`` without a trailing slash). A
    path ``p`` with view ``v`` is judged by ``A`` as sent and ``B`` by its view when ``A`` lower-cased (``p``'s
    folded form) meets ``B`` (``v == p`` lower-cased) or, ``p`` being ``s + "/"`` and ``v`` ``s`` lower-cased,
    meets ``B`` + ``"/"`` (``/v1/items/**`` and ``/v1/items`` judge ``POST /v1/items/``)."""
    if _lists_meet(a, b, "/"):
        return True
    for sent, viewed in ((a, b), (b, a)):
        folded = [glob.lower() for glob in sent] if fold_case else sent
        if fold_case and _lists_meet(folded, viewed, "/"):
            return True
        if strip_slash and _lists_meet(folded, [glob + "/" for glob in viewed], "/"):
            return True
    return False


def _http_overlap(a: HttpMatcher, b: HttpMatcher, fold_case: bool, strip_slash: bool) -> bool:
    if (a.response is None) != (b.response is None):
        return False  # a request policy and a response policy never judge one subject
    if a.response is not None and b.response is not None and not _responses_meet(a.response, b.response):
        return False
    if a.methods and b.methods and not a.methods & b.methods:
        return False
    if not _media_meet(a.content_types, b.content_types):
        return False
    paths_a, hosts_a, headers_a = a.globs
    paths_b, hosts_b, headers_b = b.globs
    if not _paths_meet(paths_a, paths_b, fold_case, strip_slash) or not _lists_meet(hosts_a, hosts_b, "."):
        return False
    wanted = dict(headers_b)
    return all(globs_intersect(value, wanted[name], None) for name, value in headers_a if name in wanted)


def _responses_meet(a: ResponseMatcher, b: ResponseMatcher) -> bool:
    """Some response has a status and a media type both accept (headers are not compared: they rarely exclude)."""
    if a.status and b.status and not a.status & b.status:
        return False
    return _media_meet(a.content_types, b.content_types)


def _agent_overlap(a: AgentMatcher, b: AgentMatcher) -> bool:
    events = (a.events or None, b.events or None)
    common = set.intersection(*(set(e) for e in events if e is not None)) if any(events) else None
    if common is not None and not common:
        return False
    if not a.tool_globs and not b.tool_globs:
        return True
    if common is not None and not common & TOOL_EVENTS:
        return False  # a tool list never matches events without a tool
    return _lists_meet(a.tool_globs, b.tool_globs, None)


def overlaps(a: Policy, b: Policy, *, fold_case: bool = True, strip_slash: bool = True) -> list[str]:
    """The kinds of subject (``"http"``, ``"agent"``) that both policies can match; empty when none. ``fold_case``:
    requests are matched on their lower-cased path too (``GuardMiddleware(path_case="fold")``, the default);
    ``strip_slash``: on their path without a trailing slash too (``trailing_slash="strip"``, the default)."""
    kinds = []
    if a.http is not None and b.http is not None and _http_overlap(a.http, b.http, fold_case, strip_slash):
        kinds.append("http")
    if a.agent is not None and b.agent is not None and _agent_overlap(a.agent, b.agent):
        kinds.append("agent")
    return kinds


def overlapping_pairs(
    policies: Sequence[Policy], *, fold_case: bool = True, strip_slash: bool = True
) -> list[tuple[Policy, Policy, list[str]]]:
    """Every pair of ``policies`` (in order) that can match a common subject, with the kinds of subject
    (``fold_case``, ``strip_slash``: as :func:`overlaps`). Only the pairs :class:`_Index` finds near each other are
    compared, so a file of many policies on distinct paths (under one ``/api/v1/`` too) or tools is not compared pair
    by pair."""
    kinds = [_Kind([i for i, p in enumerate(policies) if p.http is not None], policies, _HTTP_KEYS),
             _Kind([i for i, p in enumerate(policies) if p.agent is not None], policies, _AGENT_KEYS)]
    out = []
    for i, a in enumerate(policies):
        for j in sorted(set().union(*(kind.near(i) for kind in kinds))):
            found = overlaps(a, policies[j], fold_case=fold_case, strip_slash=strip_slash)
            if found:
                out.append((a, policies[j], found))
    return out


#: An item's keys (each a sequence: a path's literal segments, a tool name's literal characters, one method), or
#: ``None``: any.
Keys = frozenset[Sequence[Hashable]] | None


def _literal_segments(glob: str) -> tuple[str, ...] | None:
    """The segments of the path glob ``glob`` before the first that holds a wildcard (all of them when none does),
    lower-cased: every path the glob matches, as sent, lower-cased or with a ``/`` added (the views
    :func:`_paths_meet` compares) starts with them, lower-cased; ``None`` when ``glob`` does not start with ``/``."""
    if not glob.startswith("/"):
        return None
    segments = glob[1:].split("/")
    literal = next((n for n, segment in enumerate(segments) if "*" in segment or "?" in segment), len(segments))
    return tuple(segment.lower() for segment in segments[:literal])


def _literal_head(glob: str) -> str:
    """The tool glob ``glob`` up to its first wildcard: every tool name it matches starts with it."""
    return glob[: next((n for n, char in enumerate(glob) if char in "*?"), len(glob))]


def _keys(values: Iterable[Sequence[Hashable] | None]) -> Keys:
    """``values`` as keys; ``None`` (any) when there are none (an empty list matches anything) or one is ``None``."""
    keys = frozenset(values)
    return None if not keys or None in keys else keys  # type: ignore[return-value]


#: What two policies must share for their ``match.http`` to meet (each is checked by :func:`_http_overlap` too): a
#: method, a request or response side, and path globs whose literal segments, one's a prefix of the other's.
_HTTP_KEYS: tuple[Callable[[Policy], Keys], ...] = (
    lambda p: _keys((method,) for method in p.http.methods),  # type: ignore[union-attr]
    lambda p: frozenset({(p.http.response is None,)}),  # type: ignore[union-attr]
    lambda p: _keys(map(_literal_segments, p.http.globs[0])),  # type: ignore[union-attr]
)
#: What two policies must share for their ``match.agent`` to meet (:func:`_agent_overlap`): an event, and tool globs
#: whose literal heads, one's a prefix of the other's.
_AGENT_KEYS: tuple[Callable[[Policy], Keys], ...] = (
    lambda p: _keys((event,) for event in p.agent.events),  # type: ignore[union-attr]
    lambda p: _keys(map(_literal_head, p.agent.tool_globs)),  # type: ignore[union-attr]
)


class _Node:
    """A trie node: the items with a key ending here (``ends``) and with a key through here or below (``below``)."""

    def __init__(self) -> None:
        self.children: dict[Hashable, _Node] = {}
        self.ends: set[int] = set()
        self.below: set[int] = set()


class _Index:
    """The items with a key that is a prefix of one of an item's keys or that has one of them as a prefix (one-part
    keys: an equal key), by a trie of the keys; an item without keys (``None``: any) is near every item."""

    def __init__(self, keys: Sequence[Keys]) -> None:
        self.keys = keys
        self.anywhere = {i for i, item in enumerate(keys) if item is None}
        self.root = _Node()
        for i, item in enumerate(keys):
            for key in item or ():
                node = self.root
                node.below.add(i)
                for part in key:
                    node = node.children.setdefault(part, _Node())
                    node.below.add(i)
                node.ends.add(i)

    def near(self, i: int) -> set[int] | None:
        """The items near item ``i``; ``None``: every item (``i`` has no keys)."""
        item = self.keys[i]
        if item is None:
            return None
        found = set(self.anywhere)
        for key in item:
            node = self.root
            for part in key:
                found |= node.ends  # a key that is a prefix of this one
                node = node.children[part]
            found |= node.below  # a key that this one is a prefix of, itself included
        return found


class _Kind:
    """The policies with one kind of ``match`` block (their indices in ``members``), indexed by each of ``keys``."""

    def __init__(self, members: list[int], policies: Sequence[Policy], keys: Sequence[Callable[[Policy], Keys]]) -> None:
        self.members = members
        self.position = {i: pos for pos, i in enumerate(members)}
        self.indexes = [_Index([key(policies[i]) for i in members]) for key in keys]

    def near(self, i: int) -> set[int]:
        """The indices after ``i`` of the policies near policy ``i`` in every index (none when it is not a member):
        the only ones whose block of this kind can meet its own."""
        pos = self.position.get(i)
        if pos is None:
            return set()
        found = [near for index in self.indexes if (near := index.near(pos)) is not None]
        shared = set.intersection(*found) if found else range(len(self.members))
        return {self.members[q] for q in shared if q > pos}
