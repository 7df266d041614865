"""The house rules of docs/architecture.md, checked on the package's own source (ast, no imports):

* no import circle between the package's units (a stage package or a top-level module);
* no import from a later layer into an earlier one (the layer order is read from
  docs/architecture.md, so the document and the code cannot disagree);
* `print`, `sys.exit` and `argparse` only in CLI modules (`cli.py`, `__main__.py`, and the shared
  CLI convention `cli_errors.py`, `logs.py`);
* model-parameter names only in the parameter table (models/params.py);
* no function over 120 lines, and `train/step.py:build_steps` at most 80.

Every import counts, including the lazy ones inside functions: they are dependencies too.
The checkers are also run on a small synthetic package with a deliberate upward import, circle
and stray print, so a checker that stops finding anything fails here.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "agentrefine_jax"
# The CLI modules: each stage's cli.py / __main__.py and the shared CLI convention (errors, -q/-v).
CLI_MODULES = ("cli.py", "__main__.py", "cli_errors.py", "logs.py")
MAX_FUNCTION_LINES = 120


def layers_from_docs(text: str) -> list[list[str]]:
    """The `layers:` list of docs/architecture.md: one line per layer, bottom first."""
    m = re.search(r"```text\nlayers \(bottom first\):\n(.*?)```", text, re.S)
    assert m, "docs/architecture.md lost its 'layers (bottom first):' block"
    return [line.split(":", 1)[1].split() for line in m.group(1).strip().splitlines()]


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(root: pathlib.Path) -> dict[str, set[tuple[str, int, str]]]:
    """{unit: {(imported unit, line, file)}} for imports of the package's own modules."""
    pkg = root.name
    out: dict[str, set[tuple[str, int, str]]] = {}
    for path in root.rglob("*.py"):
        mod = module_name(root, path)
        me = unit_of(mod)
        out.setdefault(me, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == pkg:  # `from pkg import unit`
                    targets = [f"{pkg}.{a.name}" for a in node.names]
                elif node.module.startswith(pkg + "."):
                    targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith(pkg + ".")]
            for t in targets:
                other = unit_of(t)
                if other != me:
                    out[me].add((other, node.lineno, str(path.relative_to(root.parent))))
    return out


def circles(graph: dict[str, set[tuple[str, int, str]]]) -> list[list[str]]:
    edges = {u: {v for v, _, _ in vs} for u, vs in graph.items()}
    found, state = [], {}

    def visit(u: str, stack: list[str]) -> None:
        state[u] = 1
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                found.append(stack[stack.index(v) :] + [v])
            elif v not in state:
                visit(v, [*stack, v])
        state[u] = 2

    for u in sorted(edges):
        if u not in state:
            visit(u, [u])
    return found


def upward(graph: dict[str, set[tuple[str, int, str]]], layers: list[list[str]]) -> list[str]:
    level = {u: i for i, layer in enumerate(layers) for u in layer}
    missing = sorted(set(graph) - set(level))
    assert not missing, f"units without a layer in docs/architecture.md: {missing}"
    return [
        f"{where}:{line}: {u} (layer {level[u]}) imports {v} (layer {level[v]})"
        for u, vs in graph.items()
        for v, line, where in sorted(vs)
        if level[v] > level[u]
    ]


def cli_only_calls(root: pathlib.Path) -> list[str]:
    bad = []
    for path in root.rglob("*.py"):
        if path.name in CLI_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                bad.append(f"{where}: print")
            is_sys = getattr(getattr(node, "value", None), "id", "") == "sys"
            if isinstance(node, ast.Attribute) and node.attr == "exit" and is_sys:
                bad.append(f"{where}: sys.exit")
            if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
                bad.append(f"{where}: argparse")
            if isinstance(node, ast.ImportFrom) and node.module == "argparse":
                bad.append(f"{where}: argparse")
    return bad


def stray_parameter_names(root: pathlib.Path, names: set[str]) -> list[str]:
    """Collections of two or more parameter names written outside the table."""
    bad = []
    for path in root.rglob("*.py"):
        if path.name == "params.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Tuple | ast.List | ast.Set):
                hits = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                if len(hits) >= 2:
                    bad.append(f"{path.relative_to(root.parent)}:{node.lineno}: {hits}")
    return bad


def long_functions(root: pathlib.Path) -> dict[str, int]:
    out = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out[f"{path.relative_to(root.parent)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return out


# ------------------------------------------------------------------------------ the package


@pytest.fixture(scope="module")
def graph() -> dict[str, set[tuple[str, int, str]]]:
    return imports(PACKAGE)


def test_no_import_circle(graph) -> None:
    assert circles(graph) == []


def test_no_import_runs_back_up(graph) -> None:
    layers = layers_from_docs((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert upward(graph, layers) == []


def test_print_exit_and_argparse_only_in_cli_modules() -> None:
    assert cli_only_calls(PACKAGE) == []


def test_parameter_names_live_in_the_table() -> None:
    from agentrefine_jax.models import params

    assert stray_parameter_names(PACKAGE, {p.path[-1] for p in params.TABLE}) == []


def test_functions_are_short() -> None:
    lengths = long_functions(PACKAGE)
    assert {k: n for k, n in lengths.items() if n > MAX_FUNCTION_LINES} == {}
    assert lengths["agentrefine_jax/train/step.py:build_steps"] <= 80


# ------------------------------------------------------------------------------ the checkers


def test_checkers_find_a_planted_violation(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "agentrefine_jax"
    for d in ("models", "train", "eval"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "core.py").write_text(
        "def f():\n    from agentrefine_jax.eval import x\n    print(x)\n"
    )
    (pkg / "train" / "step.py").write_text("from agentrefine_jax.models import core\nNAMES = ('wq', 'wk')\n")
    (pkg / "eval" / "cli.py").write_text(
        "import argparse\nfrom agentrefine_jax.models import core\nprint(1)\n"
    )
    g = imports(pkg)
    assert upward(g, [["agentrefine_jax", "models"], ["train"], ["eval"]]) == [
        "agentrefine_jax/models/core.py:2: models (layer 0) imports eval (layer 2)"
    ]
    assert circles(g) == [["eval", "models", "eval"]] or circles(g) == [["models", "eval", "models"]]
    assert cli_only_calls(pkg) == ["agentrefine_jax/models/core.py:3: print"]
    assert stray_parameter_names(pkg, {"wq", "wk"}) == ["agentrefine_jax/train/step.py:2: ['wq', 'wk']"]
