"""Package boundaries: which parts of bloombee may import which (read from the source, imports inside functions too)."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "bloombee"

# part -> modules it must never import (a prefix matches the module and everything below it)
FORBIDDEN = {
    "client": ("bloombee.server",),
    "planner": ("bloombee.dht", "bloombee.client", "bloombee.server", "hivemind"),
    "protocol": ("bloombee.client", "bloombee.server"),
    "codec": ("bloombee.client", "bloombee.server", "bloombee.protocol", "hivemind"),
    "models": ("bloombee.client", "bloombee.server", "bloombee.dht", "hivemind"),
    "speculative": ("bloombee.client", "bloombee.server", "bloombee.dht", "bloombee.protocol", "hivemind"),
}


def imported_modules(path: Path, root: Path = PACKAGE.parent, names: bool = False) -> set[str]:
    """Every absolute module a file imports, resolving relative imports against its package; with `names`,
    `module.name` for each name of a `from module import name` instead of `module` (see `resolve`)."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            found.update({f"{module}.{alias.name}" for alias in node.names} if names else {module})
    return found


def violations(part: str) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / part).rglob("*.py")):
        for module in imported_modules(path):
            if any(module == banned or module.startswith(banned + ".") for banned in FORBIDDEN[part]):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    return bad


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_part_does_not_import_what_it_must_not(part):
    assert violations(part) == []


def test_the_check_sees_relative_and_function_level_imports(tmp_path):
    module = tmp_path / "bloombee" / "client" / "thing.py"
    module.parent.mkdir(parents=True)
    module.write_text("from .routing import x\nfrom ..server import handler\n\ndef f():\n    import bloombee.dht.records\n")
    assert imported_modules(module, tmp_path) == {"bloombee.client.routing", "bloombee.server", "bloombee.dht.records"}


# Only the model of the chain (bloombee.planner) estimates time: elsewhere no code divides by a link's bandwidth or a
# server's throughput, and no function is a break-even rule of its own.
RATE_NAMES = re.compile(r"bandwidth|throughput|mbps|slowest|steps_per_s", re.IGNORECASE)


def time_estimates(path: Path) -> list[str]:
    """Where a file outside the planner divides by a rate or defines a break-even rule."""
    return time_estimates_in(path, PACKAGE.parent)


def time_estimates_in(path: Path, root: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and not _is_text(node.right):
            divisor = ast.unparse(node.right)
            if RATE_NAMES.search(divisor):
                found.append(f"{path.relative_to(root)}:{node.lineno} divides by {divisor}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "break_even" in node.name:
            found.append(f"{path.relative_to(root)}:{node.lineno} defines {node.name}")
    return found


def _is_text(node: ast.expr) -> bool:
    """A string constant (a path joined with `/`, not a division)."""
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def test_only_the_model_of_the_chain_estimates_time():
    outside = [path for path in sorted(PACKAGE.rglob("*.py")) if PACKAGE / "planner" not in path.parents]
    assert [found for path in outside for found in time_estimates(path)] == []


def test_the_time_check_sees_a_transfer_time_and_a_rule(tmp_path):
    module = tmp_path / "bloombee" / "client" / "thing.py"
    module.parent.mkdir(parents=True)
    module.write_text("def break_even_rate(a):\n    return a\n\n\ndef f(record, n):\n    return n / record.link_bandwidth\n")
    assert len(time_estimates_in(module, tmp_path)) == 2


def module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    """The dotted name of a module file (a package's `__init__.py` is the package)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (under TYPE_CHECKING and in functions too; `from pkg import sub`
    imports the submodule `pkg.sub`, `from pkg import name` the package's `__init__`)."""
    paths = {module_name(path, package.parent): path for path in package.rglob("*.py")}
    return {module: {resolve(name, paths) for name in imported_modules(path, package.parent, names=True)}
            & set(paths) - {module} for module, path in paths.items()}


def resolve(name: str, modules) -> str:
    """The module an imported `name` is: itself if it is one (a submodule), else the module it comes from."""
    return name if name in modules else name.rsplit(".", 1)[0]


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for module in graph[todo.pop()] - seen:
            seen.add(module)
            todo.append(module)
    return seen


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted."""
    reach = {module: reachable(graph, module) for module in graph}
    components = {frozenset(m for m in reach[module] if module in reach[m]) | {module} for module in graph}
    return sorted(sorted(component) for component in components if len(component) > 1)


def test_no_import_cycles_among_the_modules():
    assert import_cycles(import_graph()) == []


def test_the_cycle_check_sees_type_checking_imports_and_submodules(tmp_path):
    package = tmp_path / "bloombee"
    (package / "pkg").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pkg" / "__init__.py").write_text("from bloombee.pkg.a import A\nfrom bloombee.pkg.d import D\n")
    (package / "pkg" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n")
    (package / "pkg" / "b.py").write_text("from bloombee.pkg import A\n")  # the package's re-export: a cycle
    (package / "pkg" / "c.py").write_text("")
    (package / "pkg" / "d.py").write_text("from bloombee.pkg import c\n")  # the submodule: no cycle
    assert import_cycles(import_graph(package)) == [["bloombee.pkg", "bloombee.pkg.a", "bloombee.pkg.b"]]
