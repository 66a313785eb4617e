"""The code's shape: no Python file over MAX_LINES lines; and the import graph of hvcomm and
collectives, read from the source (imports inside functions included): no circle, no module
importing a package it belongs to, and the collectives below hvcomm (they import nothing of
it)."""
import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hvcomm", "collectives")
MAX_LINES = 400


def modules(root: Path, packages) -> Dict[str, Path]:
    """Dotted name -> file, for every module under ``packages`` (a package is its __init__)."""
    out = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: Dict[str, Path]) -> Set[str]:
    """The modules of ``known`` that module ``name`` imports anywhere in its source. ``from
    P import x`` counts as importing P.x when that is a module, else P."""
    is_package = path.name == "__init__.py"

    def nearest(dotted: str):
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(nearest(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[:None if is_package else -1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for a in node.names:
                sub = f"{source}.{a.name}"
                found.add(sub if sub in known else nearest(source))
    found.discard(None)
    found.discard(name)
    return found


def graph(root: Path, packages) -> Dict[str, Set[str]]:
    known = modules(root, packages)
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Every group of modules that import one another, directly or not (a module reaches
    another and is reached back): a plain search from each module."""
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in edges[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {m: reach(m) for m in edges}
    groups = {frozenset([m] + [o for o in reached[m] if m in reached[o]])
              for m in edges if m in reached[m]}
    return sorted(sorted(g) for g in groups)


def test_no_module_imports_itself_through_others():
    assert circles(graph(ROOT, PACKAGES)) == []


def test_no_module_imports_a_package_it_belongs_to():
    up = [(m, t) for m, targets in graph(ROOT, PACKAGES).items() for t in targets
          if m.startswith(t + ".")]
    assert up == []


def test_the_collectives_import_nothing_of_hvcomm():
    edges = graph(ROOT, PACKAGES)
    assert [(m, t) for m, targets in edges.items() if m.split(".")[0] == "collectives"
            for t in targets if t.split(".")[0] == "hvcomm"] == []


def test_the_reader_sees_deferred_relative_imports_and_circles(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("import p.a\nfrom p import sub\n")
    edges = graph(tmp_path, ["p"])
    assert edges["p.a"] == {"p.sub.b"} and edges["p.sub.b"] == {"p.c"}
    assert edges["p.c"] == {"p.a", "p.sub"}
    assert circles(edges) == [["p.a", "p.c", "p.sub.b"]]


def test_no_python_file_is_over_max_lines():
    files = [ROOT / "setup.py", *(p for d in ("hvcomm", "collectives", "scripts", "tests")
                                  for p in (ROOT / d).rglob("*.py"))]
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert len(files) > 100 and long == {}
