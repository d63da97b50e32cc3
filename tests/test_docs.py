"""The docs stay true: marked shell blocks in ``docs/*.md``, ``README.md`` and ``examples/*/README.md`` run and exit 0,
relative links point somewhere real, and every ``bench/`` script answers ``--help``.

Convention (an HTML comment on the line right before a fenced block; invisible when rendered):

* ``<!-- doc-test -->`` before a `````bash`` block: the block runs with ``bash -euo pipefail`` and must exit 0. Mark
  only commands that finish in seconds without network, GPU or downloaded weights (the tiny checkpoint in
  ``tests/fixtures/clef-golden`` is fine).
* ``<!-- doc-test: write PATH -->`` before any fenced block: its text is saved to ``PATH`` first, so a page can show a
  file (a policy, a subject) and then run commands on it.

The blocks of one page run in page order, in one scratch directory that mirrors the repository's own top-level
entries (a symlink to each entry git tracks), so commands use the same relative paths as in a clone, files they create
vanish afterwards, and files a reader saved at the root while following a page (``my-policies/``) neither show
through nor block the page's own ``write`` blocks. ``guard`` on ``PATH`` runs this checkout (``python -m guard``)
whether or not the package is installed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from guard.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
EXAMPLES = sorted((ROOT / "examples").glob("*/README.md"))
LINKED = [*DOCS, ROOT / "README.md", *EXAMPLES]
BENCH = sorted((ROOT / "bench").glob("*.py"))
#: Seconds one marked block may take (``guard decide`` on the tiny checkpoint loads torch and transformers).
BLOCK_TIMEOUT_S = 180

_MARKER = re.compile(r"^<!--\s*doc-test(?::\s*write\s+(?P<path>\S+))?\s*-->\s*$")
_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    """One marked fenced block: ``write`` is the path to save it to, or ``None`` to run it (bash)."""

    doc: Path
    line: int
    info: str
    text: str
    write: str | None

    def where(self) -> str:
        return f"{_rel(self.doc)}:{self.line}"


def _rel(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def _fenced_blocks(lines: list[str]) -> list[tuple[int, int, str, str]]:
    """``(opening line index, closing line index, info string, text)`` for every fenced block."""
    blocks = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i].strip())
        if opening is None:
            i += 1
            continue
        fence = opening.group("fence")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)
                    and lines[j].strip().strip(fence[0]) == ""), len(lines))  # fmt: skip
        blocks.append((i, end, opening.group("info").strip(), "".join(f"{line}\n" for line in lines[i + 1 : end])))
        i = end + 1
    return blocks


def marked_blocks(doc: Path) -> list[Block]:
    """The blocks of ``doc`` that carry a doc-test marker, in page order.

    Raises:
        ValueError: for a marker that is not right before a fenced block, or a run marker on a non-bash block.
    """
    lines = doc.read_text(encoding="utf-8").splitlines()
    by_opening = {start: (info, text) for start, _, info, text in _fenced_blocks(lines)}
    inside = {i for start, end, _, _ in _fenced_blocks(lines) for i in range(start, end + 1)}
    out = []
    for i, line in enumerate(lines):
        marker = _MARKER.match(line.strip())
        if marker is None or i in inside:
            continue
        where = f"{_rel(doc)}:{i + 1}"
        if i + 1 not in by_opening:
            raise ValueError(f"{where}: a doc-test marker must be on the line right before a fenced block")
        info, text = by_opening[i + 1]
        if marker.group("path") is None and info.split()[:1] != ["bash"]:
            raise ValueError(f"{where}: only ```bash blocks can be run; this one is {info or 'untagged'!r}")
        out.append(Block(doc, i + 2, info, text, marker.group("path")))
    return out


def repository_entries(root: Path = ROOT) -> set[str]:
    """The repository's own top-level entries: those git tracks (every existing one outside a git checkout)."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True, timeout=30
        ).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        return {entry.name for entry in root.iterdir() if entry.name != ".git"}
    return {path.split("/", 1)[0] for path in listed.split("\0") if path}


def _scratch_root(tmp_path: Path, root: Path = ROOT) -> Path:
    """A directory whose top-level entries are symlinks to the repository's own (:func:`repository_entries`)."""
    scratch = tmp_path / "repo"
    scratch.mkdir()
    for name in sorted(repository_entries(root)):
        entry = root / name
        if entry.exists():
            (scratch / name).symlink_to(entry, target_is_directory=entry.is_dir())
    return scratch


def _environment(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "guard"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m guard "$@"\n')
    shim.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_", "COV_"))}
    env["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _write(block: Block, scratch: Path, root: Path = ROOT) -> None:
    """Save a ``write`` block under ``scratch``; the path must be new: relative, not inside a repository entry (what
    else exists in the working tree does not matter: the scratch directory does not mirror it)."""
    relative = Path(block.write or "")
    escapes = relative.is_absolute() or ".." in relative.parts or not relative.parts
    if escapes or relative.parts[0] in repository_entries(root):
        raise ValueError(f"{block.where()}: write {block.write!r} must be a new relative path outside the repository's "
                         "own files and folders")  # fmt: skip
    target = scratch / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(block.text, encoding="utf-8")


PAGES = [doc for doc in [*DOCS, ROOT / "README.md", *EXAMPLES] if marked_blocks(doc)]


@pytest.mark.parametrize(
    "doc", PAGES, ids=[doc.name if doc.parent == ROOT / "docs" else str(_rel(doc)) for doc in PAGES]
)
def test_marked_commands_run(doc: Path, tmp_path: Path) -> None:
    scratch = _scratch_root(tmp_path)
    env = _environment(tmp_path)
    for block in marked_blocks(doc):
        if block.write is not None:
            _write(block, scratch)
            continue
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.text],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
            check=False,
        )
        assert result.returncode == 0, (
            f"{block.where()}: exit {result.returncode}\n--- block\n{block.text}--- stdout\n{result.stdout[-4000:]}"
            f"--- stderr\n{result.stderr[-4000:]}"
        )


def test_the_docs_mark_their_cheap_commands() -> None:
    # Guards against the convention silently matching nothing (a typo in the marker or the fence regex).
    names = {doc.name for doc in PAGES}
    assert "recipes.md" in names and len(names) >= 3, names
    blocks = [block for doc in PAGES for block in marked_blocks(doc)]
    assert sum(block.write is None for block in blocks) >= 6
    assert sum(block.write is not None for block in blocks) >= 4


def test_marker_rules(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- doc-test -->\n```python\nprint(1)\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match="only ```bash blocks"):
        marked_blocks(page)
    page.write_text("<!-- doc-test -->\n\n```bash\ntrue\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match="right before a fenced block"):
        marked_blocks(page)
    page.write_text("```md\n<!-- doc-test -->\n```\n<!-- doc-test: write a/b.yaml -->\n~~~yaml\nx: 1\n~~~\n"
                    "<!-- doc-test -->\n```bash title\ntrue\n```\n", encoding="utf-8")  # fmt: skip
    write, run = marked_blocks(page)
    assert (write.write, write.text, write.line) == ("a/b.yaml", "x: 1\n", 5)
    assert (run.write, run.text, run.line) == (None, "true\n", 9)
    _write(write, tmp_path)
    assert (tmp_path / "a" / "b.yaml").read_text() == "x: 1\n"
    for bad in ("policies/new.yaml", "../x.yaml", "/tmp/x.yaml"):
        with pytest.raises(ValueError, match="outside the repository"):
            _write(Block(page, 1, "yaml", "x", bad), tmp_path)


def _git_repository(path: Path) -> Path:
    """A git repository with tracked ``policies/p.yaml`` and ``README.md``, plus an untracked ``my-policies/``."""
    (path / "policies").mkdir(parents=True)
    (path / "policies" / "p.yaml").write_text("policies: []\n", encoding="utf-8")
    (path / "README.md").write_text("# r\n", encoding="utf-8")
    subprocess.run(["git", "init", "-q", str(path)], check=True, timeout=30)
    subprocess.run(["git", "-C", str(path), "add", "policies", "README.md"], check=True, timeout=30)
    (path / "my-policies").mkdir()
    (path / "my-policies" / "api.yaml").write_text("left here by a reader\n", encoding="utf-8")
    (path / "my_app.py").write_text("# also a reader's\n", encoding="utf-8")
    return path


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_reader_s_files_at_the_root_do_not_break_or_leak_into_the_page(tmp_path: Path) -> None:
    repo = _git_repository(tmp_path / "clone")
    assert repository_entries(repo) == {"policies", "README.md"}
    scratch = _scratch_root(tmp_path, root=repo)
    assert sorted(p.name for p in scratch.iterdir()) == ["README.md", "policies"]
    page = tmp_path / "page.md"
    for path in ("my-policies/api.yaml", "my_app.py"):
        _write(Block(page, 1, "yaml", "x: 1\n", path), scratch, root=repo)
        assert (scratch / path).read_text() == "x: 1\n" and not (scratch / path).is_symlink()
    assert (repo / "my-policies" / "api.yaml").read_text() == "left here by a reader\n"
    for bad in ("policies/new.yaml", "README.md"):
        with pytest.raises(ValueError, match="outside the repository"):
            _write(Block(page, 1, "yaml", "x", bad), scratch, root=repo)


def test_outside_a_git_checkout_every_entry_counts_as_the_repository_s(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "notes.txt").write_text("n", encoding="utf-8")
    assert repository_entries(tmp_path) == {"docs", "notes.txt"}


def test_this_checkout_s_entries_are_its_tracked_ones() -> None:
    entries = repository_entries()
    assert {"guard", "docs", "tests", "README.md", "pyproject.toml"} <= entries
    assert not entries & {".venv", ".git", "guard.egg-info"}


# Bench scripts --------------------------------------------------------------------------------------------------------


def test_every_bench_script_answers_help_without_running() -> None:
    """docs/benchmarks.md: every script has --help; it prints usage and exits at once (nothing is measured)."""
    assert len(BENCH) >= 8
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    running = {path.name: subprocess.Popen([sys.executable, str(path), "--help"], stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True, env=env) for path in BENCH}  # fmt: skip
    for name, process in running.items():
        out, err = process.communicate(timeout=BLOCK_TIMEOUT_S)
        assert process.returncode == 0, f"{name}: exit {process.returncode}\n{err[-2000:]}"
        assert out.startswith(f"usage: {name}"), f"{name} printed {out[:200]!r}"


# Links ----------------------------------------------------------------------------------------------------------------

_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HREF = re.compile(r"""<(?:a|img)\s[^>]*?(?:href|src)=["']([^"']+)["']""", re.IGNORECASE)
_CODE_SPAN = re.compile(r"(`+).*?\1")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def _prose_lines(path: Path, *, strip_code: bool) -> list[tuple[int, str]]:
    """``(line number, text)`` outside fenced blocks, with code spans removed when ``strip_code``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    inside = {i for start, end, _, _ in _fenced_blocks(lines) for i in range(start, end + 1)}
    return [(i + 1, _CODE_SPAN.sub("", line) if strip_code else line) for i, line in enumerate(lines)
            if i not in inside]  # fmt: skip


def _anchors(path: Path) -> set[str]:
    """The heading anchors GitHub generates for a Markdown file, plus explicit ``id``/``name`` attributes."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in _prose_lines(path, strip_code=False):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).replace("`", "").lower()).replace(" ", "-")
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
        anchors.update(re.findall(r"""\s(?:id|name)=["']([^"']+)["']""", line))
    return anchors


def _targets(path: Path) -> list[tuple[int, str]]:
    """Every link target in prose: Markdown links and images, and ``<a href>`` / ``<img src>``."""
    found = []
    for number, line in _prose_lines(path, strip_code=True):
        found += [(number, target) for target in _LINK.findall(line) + _HREF.findall(line)]
    return found


def broken_links(page: Path) -> list[str]:
    """Relative links in ``page`` whose file does not exist, or whose ``#anchor`` is not a heading of that file."""
    broken = []
    for number, target in _targets(page):
        if _SCHEME.match(target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        destination = (page.parent / file_part).resolve() if file_part else page
        if not destination.exists():
            broken.append(f"{_rel(page)}:{number}: {target} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            broken.append(f"{_rel(page)}:{number}: {target} (no heading #{anchor})")
    return broken


@pytest.mark.parametrize("page", LINKED, ids=[p.name for p in LINKED])
def test_relative_links_resolve(page: Path) -> None:
    broken = broken_links(page)
    assert not broken, "\n".join(broken)


def test_link_checker_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# A `code` heading\n\n## Twice\n\n## Twice\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-code-heading) [ok2](other.md#twice-1) [gone](missing.md) [bad](other.md#nope) [top](#t)\n"
        '`[in code](missing.md)` [web](https://example.com/x) <a href="nowhere/">x</a> ![img](other.md)\n'
        "```\n[in a block](missing.md)\n```\n",
        encoding="utf-8",
    )
    assert [target for _, target in _targets(page)] == [
        "other.md#a-code-heading", "other.md#twice-1", "missing.md", "other.md#nope", "#t",
        "https://example.com/x", "other.md", "nowhere/"]  # fmt: skip
    assert _anchors(tmp_path / "other.md") == {"a-code-heading", "twice", "twice-1"}
    assert broken_links(page) == [
        f"{page}:1: missing.md (no such file)", f"{page}:1: other.md#nope (no heading #nope)",
        f"{page}:1: #t (no heading #t)", f"{page}:2: nowhere/ (no such file)"]  # fmt: skip


def test_readme_policy_example_loads(tmp_path: Path) -> None:
    """The policy shown in the README is a valid policy file."""
    from guard.policy import load_files

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```yaml\n(.*?)```", text, re.DOTALL)
    assert block is not None
    path = tmp_path / "readme.yaml"
    path.write_text(block.group(1), encoding="utf-8")
    assert [p.id for p in load_files(path).policies] == ["api-abuse"]


def test_every_resume_shown_is_built_from_the_thread_s_pending_interrupts() -> None:
    """docs/agents.md says to resume with ``get_state(config).interrupts``: a resume built from a kept
    ``result["__interrupt__"]`` passes the check against items already answered and the ``invoke`` silently does
    nothing. The recipes and the example replay showed exactly that."""
    kept = re.compile(r"""resume_command\(\s*\w+\[["']__interrupt__["']\]""")
    shown = [*LINKED, *sorted((ROOT / "examples").rglob("*.py"))]
    assert [str(_rel(page)) for page in shown if kept.search(page.read_text(encoding="utf-8"))] == []


def _shell_commands(page: Path) -> list[list[str]]:
    """Each command line of ``page``'s bash blocks (continuations joined, comments dropped) as words; a line whose
    quotes run on to the next (a JSON document piped in) is left out."""
    commands = []
    for _, _, info, text in _fenced_blocks(page.read_text().splitlines()):
        if info == "bash":
            for line in text.replace("\\\n", " ").splitlines():
                try:
                    words = shlex.split(line, comments=True)
                except ValueError:
                    continue
                if words:
                    commands.append(words)
    return commands


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "docs" / "worker.md"], ids=lambda p: p.name)
def test_a_worker_that_remote_gateways_reach_is_shown_with_keys(page: Path) -> None:
    """The README sent a gateway to http://gpu-worker:8000 while its worker command listened on 127.0.0.1 without
    keys (and a non-loopback worker without keys exits 2): a remote --backend is shown with $GUARD_BACKEND_API_KEY, and
    beside it a worker on all addresses with --api-keys-env."""
    commands = _shell_commands(page)
    remote = [c for c in commands if "proxy" in c and any(w.startswith("http://gpu-worker") for w in c)]
    workers = [c for c in commands if "serve" in c and "--host" in c and c[c.index("--host") + 1] == "0.0.0.0"]
    if page.name == "README.md":
        assert remote and all(any(w.startswith("GUARD_BACKEND_API_KEY=") for w in c) for c in remote), remote
    if remote:
        assert workers, f"{page.name}: a gateway reaches a remote worker, but no worker listens beyond loopback"
    for worker in workers:
        start = worker.index("guard")
        args = build_parser().parse_args(worker[start + 1 :])
        assert args.api_keys_env and any(w.startswith(f"{args.api_keys_env}=") for w in worker[:start]), worker


def test_the_explain_output_recipes_md_shows_is_what_the_command_prints(tmp_path: Path) -> None:
    # the text block after the explain command quotes its output (digest, cache key, answers): a change to either
    # (a new cache key version, say) must come with the page's update
    doc = ROOT / "docs" / "recipes.md"
    blocks = marked_blocks(doc)
    run = next(block for block in blocks if block.write is None and "guard policy explain" in block.text)
    scratch = _scratch_root(tmp_path)
    for block in blocks:
        if block.write is not None and block.line < run.line:
            _write(block, scratch)
    fenced = _fenced_blocks(doc.read_text(encoding="utf-8").splitlines())
    shown = next(text for start, _, info, text in fenced if start > run.line - 1 and info == "text")
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", run.text], cwd=scratch, env=_environment(tmp_path),
                            capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout == shown
