"""Every results file the README and docs/ name exists and says at which commit its figures
were measured, and that commit was clean: no ``-dirty`` (uncommitted code) anywhere in it."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# a results table (results/X.md), not the folder's own README (results/slurm/README.md)
NAMED = sorted({name for doc in DOCS
                for name in re.findall(r"results/[\w./-]+?\.md\b", doc.read_text())
                if not name.endswith("/README.md")})
COMMIT = re.compile(r"commit[^\n]*?\b([0-9a-f]{7,40})\b")


def header_commits(text: str) -> list:
    """The commits a results file's setting names (before its first section)."""
    return COMMIT.findall(text.split("\n\n## ", 1)[0][:4000])


def test_the_docs_name_results_files():
    assert len(NAMED) >= 30, NAMED  # the pattern still finds them


@pytest.mark.parametrize("name", NAMED)
def test_named_results_file_records_a_clean_commit(name):
    path = ROOT / name
    assert path.is_file(), f"the docs name {name}, which does not exist"
    text = path.read_text()
    assert header_commits(text), f"{name} does not say at which commit it was measured"
    dirty = [line for line in text.splitlines() if "-dirty" in line]
    assert not dirty, f"{name} was measured with uncommitted code: {dirty[:3]}"


def _full_history() -> bool:
    try:
        out = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return False
    return out == "false"


@pytest.mark.skipif(not _full_history(), reason="needs the repository's full git history")
@pytest.mark.parametrize("name", NAMED)
def test_named_results_file_commit_is_in_the_history(name):
    path = ROOT / name
    if not path.is_file():
        pytest.skip(f"{name} is missing (the test above fails for it)")
    for commit in header_commits(path.read_text()):
        ok = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=ROOT,
                            capture_output=True).returncode == 0
        assert ok, f"{name} names commit {commit}, which is not in this branch's history"
