"""The house rules of issues 16 and 31, checked on the source: the product never imports tooling,
Ray stays out of capacity/ (but its actor) and engine/, no import cycle anywhere (imports inside
functions and `if TYPE_CHECKING:` blocks count: a lazy import still ties two modules' concepts
together), one class per seam shape, no getattr probing of KV stores, no module over 400 lines. Pure
Python (ast)."""
from __future__ import annotations

import ast
import sys
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


def _cycles(packages: tuple[str, ...]) -> list[list[str]]:
    """Import cycles among the modules of `packages`, counting every import (functions and
    TYPE_CHECKING blocks included)."""
    mods = {name: path for package in packages for name, path in _modules(package).items()}
    graph = {name: {i for i in _imports(name, path, top_level_only=False)
                    if i in mods and i != name}
             for name, path in mods.items()}
    # A package's __init__ re-exporting its own modules is not a cycle of concepts.
    graph = {n: {i for i in deps if not n.startswith(i + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

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
    return cycles


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package):
    assert not _cycles((package,)), _cycles((package,))


def test_no_import_cycle_across_the_product():
    """engine/, capacity/ and serve_app/ as one graph: a cycle through two packages counts too."""
    assert not _cycles(PRODUCT), _cycles(PRODUCT)


def test_cycle_check_sees_lazy_imports(tmp_path, monkeypatch):
    """The check counts an import inside a function and one under TYPE_CHECKING (the shapes of
    the cycles issue 31 found: runner/paged.py <-> runner/compiled_decode.py)."""
    pkg = tmp_path / "lazy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from lazy.b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from lazy.a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert _cycles(("lazy",)) in ([["lazy.a", "lazy.b", "lazy.a"]],
                                  [["lazy.b", "lazy.a", "lazy.b"]])


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


# One class per seam shape (issue 31): what crosses each seam of the product, by its one class.
SEAMS = {
    "request": ("engine.request", "GenerationRequest"),
    "sampling": ("engine.sampling.params", "SamplingParams"),
    "step": ("engine.sched.seq", "Step"),
    "step rows": ("engine.sched.seq", "Chunk"),
    "step result": ("engine.steps", "StepResult"),
    "delta": ("engine.request", "Delta"),
    # Across Ray, ingress <-> replica: the request and the delta above, each plus what only
    # that hop needs (routing facts; the replica id and trace).
    "call": ("serve_app.calls", "GenerateCall"),
    "reply": ("serve_app.wire", "ReplicaDelta"),
    "telemetry": ("capacity.protocol", "RequestTelemetry"),
    "config": ("engine.config", "EngineConfig"),
}
# Classes that share most of a seam's fields and are a different thing, each with why. A class
# that joins this list is a second shape of a seam unless its reason says otherwise.
LOOK_ALIKES = {
    ("engine.sched.seq", "Seq"): "the scheduler's state of a running request (nano-vllm's "
                                 "Sequence): the request's fields it schedules by, plus progress",
    ("serve_app.protocol", "_Sampling"): "the OpenAI HTTP body (pydantic): OpenAI names and "
                                         "OpenAI-only rules; builds SamplingParams once",
    ("capacity.rates", "RequestSample"): "one point of a rate history, derived from telemetry",
    ("engine.request", "Usage"): "the engine's token counts of one request (the usage block "
                                 "it streams); the telemetry carries them on with its timings",
}


def _classes() -> dict[tuple[str, str], set[str]]:
    """(module, class) -> the names of its shape: annotated fields, properties, __slots__."""
    out = {}
    for package in PRODUCT:
        for name, path in _modules(package).items():
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    out[name, node.name] = _shape(node)
    return out


def _shape(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list):
            names.add(node.name)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            names |= {c.value for c in ast.walk(node.value)
                      if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return {n for n in names if not n.startswith("_")}


def _look_alike(seam: set[str], other: set[str]) -> bool:
    """At least three names in common, and half of the smaller shape."""
    common = len(seam & other)
    return common >= 3 and 2 * common >= min(len(seam), len(other))


def test_one_class_per_seam_shape():
    """Each seam's class exists where listed, and no other product class repeats most of its
    shape (a copy such as the old Chunk -> SeqChunk -> Row fails here) unless it is listed in
    LOOK_ALIKES with why it is a different thing."""
    classes = _classes()
    missing = [f"{seam}: {mod}.{cls}" for seam, (mod, cls) in SEAMS.items()
               if (mod, cls) not in classes]
    assert not missing, missing
    seam_classes = set(SEAMS.values())
    second = [f"{mod}.{cls} looks like the {seam} ({m}.{c}): {sorted(shape & fields)}"
              for seam, (m, c) in SEAMS.items() for (mod, cls), fields in classes.items()
              if (shape := classes[m, c]) and (mod, cls) not in seam_classes
              and (mod, cls) not in LOOK_ALIKES and _look_alike(shape, fields)]
    assert not second, second
    stale = [k for k in LOOK_ALIKES if k not in classes]
    assert not stale, f"LOOK_ALIKES names classes that are gone: {stale}"


def test_seam_check_finds_a_copied_row():
    """The look-alike rule catches the copies issue 31 removed: the runner's SeqChunk and
    attention's Row, each a copy of the scheduler's row; an unrelated class passes."""
    rows = _classes()[SEAMS["step rows"]]
    seq_chunk = _shape(ast.parse("class SeqChunk:\n seq_id: int\n token_ids: list\n"
                                 " start: int\n page_table: list\n").body[0])
    attention_row = _shape(ast.parse("class Row:\n start: int\n length: int\n"
                                     " page_table: list\n").body[0])
    assert _look_alike(rows, seq_chunk) and _look_alike(rows, attention_row)
    assert not _look_alike(rows, {"window", "pages", "base", "start"})


def _store_probes(tree: ast.AST) -> list[str]:
    """`getattr(<something naming a store>, ...)` calls: an optional member found by probing
    instead of declared on the store contract (engine/kv/store.py, LayerStore)."""
    return [ast.unparse(node) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr") and node.args
            and "store" in ast.unparse(node.args[0]).lower()]


def test_no_getattr_probing_of_stores():
    """Issue 31: every capability of a KV store is declared with its default on LayerStore;
    the engine reads it, never probes for it."""
    found = [f"{name}: {probe}" for name, path in _modules("engine").items()
             for probe in _store_probes(ast.parse(path.read_text()))]
    assert not found, found
    assert _store_probes(ast.parse("getattr(self.store, 'decode_writes_own', False)"))
