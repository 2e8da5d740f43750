"""The docs stay in pages a reader can use: no page of docs/ over 60 KB (history logs,
whose names say `history`, aside), a README under 30 KB, and every relative link of the
README, the changelog and docs/ pointing at a file that exists and, for a Markdown page, at
one of its headings (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MAX_PAGE_BYTES = 60_000
MAX_README_BYTES = 30_000

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)   # http:, https:, mailto:, ...


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def linked_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *pages()]


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks, inline code removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(INLINE_CODE.sub("", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (link targets and code marks dropped),
    lower case, punctuation removed but for `-` and `_`, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for number, line in enumerate(prose_lines(page.read_text(encoding="utf-8")), start=1):
        for target in LINK.findall(line):
            if EXTERNAL.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            linked = (page.parent / path_part).resolve() if path_part else page
            if not linked.exists():
                problems.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return problems


@pytest.mark.parametrize("page", [page for page in pages() if "history" not in page.name],
                         ids=lambda page: str(page.relative_to(DOCS)))
def test_docs_pages_are_at_most_60_kb(page: Path):
    size = page.stat().st_size
    assert size <= MAX_PAGE_BYTES, (f"{page.relative_to(ROOT)} is {size} bytes: split it into pages "
                                    f"of one subject each (at most {MAX_PAGE_BYTES})")


def test_readme_is_at_most_30_kb():
    size = (ROOT / "README.md").stat().st_size
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes; move the detail into docs/"


def test_readme_starts_with_the_two_commands():
    """CI runs the README's test command (.ci/run): `make run` and `make test` come first."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"^make \w+", text, flags=re.MULTILINE)
    assert commands[:2] == ["make run", "make test"]


def test_relative_links_resolve():
    problems = [problem for page in linked_pages() for problem in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_slugs_follow_github():
    assert slug("Weight codes (CPU, float32)") == "weight-codes-cpu-float32"
    assert slug("bfloat16 GEMMs (CPU, opt-in: `CPU_COMPUTE=bfloat16`)") == \
        "bfloat16-gemms-cpu-opt-in-cpu_computebfloat16"
    assert slug("Hybrid layout: the sliding layers' own cache") == "hybrid-layout-the-sliding-layers-own-cache"
    assert slug("429, 503, UNAVAILABLE, RESOURCE_EXHAUSTED") == "429-503-unavailable-resource_exhausted"
    assert slug("POST /v1/chat/completions") == "post-v1chatcompletions"


def test_a_broken_link_is_found(tmp_path: Path):
    (tmp_path / "a.md").write_text("# Title\n\n## Part one\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#part-one) [gone](a.md#part-two) [missing](c.md) `[code](x.md)`\n"
                    "```\n[fenced](y.md)\n```\n[web](https://example.com) [self](#top)\n# Top\n")
    assert broken_links(page, tmp_path) == ["b.md: a.md#part-two (no such heading)", "b.md: c.md (no such file)"]
