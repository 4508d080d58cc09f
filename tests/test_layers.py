"""The package's layers only look down: no import circle among dprorun's modules (imports inside functions count
too; those under `if TYPE_CHECKING:` do not run and do not count), and no library module imports a CLI module."""
import ast
import os

import networkx as nx

from conftest import REPO

CLI_MODULES = {"dprorun.cli", "dprorun.offline_cli", "dprorun.byteps_launch"}  # argv in, library calls out


def _module_name(path: str) -> str:
    name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if _is_type_checking(node):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dprorun"):
            yield node.module
            for alias in node.names:
                yield f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        yield from _imports(node)


def import_graph() -> nx.DiGraph:
    modules = {}
    for folder, _, files in os.walk(os.path.join(REPO, "dprorun")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                modules[_module_name(path)] = path
    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module)
        with open(path) as handle:
            tree = ast.parse(handle.read())
        for target in _imports(tree):
            if target in modules and target != module:
                graph.add_edge(module, target)
    return graph


def test_no_import_circles():
    cycles = list(nx.simple_cycles(import_graph()))
    assert cycles == [], [" -> ".join(c) for c in cycles]


def test_the_library_never_imports_a_cli_module():
    graph = import_graph()
    offenders = [(a, b) for a, b in graph.edges if b in CLI_MODULES and a not in CLI_MODULES]
    assert offenders == []


MAX_FUNCTION_LINES = 80  # the "about 80": every function of the package, CLIs and report included


def test_no_function_of_the_package_is_longer_than_80_lines():
    too_long = []
    for folder, _, files in os.walk(os.path.join(REPO, "dprorun")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as handle:
                tree = ast.parse(handle.read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        too_long.append(f"{os.path.relpath(path, REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not too_long, too_long
