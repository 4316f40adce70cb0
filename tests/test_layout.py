"""The house rules of issue 16, checked on the source: the product never imports tooling, Ray
stays out of capacity/ (but its actor) and engine/, no package has a module-level import cycle,
no module is over 400 lines. Pure Python (ast)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "capacity", "serve_app")
TOOLING = ("tests", "bench", "quality", "training")
PACKAGES = PRODUCT + ("loadtest", "bench", "quality", "training")
MAX_LINES = 400


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, *, top_level_only: bool) -> set[str]:
    """Modules `name` imports; with top_level_only, only imports run at import time (module
    body, not functions; `if TYPE_CHECKING:` blocks skipped)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = []

    def walk(body):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            nodes.append(node)
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                walk(getattr(node, "body", []) + getattr(node, "orelse", [])
                     + [h for t in getattr(node, "handlers", []) for h in t.body]
                     + getattr(node, "finalbody", []))
    if top_level_only:
        walk(tree.body)
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


@pytest.mark.parametrize("package", PRODUCT)
def test_product_never_imports_tooling(package):
    bad = [f"{name} imports {imp}" for name, path in _modules(package).items()
           for imp in _imports(name, path, top_level_only=False)
           if imp.split(".")[0] in TOOLING]
    assert not bad, bad


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package):
    mods = _modules(package)
    graph = {name: {i for i in _imports(name, path, top_level_only=True) if i in mods and i != name}
             for name, path in mods.items()}
    # A package's __init__ re-exporting its own modules is not a cycle of concepts.
    graph = {n: {i for i in deps if not n.startswith(i + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(n, stack):
        state[n] = 1
        for m in graph[n]:
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2
    for n in graph:
        if n not in state:
            visit(n, [n])
    assert not cycles, cycles


@pytest.mark.parametrize("package,allowed", [("capacity", {"capacity.actor"}), ("engine", set())])
def test_ray_stays_out_of_the_pure_layers(package, allowed):
    """capacity/ is pure (its one Ray actor aside); engine/ never imports Ray (DESIGN layers)."""
    bad = [f"{name} imports {imp}" for name, path in _modules(package).items() if name not in allowed
           for imp in _imports(name, path, top_level_only=False) if imp.split(".")[0] == "ray"]
    assert not bad, bad


def test_no_module_over_400_lines():
    long = {str(p.relative_to(REPO)): n for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_loadtest_speaks_http_only():
    """loadtest/ imports nothing from the product (issue 31): it drives any OpenAI-compatible
    server over HTTP, so it must not lean on Orchard's code, even inside a function."""
    bad = [f"{name} imports {imp}" for name, path in _modules("loadtest").items()
           for imp in _imports(name, path, top_level_only=False)
           if imp.split(".")[0] in PRODUCT]
    assert not bad, bad
