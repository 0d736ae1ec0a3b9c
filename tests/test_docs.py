"""The docs run as written: every ```python block of README.md, docs/*.md and benchmarks/README.md runs here,
each in a fresh namespace in a temporary working directory (one case per block, id ``file:line``). README.md
stays short, and every relative link of the pages resolves (to a file, and to a heading where it names one)."""

import re
from pathlib import Path

import pytest

from .support import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
README_MAX_LINES = 300

_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blocks(page: Path) -> list[tuple[str, str]]:
    """(``file:line`` of the opening fence, code) for each python block of ``page``."""
    text = page.read_text()
    return [(f"{_name(page)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1)) for m in _BLOCK.finditer(text)]


BLOCKS = [block for page in PAGES for block in _blocks(page)]


@pytest.mark.parametrize("where,code", BLOCKS, ids=[where for where, _ in BLOCKS])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process says so
def test_python_block_runs(where, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__main__"})


def test_every_python_block_is_collected():
    """A python fence the pattern misses (indented, say) would go untested; README.md shows at least one."""
    missed = {
        _name(p): (p.read_text().count("```python"), len(_blocks(p)))
        for p in PAGES
        if p.read_text().count("```python") != len(_blocks(p))
    }
    assert not missed, f"python fences found vs blocks collected (put each fence at the line's start): {missed}"
    assert _blocks(ROOT / "README.md"), "README.md has no python block: its tour must run"


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ +(.+?) *$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_relative_links_resolve():
    bad = []
    for page in PAGES:
        for target in _LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                bad.append(f"{_name(page)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                bad.append(f"{_name(page)}: {target} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)
