"""Rules read raw values: a look-alike of "admin" does not equal "admin" in a rule, and the explicit ``confusable()``
/ ``skeleton()`` functions (UTS #39 skeleton over the shipped confusables data) match it when a rule asks."""

from __future__ import annotations

import hashlib
import re
from importlib.resources import files

import pytest

from guard.policy.loader import load_text
from guard.policy.rules import RuleError, apply_rules
from guard.policy.skeleton import CONFUSABLES_FILE, confusable, skeleton, unicode_version
from guard.subject import HttpSubject
from guard.systemone import AnswerV1

#: The four look-alikes of the finding: Cyrillic а, full-width, mathematical bold, a zero-width space inside.
LOOK_ALIKES = {
    "cyrillic": "\u0430dmin",
    "fullwidth": "\uff41\uff44\uff4d\uff49\uff4e",
    "math_bold": "\U0001d41a\U0001d41d\U0001d426\U0001d422\U0001d427",
    "zero_width": "ad\u200bmin",
}

POLICY = """
policies:
  - id: p
    version: 1
    match: {http: {paths: ["/**"]}}
    state: {user: body:/user}
    questions: {injection: {catalog: guard.prompt_injection}}
    rules:
      - {id: RULE_ID, when: 'RULE', action: block}
    default: allow
"""


def _decide(rule: str, user: str) -> str:
    policy = load_text(POLICY.replace("RULE_ID", "r").replace("RULE", rule))[0]
    subject = HttpSubject(method="POST", path="/x", body={"user": user})
    raw = policy.render_state(subject)
    answers = {"injection": AnswerV1("injection", "noul", {"true": 0.1, "false": 0.9}, noul=0.1)}
    result = apply_rules(policy.id, policy.rules, policy.default, answers, subject=subject, state=raw)
    return result.rule


@pytest.mark.parametrize("user", LOOK_ALIKES.values(), ids=LOOK_ALIKES.keys())
def test_a_look_alike_does_not_equal_the_name_but_is_confusable_with_it(user: str) -> None:
    assert _decide('state.user == "admin"', user) == "default"  # compared as received
    assert _decide('confusable(state.user, "admin")', user) == "r"
    assert _decide('skeleton(state.user) == skeleton("admin")', user) == "r"
    assert _decide('state.user.skeleton() == "admin".skeleton()', user) == "r"
    assert confusable(user, "admin") and skeleton(user) == skeleton("admin") != user


def test_the_name_itself_still_matches_and_other_names_are_not_confusable() -> None:
    assert _decide('state.user == "admin"', "admin") == "r"
    for other in ("alice", "Admin", "admins", "\u0430d\u043cin"):  # case kept; Cyrillic м is not Latin m
        assert _decide('confusable(state.user, "admin")', other) == "default", other
    assert _decide('confusable(state.user, "admin")', "adrnin") == "r"  # rn looks like m: UTS #39 says so


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("paypal", "paypal"),
        ("p\u0430yp\u0430l", "paypal"),  # Cyrillic а
        ("\u0440aypal", "paypal"),  # Cyrillic р
        ("PAYPAL", "PAYPAL"),
        ("\u0420\u0410YPAL", "PAYPAL"),  # Cyrillic Р, А
        ("g\u043e\u043egle", "google"),  # Cyrillic о
        ("\u24d0\u24d3\u24dc\u24d8\u24dd", "adrnin"),  # circled letters: NFKC first
        ("caf\u00e9", "cafe\u0301"),  # NFD: accents kept as combining marks
        ("i\u0307", "i\u0307"),
        ("a\u00adb\u2060c\ufe0fd\U000e0041", "abcd"),  # default-ignorable characters removed
        ("l0l1", "lOll"),  # ASCII digits that look like letters
    ],
)
def test_skeleton_follows_uts39(text: str, expected: str) -> None:
    assert skeleton(text) == expected
    assert skeleton(skeleton(text)) == skeleton(text)  # idempotent on its own output


def test_a_non_string_is_a_rule_error() -> None:
    policy = load_text(POLICY.replace("RULE_ID", "r").replace("RULE", 'confusable(state.user, "admin")'))[0]
    with pytest.raises(RuleError, match="r"):
        apply_rules(policy.id, policy.rules, policy.default, {}, state={"user": 42})


def test_the_shipped_data_is_the_unicode_file_with_its_licence() -> None:
    data = files("guard.policy").joinpath(CONFUSABLES_FILE).read_bytes()
    readme = files("guard.policy").joinpath("data/README.md").read_text(encoding="utf-8")
    version = unicode_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert f"version {version}" in readme and hashlib.sha256(data).hexdigest() in readme
    assert b"Unicode Security Mechanisms for UTS #39" in data
    rows = [line for line in data.decode("utf-8-sig").splitlines() if re.match(r"[0-9A-F]{4,6} ;", line)]
    assert f"# total: {len(rows)}".encode() in data
    licence = files("guard.policy").joinpath("data/LICENSE-Unicode").read_text(encoding="utf-8")
    assert licence.startswith("UNICODE LICENSE V3")
