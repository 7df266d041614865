"""The house rules of docs/architecture.md, checked on the package's own source (ast, no imports):

* no import circle between the package's units (a stage package or a top-level module), nor
  between its files (inside one package too: relative, lazy and type-only imports count);
* no import from a later layer into an earlier one (the layer order is read from
  docs/architecture.md, so the document and the code cannot disagree); inside `eval` too, between
  its own units (engine, records, episode sources, protocols and runners, CLI: the `eval layers` block);
* `print`, `sys.exit` and `argparse` only in CLI modules (`cli.py`, `__main__.py`, and the shared
  CLI convention `cli_errors.py`, `logs.py`);
* model-parameter names only in the parameter table (models/params.py);
* no function over 120 lines, and `train/step.py:build_steps` at most 80;
* eval's concepts that both episode sources share defined once (EVAL_ONE_HOME: the engine, its job,
  its job key, the episode record), and AgentBoard's retired second copies nowhere;
* LoRA / int8 decided in one place: a test (`if`, `while`, conditional expression, filter,
  every operand of a short-circuit `and`/`or`) that names LoRA, int8 or quantisation only in the
  parameter mode (train/param_mode.py) and the few homes listed in MODE_BRANCH_HOMES, each with
  its reason; the trainer's loop and step, loaders, inference and eval read straight through.

Every import counts, including the lazy ones inside functions: they are dependencies too.
The checkers are also run on a small synthetic package with a deliberate upward import, circle
(between units, and between two files of one package) and stray print, so a checker that stops
finding anything fails here.
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
MODE_NAME = re.compile(r"lora|int8|quant", re.I)
# Where a test may name LoRA / int8 (a file, or file:function), and why.
MODE_BRANCH_HOMES = {
    "agentrefine_jax/train/param_mode.py": "the parameter mode: full / LoRA / int8 LoRA",
    "agentrefine_jax/models/lora.py": "the adapters themselves (LoraSpec.of: rank 0 is no LoRA)",
    "agentrefine_jax/models/quant.py": "the int8 base itself (which leaves are quantised)",
    "agentrefine_jax/models/llama.py:proj": "the forward adds the adapters it is handed",
    "agentrefine_jax/checkpoint/lora_base.py": "a LoRA checkpoint's stored form (int8: re-quantised)",
    "agentrefine_jax/train/planner.py:param_bytes": "the planner sizes each mode's state without building it",
    "agentrefine_jax/checkpoint/meta.py:to_json": "the meta's optional 'lora' entry, written",
    "agentrefine_jax/checkpoint/meta.py:from_json": "the meta's optional 'lora' entry, read",
    "agentrefine_jax/checkpoint/model.py:load_model": "the stored form: meta.lora -> lora_base",
    "agentrefine_jax/config_checks.py:_lora_int8": "validation of train.lora at load",
    "agentrefine_jax/export/cli.py:cmd_to_hf": "--merge-lora: a PEFT adapter directory or merged weights",
}


# eval's concepts that both episode sources share, each defined in one file only (a second definition
# anywhere in eval, e.g. a source's own record or run_episodes wrapper, is a second pipeline starting).
EVAL_ONE_HOME = {
    "run_episodes": "agentrefine_jax/eval/core.py",
    "EpisodeJob": "agentrefine_jax/eval/core.py",
    "job_key": "agentrefine_jax/eval/core.py",
    "EpisodeResult": "agentrefine_jax/eval/core.py",
    "EpisodeLog": None,  # AgentBoard's record, now the one record read in its vocabulary
    "Episode": "agentrefine_jax/eval/core.py",  # the running episode every protocol drives
    "_Running": None,  # the chat protocol's running episode, now core.Episode
    "Task": "agentrefine_jax/eval/core.py",  # the task base; each source's (EvalTask, AgentBoardTask) over it
    "Source": "agentrefine_jax/eval/runner.py",  # what the one runner reads of an episode source
    "task_passes": "agentrefine_jax/eval/runner.py",  # Best-of-N and perturbation passes, as data
    "_samples": None,  # AgentBoard's own Best-of-N orchestration
    "_perturbed": None,  # AgentBoard's own perturbation orchestration
    "_greedy": None,  # the built-in source's own greedy run beside Best-of-N
}


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


def file_imports(root: pathlib.Path) -> dict[str, set[tuple[str, int, str]]]:
    """{module: {(imported module, line, file)}} between the package's files: absolute and relative
    imports, lazy ones inside functions and `if TYPE_CHECKING:` ones included. `from pkg.sub import
    x` is an edge to the module `pkg.sub.x` when that is a file, else to `pkg.sub` (its __init__)."""
    pkg = root.name
    modules = {module_name(root, p): p for p in root.rglob("*.py")}
    out: dict[str, set[tuple[str, int, str]]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, `level - 1` packages up
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                if base == pkg or base.startswith(pkg + "."):
                    for a in node.names:
                        sub = f"{base}.{a.name}"
                        targets.append(sub if sub in modules else base)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name == pkg or a.name.startswith(pkg + ".")]
            for t in targets:
                while t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t != mod and t in modules:
                    out[mod].add((t, node.lineno, str(path.relative_to(root.parent))))
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


def inner_layers_from_docs(text: str, package: str) -> list[list[str]]:
    """A package's own `<package> layers (bottom first):` block of docs/architecture.md."""
    m = re.search(rf"```text\n{package} layers \(bottom first\):\n(.*?)```", text, re.S)
    assert m, f"docs/architecture.md lost its '{package} layers (bottom first):' block"
    return [line.split(":", 1)[1].split() for line in m.group(1).strip().splitlines()]


def inner_unit(module: str, package: str, units: set[str]) -> str:
    """The unit of `module` inside `package` (e.g. `agentrefine_jax.eval`): the longest listed dotted
    prefix of its path there (`agentboard.runner` before `agentboard`); the package itself is `__init__`."""
    parts = (module[len(package) :].lstrip(".") or "__init__").split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in units:
            return ".".join(parts[:k])
    return ".".join(parts)


def inner_upward(
    files: dict[str, set[tuple[str, int, str]]], package: str, layers: list[list[str]]
) -> list[str]:
    """Imports between a package's files (lazy, relative and type-only ones included: `file_imports`)
    from a unit of a lower layer into one of a higher layer of `layers`."""
    level = {u: i for i, layer in enumerate(layers) for u in layer}
    inside = {m: es for m, es in files.items() if m == package or m.startswith(package + ".")}
    units = {m: inner_unit(m, package, set(level)) for m in inside}
    missing = sorted({u for u in units.values() if u not in level})
    assert not missing, f"{package} files without a layer in docs/architecture.md: {missing}"
    return [
        f"{where}:{line}: {units[m]} (layer {level[units[m]]}) imports {units[v]} (layer {level[units[v]]})"
        for m, es in inside.items()
        for v, line, where in sorted(es)
        if v in units and level[units[v]] > level[units[m]]
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


def second_homes(root: pathlib.Path, homes: dict[str, str | None]) -> list[str]:
    """Definitions (functions and classes, nested too) of `homes`' names under `root`'s eval package
    outside their one home, and homes that lost theirs."""
    out, found = [], set()
    for path in sorted((root / "eval").rglob("*.py")):
        rel = str(path.relative_to(root.parent))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            is_def = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            if is_def and node.name in homes:
                home = homes[node.name]
                if home == rel:
                    found.add(node.name)
                else:
                    out.append(
                        f"{rel}:{node.lineno}: {node.name} ({f'its one home: {home}' if home else 'retired'})"
                    )
    for name, home in homes.items():
        if home is not None and name not in found:
            out.append(f"{home}: {name} is no longer defined in its home")
    return out


def long_functions(root: pathlib.Path) -> dict[str, int]:
    out = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out[f"{path.relative_to(root.parent)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return out


def _names_mode(node: ast.AST) -> bool:
    for n in ast.walk(node):
        text = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            text = n.value
        if text is not None and MODE_NAME.search(text):
            return True
    return False


def mode_branches(root: pathlib.Path) -> list[tuple[str, str, int]]:
    """(file, innermost function, line) of every test that names LoRA, int8 or quantisation."""
    found = set()
    for path in root.rglob("*.py"):
        rel = str(path.relative_to(root.parent))

        def visit(node: ast.AST, func: str, rel: str = rel) -> None:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                func = node.name
            tests: list[ast.AST] = []
            if isinstance(node, ast.If | ast.While | ast.IfExp):
                tests = [node.test]
            elif isinstance(node, ast.comprehension):
                tests = list(node.ifs)
            elif isinstance(node, ast.BoolOp):
                tests = list(node.values)  # every operand: `a and "lora_key" not in p` too
            elif isinstance(node, ast.Match):
                tests = [node.subject]
            found.update((rel, func, t.lineno) for t in tests if _names_mode(t))
            for child in ast.iter_child_nodes(node):
                visit(child, func)

        visit(ast.parse(path.read_text(encoding="utf-8")), "<module>")
    return sorted(found)


def stray_mode_branches(root: pathlib.Path, homes: dict[str, str]) -> list[str]:
    return [
        f"{f}:{line}: {fn}"
        for f, fn, line in mode_branches(root)
        if f not in homes and f"{f}:{fn}" not in homes
    ]


# ------------------------------------------------------------------------------ the package


@pytest.fixture(scope="module")
def graph() -> dict[str, set[tuple[str, int, str]]]:
    return imports(PACKAGE)


def test_no_import_circle(graph) -> None:
    assert circles(graph) == []


def test_no_import_circle_between_files() -> None:
    """Inside a package too: a lazy import that closes a circle is still a circle."""
    assert circles(file_imports(PACKAGE)) == []


def test_no_import_runs_back_up(graph) -> None:
    layers = layers_from_docs((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert upward(graph, layers) == []


def test_no_import_runs_back_up_inside_eval() -> None:
    """eval's own layering (engine and records at the bottom, episode sources above, protocols and
    runners, then the CLI): every import between its files, lazy ones included."""
    layers = inner_layers_from_docs((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"), "eval")
    assert inner_upward(file_imports(PACKAGE), "agentrefine_jax.eval", layers) == []


def test_print_exit_and_argparse_only_in_cli_modules() -> None:
    assert cli_only_calls(PACKAGE) == []


def test_parameter_names_live_in_the_table() -> None:
    from agentrefine_jax.models import params

    assert stray_parameter_names(PACKAGE, {p.path[-1] for p in params.TABLE}) == []


def test_functions_are_short() -> None:
    lengths = long_functions(PACKAGE)
    assert {k: n for k, n in lengths.items() if n > MAX_FUNCTION_LINES} == {}
    assert lengths["agentrefine_jax/train/step.py:build_steps"] <= 80


def test_eval_concepts_have_one_home() -> None:
    assert second_homes(PACKAGE, EVAL_ONE_HOME) == []


def test_lora_and_int8_are_decided_in_the_parameter_mode() -> None:
    assert stray_mode_branches(PACKAGE, MODE_BRANCH_HOMES) == []
    # Every home still decides something (a home that stopped branching leaves the list).
    found = mode_branches(PACKAGE)
    sites = {f for f, _, _ in found} | {f"{f}:{fn}" for f, fn, _ in found}
    assert sorted(set(MODE_BRANCH_HOMES) - sites) == []


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
    (pkg / "train" / "loop.py").write_text(
        "def start(fns, ref):\n    return fns.init_adapters(0) if ref is not None else fns.init_params(0)\n"
        "def save(cfg, params):\n    if cfg.train.lora.rank:\n        return params['a']\n"
        "    return [p for p in params if p != 'int8']\n"
    )
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
    assert stray_mode_branches(pkg, {"agentrefine_jax/train/loop.py:start": "planted home"}) == [
        "agentrefine_jax/train/loop.py:4: save",
        "agentrefine_jax/train/loop.py:6: save",
    ]
    # The last operand of an `and` chain is a test too.
    (pkg / "train" / "step.py").write_text(
        "def chunk(kv, p):\n    return kv is None and 'lora_key' not in p\n"
    )
    assert stray_mode_branches(pkg, {"agentrefine_jax/train/loop.py": "planted home"}) == [
        "agentrefine_jax/train/step.py:2: chunk"
    ]


def test_second_homes_are_found(tmp_path: pathlib.Path) -> None:
    """A source's own run_episodes wrapper and record, and a concept gone from its home, are found."""
    pkg = tmp_path / "agentrefine_jax"
    (pkg / "eval" / "agentboard").mkdir(parents=True)
    (pkg / "eval" / "core.py").write_text("class EpisodeJob:\n    pass\n")
    (pkg / "eval" / "agentboard" / "protocol.py").write_text(
        "def run_episodes():\n    pass\n\nclass EpisodeLog:\n    pass\n"
    )
    core = "agentrefine_jax/eval/core.py"
    homes = {"run_episodes": core, "EpisodeJob": core, "EpisodeLog": None}
    assert second_homes(pkg, homes) == [
        f"agentrefine_jax/eval/agentboard/protocol.py:1: run_episodes (its one home: {core})",
        "agentrefine_jax/eval/agentboard/protocol.py:4: EpisodeLog (retired)",
        f"{core}: run_episodes is no longer defined in its home",
    ]
    assert second_homes(pkg, {"EpisodeJob": core}) == []


def test_inner_layers_find_a_planted_upward_import(tmp_path: pathlib.Path) -> None:
    """A lazy import from eval's bottom into an episode source, and one into a runner that sits in a
    source's folder (`agentboard.runner`, its own unit), are found; a file with no layer fails."""
    pkg = tmp_path / "agentrefine_jax"
    (pkg / "eval" / "agentboard" / "tasks").mkdir(parents=True)
    for d in ("", "eval", "eval/agentboard", "eval/agentboard/tasks"):
        (pkg / d / "__init__.py").write_text("")
    (pkg / "eval" / "metrics.py").write_text("def f():\n    from .agentboard import protocol\n")
    (pkg / "eval" / "agentboard" / "protocol.py").write_text("from agentrefine_jax.eval import metrics\n")
    (pkg / "eval" / "agentboard" / "tasks" / "alfworld.py").write_text(
        "from agentrefine_jax.eval.agentboard.runner import run\n"
    )
    (pkg / "eval" / "agentboard" / "runner.py").write_text(
        "from agentrefine_jax.eval.agentboard import protocol\n"
    )
    layers = [["metrics"], ["agentboard"], ["agentboard.runner", "__init__"]]
    assert sorted(inner_upward(file_imports(pkg), "agentrefine_jax.eval", layers)) == [
        "agentrefine_jax/eval/agentboard/tasks/alfworld.py:1: agentboard (layer 1) imports"
        " agentboard.runner (layer 2)",
        "agentrefine_jax/eval/metrics.py:2: metrics (layer 0) imports agentboard (layer 1)",
    ]
    (pkg / "eval" / "stray.py").write_text("")
    with pytest.raises(AssertionError, match="stray"):
        inner_upward(file_imports(pkg), "agentrefine_jax.eval", layers)


def test_file_circles_are_found_inside_one_package(tmp_path: pathlib.Path) -> None:
    """Two files of one package importing each other, one lazily and relatively: a circle."""
    pkg = tmp_path / "agentrefine_jax"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "a.py").write_text("from agentrefine_jax.models import b\n")
    (pkg / "models" / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    (pkg / "models" / "c.py").write_text("from .b import f\n")
    assert circles(imports(pkg)) == []  # one unit: the package-level check cannot see it
    found = circles(file_imports(pkg))
    assert found in (
        [["agentrefine_jax.models.a", "agentrefine_jax.models.b", "agentrefine_jax.models.a"]],
        [["agentrefine_jax.models.b", "agentrefine_jax.models.a", "agentrefine_jax.models.b"]],
    )
    (pkg / "models" / "b.py").write_text("def f():\n    return 1\n")
    assert circles(file_imports(pkg)) == []
