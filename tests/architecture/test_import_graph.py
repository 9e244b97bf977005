"""Layering rules of the import graph, checked from source (files are parsed with ``ast``,
never imported, so this runs without torch, triton or compiled extensions).

docs/architecture.md describes the layering; this module enforces it:

1. no import cycles: module-level imports, imports inside functions and imports under
   ``if TYPE_CHECKING:`` all count, since each is a place where one module needs the other
   (a cycle imports in one order only, and makes the two modules one unit to change);
2. the kernel folders (``cuda_kernels/``, ``cpu_kernels/``, ``npu_kernels/``) import nothing
   of the project outside their own folder, ``bench`` included: they sit at the bottom;
3. no module imports a private name (``_x``, not ``__x__``) of another package: what another
   package keeps private may change without notice (same-directory imports are allowed);
4. no module ``__getattr__`` in the package: lazy re-exports hide edges from this graph.

Scope: the Python files of ``topth_ops/``, ``bench/`` and the three kernel folders, named as
installed (pyproject.toml [tool.setuptools.package-dir]: ``bench/cli.py`` is
``topth_ops.bench.cli``). ``tests/`` are outside the graph. A bare import matching a file of
the importing file's own folder (bench scripts run with their folder on ``sys.path``) is an
edge to that file's module. Imports of modules outside the project are ignored.
"""

from __future__ import annotations

import ast
from collections import deque
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "topth_ops"
# Top-level folders installed as subpackages (pyproject.toml); inside topth_ops/ they are symlinks.
PACKAGE_DIRS = {"bench": "topth_ops.bench", "cuda_kernels": "topth_ops.cuda_kernels",
                "cpu_kernels": "topth_ops.cpu_kernels", "npu_kernels": "topth_ops.npu_kernels"}
KERNELS = ("topth_ops.cuda_kernels", "topth_ops.cpu_kernels", "topth_ops.npu_kernels")


def _py_files(folder: Path):
    """Python files under ``folder``, not descending into symlinked folders."""
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder)
        if not any((folder / Path(*rel.parts[:i])).is_symlink() for i in range(1, len(rel.parts))):
            yield path


def _module_name(prefix: str, rel: Path) -> str:
    parts = [prefix, *rel.with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    """Module name -> source file, for every Python file in scope."""
    found = {_module_name(PACKAGE, p.relative_to(ROOT / PACKAGE)): p for p in _py_files(ROOT / PACKAGE)}
    for folder, prefix in PACKAGE_DIRS.items():
        found.update({_module_name(prefix, p.relative_to(ROOT / folder)): p for p in _py_files(ROOT / folder)})
    assert len(found) > 50, f"only {len(found)} modules found under {ROOT}: wrong repository root?"
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_of(module: str) -> str:
    """The package (directory) a module lives in; a package's ``__init__`` is its own."""
    return module if modules()[module].name == "__init__.py" else module.rpartition(".")[0]


def _canonical(name: str, importer: str) -> str | None:
    """The project module an absolute dotted name refers to, or None if it is not ours."""
    head, _, rest = name.partition(".")
    if head in PACKAGE_DIRS:  # ``import bench.cases`` run from the repository root
        name = PACKAGE_DIRS[head] + ("." + rest if rest else "")
    elif head != PACKAGE:
        sibling = modules()[importer].parent / f"{head}.py"  # a script's sibling script
        if not sibling.is_file():
            return None
        name = _package_of(importer) + "." + name
    return name if name in modules() else None


def imports(module: str):
    """Yield ``(line, target module, imported name or None)`` for each project import."""
    tree = ast.parse(modules()[module].read_text(encoding="utf-8"), str(modules()[module]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _canonical(alias.name, module)
                if target:
                    yield node.lineno, target, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the importer's package
                base = _package_of(module).split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = _canonical(node.module, module) if node.module != "__future__" else None
            if not source or source not in modules():
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules():
                    yield node.lineno, sub, None
                else:
                    yield node.lineno, source, alias.name


@lru_cache(maxsize=None)
def graph() -> dict[str, set[str]]:
    return {m: {t for _, t, _ in imports(m) if t != m} for m in modules()}


def _shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest import chain from ``start`` back to itself (breadth-first), if any."""
    parent, queue = {start: None}, deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if nxt == start:
                path = [node]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return None


def test_no_import_cycles():
    cycles = set()
    for start in sorted(graph()):
        cycle = _shortest_cycle(graph(), start)
        if cycle:  # one shortest cycle through each module on one, written from its smallest name
            i = cycle.index(min(cycle[:-1]))
            cycles.add(" -> ".join(cycle[i:-1] + cycle[:i + 1]))
    assert not cycles, f"{len(cycles)} import cycle(s):\n  " + "\n  ".join(sorted(cycles))


def test_kernel_folders_do_not_import_upward():
    bad = []
    for module in sorted(m for m in modules() if m.startswith(KERNELS)):
        own = next(k for k in KERNELS if module == k or module.startswith(k + "."))
        for line, target in sorted({(line, target) for line, target, _ in imports(module)}):
            if not (target == own or target.startswith(own + ".")):
                bad.append(f"{modules()[module].relative_to(ROOT)}:{line}: {module} imports {target}")
    assert not bad, "kernel folders may import only within themselves:\n  " + "\n  ".join(bad)


def test_no_private_imports_across_packages():
    bad = []
    for module in sorted(modules()):
        for line, target, name in imports(module):
            if _package_of(module) == _package_of(target):
                continue
            private = [p for p in target.split(".") + ([name] if name else []) if _is_private(p)]
            if private:
                shown = f"{target}.{name}" if name else target
                bad.append(f"{modules()[module].relative_to(ROOT)}:{line}: {module} imports private {shown}")
    assert not bad, "private names imported from another package:\n  " + "\n  ".join(bad)


def _module_level(body):
    """Statements run at import time (descending into if/try/with, not into defs or classes)."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from _module_level(getattr(node, field, []))


# Modules whose __getattr__ is behaviour, not a re-export: vLLM resolves the plugin's class
# path with getattr while it builds the model, and the answer depends on the engine's config.
GETATTR_ALLOWED = {"topth_ops.vllm.dispatch"}


def test_no_module_getattr():
    bad = []
    for module, path in sorted(modules().items()):
        if module in GETATTR_ALLOWED:
            continue
        for node in _module_level(ast.parse(path.read_text(encoding="utf-8")).body):
            defined = (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__getattr__"
                       or isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
                           isinstance(t, ast.Name) and t.id == "__getattr__"
                           for t in (node.targets if isinstance(node, ast.Assign) else [node.target])))
            if defined:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module} defines module __getattr__")
    assert not bad, "module __getattr__ hides lazy re-exports (import the name explicitly):\n  " + "\n  ".join(bad)


# The layering of docs/architecture.md: a module may import its own layer and the layers
# before it, never a later one. Prefixes are matched longest first.
LAYERS = [
    ("topth_ops.cuda_kernels", "topth_ops.cpu_kernels", "topth_ops.npu_kernels"),
    ("topth_ops.validation", "topth_ops.packed", "topth_ops.codes", "topth_ops.env", "topth_ops.vmean", "topth_ops.cli"),
    ("topth_ops.contract", "topth_ops.contract_checks", "topth_ops.paged", "topth_ops.value_sum"),
    ("topth_ops.registry", "topth_ops.prefill"),
    ("topth_ops.op", "topth_ops.api", "topth_ops"),
    ("topth_ops.backends",),
    ("topth_ops.thresholds",),
    ("topth_ops.calibration", "topth_ops.rowstats"),
    ("topth_ops.conformance", "topth_ops.info", "topth_ops.demo", "topth_ops.__main__"),
    ("topth_ops.hf", "topth_ops.vllm"),
    ("topth_ops.bench",),
]


def _layer(module: str) -> int:
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and p.count(".") > depth:
                best, depth = i, p.count(".")
    return best


def test_layering_of_the_architecture_doc():
    bad = []
    for module, targets in sorted(graph().items()):
        lm = _layer(module)
        for t in sorted(targets):
            if t == "topth_ops" and lm is not None and lm >= _layer("topth_ops"):
                continue
            lt = _layer(t)
            if lm is None or lt is None:
                bad.append(f"{module} -> {t}: a module outside the layers of docs/architecture.md")
            elif lt > lm:
                bad.append(f"{module} (layer {lm}) imports {t} (layer {lt}), a later layer")
    assert not bad, "imports against docs/architecture.md's layering:\n  " + "\n  ".join(bad)


def test_every_package_is_installed():
    """pyproject.toml lists the packages by name: each folder with an __init__.py must be there
    (an editable install finds unlisted ones, a wheel does not)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {m for m, p in modules().items() if p.name == "__init__.py"}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
