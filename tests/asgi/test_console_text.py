"""The review console's text escaping, run in Node (no browser needed): state text shows invisible and format
characters as escapes, the same characters the held body's view escapes (``guard._readable.INVISIBLE``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from importlib import resources

import pytest

from guard._readable import INVISIBLE

NODE = shutil.which("node") or shutil.which("nodejs")
pytestmark = pytest.mark.skipif(NODE is None, reason="needs node")


def _run(script: str) -> str:
    page = resources.files("guard.asgi").joinpath("console.html").read_text(encoding="utf-8")
    functions = re.search(r"^const INVISIBLE = .*?^function pretty\(value\) \{.*?^\}$", page, re.DOTALL | re.MULTILINE)
    assert functions is not None
    assert NODE is not None
    return subprocess.run([NODE, "-e", functions.group(0) + "\n" + script], capture_output=True, text=True,
                          check=True, timeout=60).stdout


def test_state_text_shows_bidi_and_zero_width_characters_as_escapes() -> None:
    state = {"tool": "delete_file", "args": {"path": "/srv/reports/\u202efdp.exe", "tag": "a\u200bb\U000e0041"}}
    shown = _run(f"process.stdout.write(pretty({json.dumps(state)}) + '\\n' + pretty('x\\u2066y'));")
    assert "/srv/reports/\\u202efdp.exe" in shown and "a\\u200bb\\U000e0041" in shown
    assert shown.endswith("x\\u2066y")
    assert not INVISIBLE.search(shown)


def test_the_console_escapes_the_characters_the_body_view_escapes() -> None:
    matched = _run("const out = []; for (let n = 0; n <= 0x10ffff; n++) { if (n >= 0xd800 && n <= 0xdfff) continue;"
                   " INVISIBLE.lastIndex = 0; if (INVISIBLE.test(String.fromCodePoint(n))) out.push(n); }"
                   " process.stdout.write(JSON.stringify(out));")
    expected = [n for n in range(0x110000) if not 0xD800 <= n <= 0xDFFF and INVISIBLE.fullmatch(chr(n))]
    assert json.loads(matched) == expected
