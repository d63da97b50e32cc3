"""Which policies can match one subject (``guard policy check`` lists them): glob against glob decided exactly,
methods, content types, headers, agent events and tools."""

from __future__ import annotations

import pytest

from guard.policy import load_text
from guard.policy.overlap import globs_intersect, overlapping_pairs, overlaps


@pytest.mark.parametrize(
    ("a", "b", "meet"),
    [
        ("/v1/**", "/v1/chat/*", True),
        ("/v1/*", "/v1/chat/completions", False),  # * stays within a segment
        ("/v1/**", "/api/**", False),
        ("/v1/*/items", "/v1/users/*", True),  # /v1/users/items
        ("/v?/chat", "/v1/*", True),
        ("/v?/chat", "/v/chat", False),
        ("/a*b", "/*c", False),
        ("/**/x", "/v1/**", True),
        ("/*", "/**/deep/**", False),
        ("**", "", True),
    ],
)
def test_path_globs_meet_when_some_path_matches_both(a: str, b: str, meet: bool) -> None:
    assert globs_intersect(a, b, "/") is meet
    assert globs_intersect(b, a, "/") is meet


def test_host_and_header_globs() -> None:
    assert globs_intersect("*.example.com", "api.example.com", ".")
    assert not globs_intersect("*.example.com", "a.b.example.com", ".")
    assert globs_intersect("Bearer *", "*xyz", None) and not globs_intersect("a*", "b*", None)


def _policy(match: str, pid: str) -> str:
    return f"""
  - id: {pid}
    version: 1
    match: {match}
    questions: {{q: {{type: noul, instructions: "?"}}}}"""


@pytest.mark.parametrize(
    ("a", "b", "kinds"),
    [
        ("{http: {methods: [POST]}}", "{http: {paths: ['/v1/**']}}", ["http"]),
        ("{http: {methods: [POST]}}", "{http: {methods: [GET]}}", []),
        ("{http: {content_types: [application/json]}}", "{http: {content_types: [application/vnd.api+json]}}",
         ["http"]),
        ("{http: {content_types: [text/plain]}}", "{http: {content_types: [application/json]}}", []),
        ("{http: {headers: {x-tier: free}}}", "{http: {headers: {x-tier: paid}}}", []),
        ("{http: {headers: {x-tier: free}}}", "{http: {headers: {x-user: '*'}}}", ["http"]),
        ("{http: {hosts: ['*.a.com']}}", "{http: {hosts: [b.com]}}", []),
        ("{agent: {tools: ['fs_*']}}", "{agent: {tools: [fs_write, shell]}}", ["agent"]),
        ("{agent: {tools: ['fs_*']}}", "{agent: {tools: [shell]}}", []),
        ("{agent: {events: [model_output]}}", "{agent: {tools: [shell]}}", []),  # no tool on model output
        ("{agent: {events: [tool_call]}}", "{agent: {events: [tool_result]}}", []),
        ("{agent: {}}", "{agent: {events: [tool_call], tools: [shell]}}", ["agent"]),
        ("{http: {}, agent: {}}", "{agent: {events: [model_input]}}", ["agent"]),
        ("{http: {}}", "{agent: {}}", []),
        ("{http: {paths: ['/v1/**']}}", "{http: {response: {status: [200]}}}", []),  # a request vs its response
        ("{http: {response: {status: [200]}}}", "{http: {paths: ['/v1/**'], response: {}}}", ["http"]),
        ("{http: {response: {status: [200]}}}", "{http: {response: {status: [500]}}}", []),
        ("{http: {response: {content_types: [text/plain]}}}", "{http: {response: {content_types: [application/json]}}}",
         []),
        # media ranges: every type a range holds, and the +json types application/json matches
        ("{http: {content_types: [application/*]}}", "{http: {content_types: [application/xml]}}", ["http"]),
        ("{http: {content_types: [application/*]}}", "{http: {content_types: [text/plain]}}", []),
        ("{http: {content_types: ['*/*']}}", "{http: {content_types: [image/png]}}", ["http"]),
        ("{http: {content_types: [text/*]}}", "{http: {content_types: [text/*, image/png]}}", ["http"]),
        ("{http: {content_types: [text/*]}}", "{http: {content_types: [image/*]}}", []),
        ("{http: {content_types: [text/*]}}", "{http: {content_types: [application/json]}}", ["http"]),  # text/x+json
        ("{http: {content_types: [text/*]}}", "{http: {content_types: [application/xml]}}", []),
        ("{http: {response: {content_types: [text/*]}}}", "{http: {response: {content_types: [text/event-stream]}}}",
         ["http"]),
    ],
)  # fmt: skip
def test_policies_overlap_when_one_subject_can_match_both(a: str, b: str, kinds: list[str]) -> None:
    first, second = load_text("policies:" + _policy(a, "a") + _policy(b, "b"))
    assert overlaps(first, second) == kinds == overlaps(second, first)
    assert [(x.id, y.id) for x, y, _ in overlapping_pairs([first, second])] == ([("a", "b")] if kinds else [])


def test_path_globs_that_differ_in_case_overlap_where_paths_are_folded() -> None:
    """Under ``path_case="fold"`` (the default) ``POST /V1/Admin/users`` is judged by ``/v1/**`` (its lower-cased
    path) and ``/V1/Admin/**`` (as sent): both decide, and ``guard policy check`` listed no overlap."""
    allow, lockdown = load_text("policies:" + _policy("{http: {paths: ['/v1/**']}}", "a")
                                + _policy("{http: {methods: [POST], paths: ['/V1/Admin/**']}}", "b"))
    assert overlaps(allow, lockdown) == ["http"] == overlaps(lockdown, allow)
    assert overlaps(allow, lockdown, fold_case=False) == []
    other, = load_text("policies:" + _policy("{http: {paths: ['/V2/**']}}", "c"))
    assert overlaps(allow, other) == []


def test_a_path_glob_with_a_trailing_slash_overlaps_the_one_without() -> None:
    """``POST /v1/items/`` is judged by ``/v1/items`` (its view without the trailing slash) and ``/v1/items/`` (as
    sent): both decide, and ``guard policy check`` listed no overlap."""
    slash, bare, folded, other = load_text("policies:" + _policy("{http: {paths: ['/v1/items/']}}", "a")
                                           + _policy("{http: {methods: [POST], paths: ['/v1/items']}}", "b")
                                           + _policy("{http: {paths: ['/V1/Items/']}}", "c")
                                           + _policy("{http: {paths: ['/v1/other/', '/']}}", "d"))
    assert overlaps(slash, bare) == ["http"] == overlaps(bare, slash)
    assert overlaps(folded, bare) == ["http"] and overlaps(folded, bare, fold_case=False) == []
    assert overlaps(slash, bare, strip_slash=False) == []
    assert overlaps(other, bare) == []


@pytest.mark.parametrize("glob", ["/v1/items/**", "/v1/items/*", "/V1/Items/**"])
def test_a_glob_matching_a_path_with_a_trailing_slash_overlaps_the_glob_of_its_view(glob: str) -> None:
    """``POST /v1/items/`` is matched by ``/v1/items/**`` (or ``/v1/items/*``) as sent and by ``/v1/items`` through
    its view: only a glob ending in a literal ``/`` was read as matching such paths, and no overlap was listed."""
    wide, bare, other = load_text("policies:" + _policy(f"{{http: {{paths: ['{glob}']}}}}", "a")
                                  + _policy("{http: {methods: [POST], paths: ['/v1/items']}}", "b")
                                  + _policy("{http: {paths: ['/v1/other']}}", "c"))
    assert overlaps(wide, bare) == ["http"] == overlaps(bare, wide)
    assert overlaps(wide, bare, strip_slash=False) == [] and overlaps(wide, other) == []
    if glob != glob.lower():
        assert overlaps(wide, bare, fold_case=False) == []


def test_long_globs_are_compared_without_recursion() -> None:
    """The comparison recursed once per token, so two valid ~520-character path globs ended ``guard policy check``
    in a RecursionError."""
    long = "/" + "a" * 700  # tokens of both globs past the default recursion limit (1000)
    assert globs_intersect(long, long, "/") and globs_intersect(long + "*", "/**", "/")
    assert not globs_intersect(long, long + "b", "/") and not globs_intersect(long + "/*", long + "/x/y", "/")
    assert globs_intersect("*" * 700 + "x", "?" * 700 + "x", None)


def test_the_overlap_report_compares_only_pairs_that_share_a_method_event_and_first_segment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every pair was compared: 2000 policies on distinct paths took 299 s in ``guard policy check``. The pairs left
    out are the ones that cannot meet, so the report is the one comparing every pair."""
    import random

    from guard.policy import overlap

    paths = ["/v1/**", "/V1/admin", "/v1/", "/v2/*", "/**", "/*/x", "/v?/y", "/", "/api", "/API/**", "/v1*",
             "/api/v1/**", "/api/V1/x", "/api/v1", "/api/v1/", "/api/v2*", "/api/*/x", "/Api/v1/x/**"]
    tools = ["fs_*", "fs_write", "FS_write", "*", "sh?ll", "shell", "fs", "**"]
    draw = random.Random(7)

    def some(values: list[str]) -> list[str]:
        return draw.sample(values, draw.randint(0, 2))

    match = [f"{{http: {{methods: {some(['GET', 'POST', 'PUT'])}, paths: {some(paths)}}}}}" for _ in range(80)]
    match += [f"{{agent: {{events: {some(['tool_call', 'tool_result', 'model_input'])}, tools: {some(tools)}}}}}"
              for _ in range(40)]
    match += ["{http: {response: {status: [200]}}}", "{http: {paths: ['/v1/**']}, agent: {}}"]
    policies = load_text("policies:" + "".join(_policy(m, f"p{i}") for i, m in enumerate(match)))
    every_pair = [(a, b, kinds) for i, a in enumerate(policies) for b in policies[i + 1 :]
                  if (kinds := overlaps(a, b))]
    assert overlapping_pairs(policies) == every_pair and len(every_pair) > 100

    compared = []
    monkeypatch.setattr(overlap, "overlaps", lambda a, b, **options: compared.append(a) or overlaps(a, b, **options))
    distinct = load_text("policies:" + "".join(_policy(f"{{http: {{paths: ['/v{i}/**']}}}}", f"p{i}")
                                               for i in range(300)))
    assert overlapping_pairs(distinct) == [] and compared == []  # no two share a first segment


def test_the_overlap_report_compares_only_policies_whose_literal_path_or_tool_prefixes_meet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only the first path segment was compared, so policies under one API prefix (``/api/r{i}/**``: 600 took 17 s)
    and agent policies told apart by their tools only were still compared pair by pair."""
    from guard.policy import overlap

    compared = []
    monkeypatch.setattr(overlap, "overlaps", lambda a, b, **options: compared.append(a) or overlaps(a, b, **options))
    match = [f"{{http: {{methods: [POST], paths: ['/api/v1/r{i}/**', '/API/v1/r{i}']}}}}" for i in range(100)]
    match += [f"{{agent: {{events: [tool_call], tools: ['t{i}_*', 'x{i}_?']}}}}" for i in range(100)]
    distinct = load_text("policies:" + "".join(_policy(m, f"p{i}") for i, m in enumerate(match)))
    assert overlapping_pairs(distinct) == [] and compared == []
    shared = load_text("policies:" + "".join(_policy(m, f"p{i}") for i, m in enumerate(
        ["{http: {paths: ['/api/v1/r1/**']}}", "{http: {paths: ['/API/V1/R1/x']}}", "{http: {paths: ['/api/*/r2']}}",
         "{agent: {tools: ['t1_*']}}", "{agent: {tools: ['t1_x', 't3']}}", "{agent: {tools: ['t2*']}}"])))
    assert [(a.id, b.id) for a, b, _ in overlapping_pairs(shared)] == [("p0", "p1"), ("p3", "p4")]
    assert len(compared) == 4  # p0 with p1 and p2 (a wildcard second segment), p1 with p2, p3 with p4
