"""The documentation checks what it can: every Python example of README.md and docs/ runs, each
in a fresh process on one rank (an example that cannot run says why in an HTML comment,
``<!-- not run: REASON -->``, on the line just before its fence); every relative link points at
a file; and the results index (docs/results.md) names every file in results/."""
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RESULTS_INDEX = ROOT / "docs" / "results.md"
README_MAX_LINES = 250  # issue 37: the rest belongs in docs/
EXAMPLE_TIMEOUT_S = 120

OPENING = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)")
NOT_RUN = re.compile(r"^\s*<!--\s*not run\b:?(.*?)-->\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
CODE_SPAN = re.compile(r"(`+).*?\1")


@dataclass(frozen=True)
class Block:
    """A fenced block: its page, the line of its opening fence, its language, its text (the
    fence's indentation removed) and the line before the fence."""

    page: Path
    line: int
    language: str
    code: str
    before: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def not_run(self) -> Optional[str]:
        """The reason given for not running it ("" when the marker gives none), or None."""
        m = NOT_RUN.match(self.before)
        return None if m is None else m.group(1).strip()


def fenced_blocks(page: Path) -> List[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = OPENING.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, language = m.groups()
        closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), len(lines))
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line
                         for line in lines[i + 1:end])
        blocks.append(Block(page, i + 1, language.lower(), textwrap.dedent(body) + "\n",
                            lines[i - 1] if i else ""))
        i = end + 1
    return blocks


def prose(page: Path) -> str:
    """The page without its fenced blocks and code spans (links inside code are not links)."""
    lines, inside = [], None
    for line in page.read_text().splitlines():
        m = OPENING.match(line)
        if inside is None and m:
            inside = re.compile(rf"^\s*{re.escape(m.group(2)[0])}{{{len(m.group(2))},}}\s*$")
            continue
        if inside is not None:
            if inside.match(line):
                inside = None
            continue
        lines.append(CODE_SPAN.sub("", line))
    return "\n".join(lines)


def relative_links(page: Path) -> List[str]:
    text = prose(page)
    targets = LINK.findall(text) + REFERENCE.findall(text)
    return [t for t in targets if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", t, re.I)]


def target_of(page: Path, link: str) -> Path:
    return (page.parent / link.split("#", 1)[0].split("?", 1)[0]).resolve()


EXAMPLES = [b for page in PAGES for b in fenced_blocks(page) if b.language == "python"]


def run_example(block: Block, tmp: Path) -> subprocess.CompletedProcess:
    """One rank, no mpirun (mpi4py starts a one-process MPI job), from the repository root."""
    script = tmp / f"{block.name.replace('/', '_').replace(':', '_')}.py"
    script.write_text(block.code)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": path}  # examples run side by side
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=EXAMPLE_TIMEOUT_S, env=env)


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """Every selected example that runs, two at a time for each core (each takes seconds,
    mostly importing torch and waiting for MPI to start)."""
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "function", None) is test_example_runs
                and item.callspec.params["block"].not_run is None]
    tmp = tmp_path_factory.mktemp("examples")
    with ThreadPoolExecutor(max_workers=2 * (os.cpu_count() or 1)) as pool:
        done = dict(zip(selected, pool.map(lambda b: run_example(b, tmp), selected)))
    return done


@pytest.mark.parametrize("block", EXAMPLES, ids=[b.name for b in EXAMPLES])
def test_example_runs(block, outcomes):
    reason = block.not_run
    if reason is not None:
        assert reason, (f"{block.name}: a `not run` marker must say why, as "
                        "<!-- not run: needs 4 ranks under mpirun -->")
        pytest.skip(f"not run: {reason}")
    proc = outcomes[block]
    assert proc.returncode == 0, (f"{block.name}: the example failed (exit {proc.returncode})"
                                  f"\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def test_the_pages_have_examples_that_run():
    assert len([b for b in EXAMPLES if b.not_run is None]) >= 10, [b.name for b in EXAMPLES]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_point_at_files(page):
    broken = [link for link in relative_links(page) if not target_of(page, link).exists()]
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_every_results_file_is_in_the_index():
    """Files and folders at the top of results/, each linked from docs/results.md (a plot or
    the JSON beside a results file is named on its own)."""
    linked = {target_of(RESULTS_INDEX, link) for link in relative_links(RESULTS_INDEX)}
    missing = sorted(p.name for p in (ROOT / "results").iterdir()
                     if not p.name.startswith(".") and p.resolve() not in linked)
    assert not missing, f"docs/results.md does not name {missing}: say what each measured"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {target_of(ROOT / "README.md", link) for link in relative_links(ROOT / "README.md")}
    unlinked = [str(p.relative_to(ROOT)) for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines; keep it to "
                                       f"{README_MAX_LINES} and move the rest to docs/")
