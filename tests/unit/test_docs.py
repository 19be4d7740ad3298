"""The documentation stands alone: the README and ``docs/*.md`` link only to files and headings that exist, every
page under ``docs/`` is reachable from the README and every screenshot is shown, nothing points outside the
repository, and every ``docs/architecture.md §N`` cited in the code names a section that exists."""

from __future__ import annotations

import re
import subprocess
import unicodedata
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
ARCHITECTURE = DOCS / "architecture.md"
THIS = Path(__file__).resolve()
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]

# Inline links and images, [text](target "title") / ![alt](target); reference definitions, [name]: target.
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# Mentions of what lives outside the repository, which a user who clones pinflow does not have.
OUTSIDE = re.compile(r"DESIGN\.md|STYLE\.md|\.\./shared|shared folder", re.IGNORECASE)
# "docs/architecture.md §2", "docs/architecture.md §2, §3", "docs/architecture.md §2–3" (a range).
CITATION = re.compile(r"architecture\.md[`)\]*]*\s*(§\s*\d+(?:\s*[–-]\s*\d+)?(?:\s*,\s*§\s*\d+(?:\s*[–-]\s*\d+)?)*)")
SECTION = re.compile(r"^## (\d+)\. ", re.MULTILINE)
SKIP_DIRS = {".git", ".venv", ".pinflow", "__pycache__", "node_modules", ".mypy_cache", ".ruff_cache", "build", "dist"}


def prose(text: str, spans: bool = True) -> str:
    """``text`` without fenced code blocks and (``spans``) code spans: a link there is an example, not a link."""
    kept, fence = [], ""
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = ""
            kept.append("")
        elif match:
            fence = match.group(1)
            kept.append("")
        else:
            kept.append(line)
    joined = "\n".join(kept)
    return CODE_SPAN.sub("", joined) if spans else joined


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation but ``-`` and ``_`` removed,
    spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """The anchors of ``page``'s headings, with GitHub's ``-1``, ``-2`` for repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text(encoding="utf-8"), spans=False).splitlines():
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


def targets(page: Path) -> list[str]:
    text = prose(page.read_text(encoding="utf-8"))
    found = [m.group(1) for m in INLINE.finditer(text)] + [m.group(1) for m in REFERENCE.finditer(text)]
    return [t[1:-1] if t.startswith("<") else t for t in found]


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)) or target.startswith("//")


@cache
def text_files() -> tuple[Path, ...]:
    """The repository's text files: tracked and untracked-not-ignored ones (git), else a walk of the tree."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO, capture_output=True, check=True, timeout=60,
        ).stdout.decode().split("\0")
        paths = [REPO / name for name in listed if name]
    except (OSError, subprocess.SubprocessError):
        paths = [p for p in REPO.rglob("*") if not SKIP_DIRS.intersection(p.relative_to(REPO).parts)]
    files = []
    for path in sorted(set(paths)):
        if not path.is_file() or path.resolve() == THIS:
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (the screenshots)
        files.append(path)
    return tuple(files)


def read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def test_the_pages_exist():
    assert (REPO / "README.md").is_file()
    assert ARCHITECTURE.is_file()
    assert len(PAGES) > 2


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_images_point_at_files_and_headings_that_exist(page: Path):
    problems = []
    for target in targets(page):
        if not target or is_external(target):
            continue
        path_part, _, anchor = target.partition("#")
        path_part = path_part.split("?", 1)[0]
        file = (page.parent / path_part).resolve() if path_part else page
        if path_part and not file.exists():
            problems.append(f"{target}: no file {file.relative_to(REPO) if file.is_relative_to(REPO) else file}")
            continue
        if path_part and not file.is_relative_to(REPO):
            problems.append(f"{target}: outside the repository")
            continue
        if anchor and file.suffix == ".md" and anchor.lower() not in anchors(file):
            problems.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(problems)


def test_the_checks_see_links_anchors_and_code():
    """The helpers themselves: what a link is, what GitHub's anchors are, and that code is not prose."""
    assert slug("Where outputs land (storage root: `.pinflow/storage/`)") == "where-outputs-land-storage-root-pinflowstorage"
    assert slug("4. Compute backends, the job lifecycle and failure classes") == (
        "4-compute-backends-the-job-lifecycle-and-failure-classes"
    )
    assert slug("The input pipeline: keeping GPUs fed") == "the-input-pipeline-keeping-gpus-fed"
    assert slug("job_history and `make test`") == "job_history-and-make-test"
    text = 'See [a](x.md#b "t"), ![c](d.png) and `[e](f.md)`.\n```\n[g](h.md)\n```\n[i]: j.md\n'
    found = [m.group(1) for m in INLINE.finditer(prose(text))] + [m.group(1) for m in REFERENCE.finditer(prose(text))]
    assert found == ["x.md#b", "d.png", "j.md"]


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in targets(REPO / "README.md") if not is_external(t)}
    missing = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not list under 'Read on': {missing}"


def test_every_screenshot_is_shown_on_a_page():
    shown = {(page.parent / t.partition("#")[0]).resolve() for page in PAGES for t in targets(page)
             if not is_external(t)}
    unshown = [p.name for p in DOCS.glob("*.png") if p.resolve() not in shown]
    assert not unshown, f"screenshots under docs/ that no page shows: {unshown}"


def test_nothing_points_outside_the_repository():
    files = text_files()
    assert any(p.name == "README.md" for p in files) and any(p.suffix == ".py" for p in files)
    hits = []
    for path in files:
        for number, line in enumerate(read(path).splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:160]}")
    assert not hits, "mentions of files outside the repository (use docs/architecture.md):\n" + "\n".join(hits)


def cited_sections(text: str) -> list[int]:
    numbers = []
    for match in CITATION.finditer(text):
        for first, last in re.findall(r"(\d+)(?:\s*[–-]\s*(\d+))?", match.group(1)):
            numbers.extend(range(int(first), int(last or first) + 1))
    return numbers


def test_citations_are_parsed():
    assert cited_sections("(docs/architecture.md §1).") == [1]
    assert cited_sections("(docs/architecture.md §2, §3)") == [2, 3]
    assert cited_sections("Feature computation (docs/architecture.md §2–3): daily") == [2, 3]
    assert cited_sections("[architecture §2](architecture.md#2-storage) §9") == []


def test_every_cited_architecture_section_exists():
    sections = {int(n) for n in SECTION.findall(ARCHITECTURE.read_text(encoding="utf-8"))}
    assert sections == set(range(1, len(sections) + 1)) and len(sections) >= 4, sorted(sections)
    cited, wrong = 0, []
    for path in text_files():
        for number, line in enumerate(read(path).splitlines(), 1):
            for section in cited_sections(line):
                cited += 1
                if section not in sections:
                    wrong.append(f"{path.relative_to(REPO)}:{number}: §{section} ({line.strip()[:120]})")
    assert cited, "no docs/architecture.md §N citation found: the pattern no longer matches how the code cites"
    assert not wrong, f"citations of sections docs/architecture.md does not have (it has {sorted(sections)}):\n" + (
        "\n".join(wrong)
    )
