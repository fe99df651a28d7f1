"""The package has no import circles, and every module imports on its own.

The import graph is read statically from the source (every ``import`` / ``from ... import``,
including the ones inside functions, which run later but still tie the modules together); imports
under ``if TYPE_CHECKING:`` only name types for checkers and never run, so they are left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"specdec": ROOT / "specdec", "specdec.kvcache": ROOT / "kvcache", "specdec.kernels": ROOT / "kernels",
            "specdec.scheduler": ROOT / "scheduler"}


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the installed package layout."""
    mods = {}
    for prefix, folder in PACKAGES.items():
        for f in sorted(folder.rglob("*.py")):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if f.parent != folder and not (f.parent / "__init__.py").is_file():
                continue
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([prefix, *parts])
            if prefix == "specdec" and any(name == p or name.startswith(p + ".") for p in PACKAGES if p != prefix):
                continue  # a link to a mapped package (specdec/kvcache -> kvcache) is read there
            mods[name] = f
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imported_names(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Every dotted name an import statement of ``tree`` may refer to (TYPE_CHECKING blocks skipped)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph() -> nx.DiGraph:
    mods = module_files()
    graph = nx.DiGraph()
    graph.add_nodes_from(mods)
    for name, f in mods.items():
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for target in imported_names(tree, name, f.name == "__init__.py"):
            if target in mods and target != name:
                graph.add_edge(name, target)
    return graph


def test_graph_sees_known_edges():
    graph = import_graph()
    assert graph.has_edge("specdec.engine", "specdec.scheduler.scheduler")
    assert graph.has_edge("specdec.cli.main", "specdec.cli.bench")  # an import inside a function
    assert graph.number_of_nodes() > 40


def test_no_import_cycles():
    cycles = sorted(" -> ".join(c) for c in nx.simple_cycles(import_graph()))
    assert cycles == [], "import circles:\n" + "\n".join(cycles)


def test_inference_never_imports_training():
    """Only ``specdec distill`` (its CLI module) and the training package itself import ``specdec.training``: the
    engine, drafters and loaders find the EAGLE draft model in ``specdec.models`` and draft folders in
    ``specdec.loading``."""
    graph = import_graph()
    training = {m for m in graph if m == "specdec.training" or m.startswith("specdec.training.")}
    users = {a for a, b in graph.edges if b in training and a not in training}
    assert users == {"specdec.cli.distill"}, users


def test_no_module_imports_another_modules_private_names():
    """``from X import _name`` across modules of the package: a private name is for its own module."""
    private = []
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specdec"):
                private += [f"{name}: from {node.module} import {a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == [], "\n".join(private)


def test_entry_points_import_in_a_fresh_interpreter(tmp_path):
    """The command-line and loading entry points import from scratch (no reliance on an earlier import), outside
    the checkout (whose kernels/ would shadow PyPI's kernels, which transformers imports)."""
    modules = ["specdec.cli", "specdec.cli.bench", "specdec.cli.distill", "specdec.training",
               "specdec.loading.registry", "specdec.benchmark.report", "specdec.benchmark.plot"]
    code = "; ".join(f"import {m}" for m in modules)
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
