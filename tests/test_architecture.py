"""The package's layout holds: packages by concern in layers, no import circle, imports running down the layers
(docs/design.md, "Layers"). Read from the source with ``ast``: no module is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import adloco

PACKAGE = Path(adloco.__file__).resolve().parent
# bottom to top: a unit may import the units below it (docs/design.md draws the same order)
LAYERS = [
    ["errors", "units"],
    ["algorithms"],
    ["config"],
    ["data", "comm"],
    ["checkpoint"],
    ["models"],
    ["metrics"],
    ["workers"],
    ["batch"],
    ["sync"],
    ["cluster"],
    ["run"],
    ["api"],
    ["replicas"],
    ["integrations"],
    ["tools"],
    ["__init__"],
    ["cli"],
    ["docs", "__main__"],
]
# the one import that runs up: a data section's validation asks the data layer what its files are
UPWARD = {("adloco.config.sections", "adloco.data.token_files")}
TOP_LEVEL_MODULES = 8


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """Every adloco module ``name`` imports, at the top, in a function or for type checking alike."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name and not name.startswith(target + "."):
                yield target


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: set(_imports(name, path, modules)) for name, path in modules.items()}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_has_a_layer():
    layered = {unit for layer in LAYERS for unit in layer}
    assert {_unit(m) for m in _modules()} == layered


def test_at_most_eight_modules_at_the_top_of_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MODULES, top


def test_no_import_circle():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def test_imports_run_down_the_layers():
    level = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    upward = {
        (a, b)
        for a, targets in _graph().items()
        for b in targets
        if _unit(a) != _unit(b) and level[_unit(b)] > level[_unit(a)]
    }
    assert upward == UPWARD
