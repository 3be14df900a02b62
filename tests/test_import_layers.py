"""The layers the README draws, read from the code's own imports (``ast`` over every module under kxpu/).

- Product code never names its test fakes: no module outside ``kxpu/testing/`` imports ``kxpu.testing``, at
  any level (module, function, ``TYPE_CHECKING``), nor hands a ``kxpu.testing`` module's name to
  ``importlib.import_module`` or to a function that would. A fake plugs in from outside, through the
  backend's library seam (``kxpu.backends.fakes.Seam``).
- No import circles between modules, counting every import: module-level, under ``if TYPE_CHECKING:`` (a
  typing-only circle is still two modules that each need the other) and inside functions (a lazy import
  cannot fail at import time, but it still ties the two modules into one: the dependency points both ways).
- ``kxpu/config.py`` composes the features' own models: what it loads (its module-level imports, followed
  through) holds, of each feature package, only the package itself and its ``config`` module, and that
  ``config`` module imports nothing else of its feature.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kxpu"
FEATURES = ("kxpu.sharing", "kxpu.dra", "kxpu.cdi")  # packages whose own model kxpu/config.py composes


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the kxpu module it loads
    line: int
    level: str  # "module", "typing" (under TYPE_CHECKING) or "function"
    by_name: bool = False  # a module's name as a string (what importlib.import_module would take)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The kxpu module ``name`` loads: itself, or the nearest enclosing module (``kxpu.x.Name`` → ``kxpu.x``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(source: str, path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), str(path))
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]

    def found(name: str, node: ast.AST, level: str, by_name: bool = False) -> Iterator[Import]:
        target = _resolve(name, modules)
        if target is not None and target != source:
            yield Import(source, target, getattr(node, "lineno", 0), level, by_name)

    def visit(node: ast.AST, level: str) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from found(alias.name, node, level)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # ``from kxpu.x import y``: the module kxpu.x.y if there is one
                yield from found(
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base, node, level
                )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
            # a module's name as a string is a dynamic import waiting to happen (importlib, a fake's name
            # handed to a helper that imports it); only whole names of modules count, not prose. Logger names
            # are module names too, so these count for the kxpu.testing check only, not as graph edges.
            yield from found(node.value, node, level, by_name=True)
        if isinstance(node, ast.If) and _is_type_checking(node.test) and level == "module":
            for guarded in node.body:
                yield from visit(guarded, "typing")
            for other in node.orelse:
                yield from visit(other, level)
            return
        inner = "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else level
        for child in ast.iter_child_nodes(node):
            yield from visit(child, inner)

    yield from visit(tree, "module")


def _all_imports() -> list[Import]:
    modules = _modules()
    return [i for name, path in modules.items() for i in _imports(name, path, modules)]


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return sorted(found)


def test_product_code_never_imports_kxpu_testing() -> None:
    offending = [
        f"kxpu/{i.source.removeprefix('kxpu.').replace('.', '/')}: line {i.line} ({i.level}) loads {i.target}"
        for i in _all_imports()
        if _in(i.target, "kxpu.testing") and not _in(i.source, "kxpu.testing")
    ]
    assert offending == [], (
        "product code names a test fake (plug it in through its backend's seam): " + "; ".join(offending)
    )


def test_no_import_cycles_between_modules() -> None:
    edges: dict[str, set[str]] = {}
    for i in _all_imports():
        if not i.by_name:
            edges.setdefault(i.source, set()).add(i.target)
    cycles = _cycles(edges)
    ties = [f"{a} -> {b}" for cycle in cycles for a in cycle for b in sorted(edges[a]) if b in cycle]
    assert cycles == [], "import circles: " + "; ".join(ties)


def test_config_composes_feature_models_without_their_internals() -> None:
    imports = _all_imports()
    direct = {i.target for i in imports if i.source == "kxpu.config"}
    loaded_at_start = {"kxpu.config"}
    todo = ["kxpu.config"]
    while todo:
        module = todo.pop()
        for i in imports:
            if (
                i.source == module
                and i.level == "module"
                and not i.by_name
                and i.target not in loaded_at_start
            ):
                loaded_at_start.add(i.target)
                todo.append(i.target)
    internals = sorted(
        m
        for m in direct | loaded_at_start
        for feature in FEATURES
        if _in(m, feature) and m not in (feature, f"{feature}.config")
    )
    assert internals == [], (
        f"kxpu/config.py loads {internals} feature internals (only <feature>.config is its model)"
    )
    for feature in FEATURES:
        own = sorted(
            i.target
            for i in imports
            if i.source == f"{feature}.config" and _in(i.target, feature) and not i.by_name
        )
        assert own == [], f"{feature}.config is the feature's model: it imports nothing else of {feature}"


def test_the_walker_sees_each_kind_of_import(tmp_path: Path) -> None:
    """The checks above are only as good as the walker: each form of import is found, at its level."""
    modules = {
        "kxpu.a": tmp_path / "a.py",
        "kxpu.b": tmp_path / "b.py",
        "kxpu.testing.fake": tmp_path / "f.py",
    }
    modules["kxpu.a"].write_text(
        "from typing import TYPE_CHECKING\n"
        "import kxpu.b\n"
        "if TYPE_CHECKING:\n    from kxpu.testing import fake\n"
        "def f():\n    from kxpu.testing.fake import Thing\n"
        "HOOK = ('kxpu.testing.fake', 'no kxpu.testing.fake here')\n"
    )
    found = sorted(
        (i.target, i.line, i.level, i.by_name) for i in _imports("kxpu.a", modules["kxpu.a"], modules)
    )
    assert found == [
        ("kxpu.b", 2, "module", False),
        ("kxpu.testing.fake", 4, "typing", False),
        ("kxpu.testing.fake", 6, "function", False),
        ("kxpu.testing.fake", 7, "module", True),
    ]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
