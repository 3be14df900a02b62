"""One Kubernetes package: every call to the API server is made in ``kxpu/kube``. Outside it (and the test
fakes), product code may name lightkube only for types (under ``TYPE_CHECKING``) or for its quantity parser,
which reads a string and talks to nobody. Read from the source, so a new module that reaches for lightkube
itself fails here, naming the line."""

from __future__ import annotations

import ast
from pathlib import Path

KXPU = Path(__file__).resolve().parent.parent / "kxpu"
OWNERS = ("kube", "testing")  # kxpu/kube talks to the API server; kxpu/testing stands in for it
ALLOWED = ("lightkube.utils.quantity",)  # parsing only


def _typing_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _lightkube_imports(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _typing_only(node):
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "lightkube")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("lightkube")
        ):
            found.append((node.lineno, str(node.module)))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_only_kxpu_kube_talks_to_the_api_server() -> None:
    offenders = []
    for path in sorted(KXPU.rglob("*.py")):
        relative = path.relative_to(KXPU)
        if relative.parts[0] in OWNERS:
            continue
        for line, module in _lightkube_imports(ast.parse(path.read_text(), str(path))):
            if module not in ALLOWED:
                offenders.append(f"kxpu/{relative}:{line} imports {module}")
    assert offenders == [], "API calls belong in kxpu/kube: " + "; ".join(offenders)


def test_the_walker_sees_function_imports_and_skips_typing_ones() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from lightkube import AsyncClient\n"
        "def f():\n    from lightkube.resources.core_v1 import Pod\n    import lightkube\n"
    )
    assert _lightkube_imports(ast.parse(source)) == [(5, "lightkube.resources.core_v1"), (6, "lightkube")]
