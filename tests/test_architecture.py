"""The package's shape: no import cycle inside ``etp/`` (imports inside functions included),
imports that flow one way (the core imports no integration wing; only ``etp/jax`` imports JAX
and it imports no torch), ``import etp`` loading nothing, alarms on runaway file and function
lengths, and no development history in the code.

The graph is built from the source (``ast``), not by importing, so a cycle hidden behind a
call-time import is found as well.
"""
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "etp"
#: Alarms against runaway growth, well above what a cohesive module or function needs.
MAX_LINES = 800
MAX_FUNCTION_LINES = 120


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """module -> the etp modules it imports (anywhere in the file)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve(name, path, node)
            else:
                continue
            for target in targets:
                # Importing a.b.c runs a/__init__ and a/b/__init__ first: those are edges too.
                parts = target.split(".")
                edges.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        graph[name] = {t for t in edges if t in modules and t != name}
    return graph


def _package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # A package's __init__ importing its own submodules is how packages work, not a cycle.
    return {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_inside_etp():
    graph = _package_edges(import_graph())
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_cycle_finder_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_file_above_the_alarm():
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"split these files by job: {long}"


def test_engine_does_not_know_expert_parallelism():
    graph = import_graph()
    engine = [m for m in graph if m.count(".") == 1 and not (ROOT / m.split(".")[1]).is_dir()]
    assert engine, "no top-level engine modules found"
    offenders = {m: sorted(t for t in graph[m] if t == "etp.ep" or t.startswith("etp.ep."))
                 for m in engine}
    assert not any(offenders.values()), offenders


#: The rooms above the engine, lowest first. A module imports the engine (``etp/*.py`` and its
#: parts: kernels, transport, cache, formats) and rooms at or below its own, never one above:
#: recipes are plain Python beneath the audit and the trainer, the megatron-core integration
#: builds on expert parallelism, and the trainer (with its commands) sits on top of everything.
ROOMS = ("etp.recipe", "etp.audit", "etp.ep", "etp.data", "etp.megatron", "etp.hf", "etp.train")
#: JAX's room stands apart: it imports no torch, so nothing of the rest.
APART = ("etp.jax",)


def _room(module: str) -> str | None:
    return next((r for r in ROOMS + APART if module == r or module.startswith(r + ".")), None)


def _rank(room: str | None) -> int:
    return -1 if room is None else ROOMS.index(room) if room in ROOMS else len(ROOMS)


def is_alias(source: str) -> bool:
    """A deprecated alias module (``etp/_moved.py``): a docstring, ``from etp._moved import
    forward``, ``__getattr__ = forward(...)`` and at most the ``__main__`` block of a command."""
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    kinds = [type(node).__name__ for node in body]
    return (kinds[:2] == ["ImportFrom", "Assign"] and body[0].module == "etp._moved"
            and [t.id for t in body[1].targets] == ["__getattr__"] and kinds[2:] in ([], ["If"]))


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """module -> the room modules it imports above its own room (the engine counts as below
    every room; JAX's room and the others import nothing of each other)."""
    found = {}
    for module, targets in graph.items():
        own = _room(module)
        bad = sorted(t for t in targets if _room(t) not in (None, own)
                     and (own in APART or _room(t) in APART or _rank(_room(t)) > _rank(own)))
        if bad:
            found[module] = bad
    return found


def _graph_without_aliases() -> dict[str, set[str]]:
    aliases = {m for m, p in _modules().items() if is_alias(p.read_text(encoding="utf-8"))}
    return {m: ts - aliases for m, ts in import_graph().items() if m not in aliases}


def test_imports_flow_one_way():
    assert upward_imports(_graph_without_aliases()) == {}


def test_upward_import_finder_can_fail():
    graph = {"etp.wrap": {"etp.megatron.layers"}, "etp.megatron.model": {"etp.ep.config", "etp.wrap"},
             "etp.ep.config": {"etp.audit"}, "etp.audit.predict": {"etp.recipe", "etp.train.auto"},
             "etp.jax.ep": {"etp.ep"}, "etp.recipe.schema": {"etp.config"}}
    assert upward_imports(graph) == {"etp.wrap": ["etp.megatron.layers"], "etp.audit.predict": ["etp.train.auto"],
                                     "etp.jax.ep": ["etp.ep"]}


def test_aliases_hold_nothing_but_the_alias():
    assert is_alias('"""doc"""\nfrom etp._moved import forward\n__getattr__ = forward(__name__, "etp.x")\n')
    assert not is_alias('from etp._moved import forward\n__getattr__ = forward(__name__, "etp.x")\ndef f(): pass\n')
    aliases = [m for m, p in _modules().items() if "from etp._moved import" in p.read_text(encoding="utf-8")]
    assert aliases, "no alias modules found"
    for module in aliases:
        if module not in ("etp._moved", "etp.megatron"):  # etp.megatron keeps its own code, forwards two names
            assert is_alias(_modules()[module].read_text(encoding="utf-8")), module


def _third_party_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_jax_wing_imports_jax_and_it_imports_no_torch():
    for path in ROOT.rglob("*.py"):
        names = _third_party_imports(path)
        if "jax" in path.relative_to(ROOT).parts[:1]:
            assert "torch" not in names, path
        else:
            assert "jax" not in names, path


def test_import_etp_loads_no_wing_and_no_torch():
    code = ("import sys, etp; print(sorted(m for m in sys.modules "
            "if m == 'torch' or (m.startswith('etp.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    code = ("import sys, etp; etp.wrap_module_params_etp; print(sorted({m.split('.')[1] for m in sys.modules "
            "if m.startswith('etp.')} & {'megatron', 'audit', 'ep', 'jax'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - first + 1
            if length > limit:
                found[f"{node.name}:{node.lineno}"] = length
    return found


def test_no_function_above_the_alarm():
    long = {str(p.relative_to(ROOT.parent)): f for p in ROOT.rglob("*.py")
            if (f := long_functions(p.read_text(encoding="utf-8")))}
    assert not long, f"split these functions: {long}"


def test_function_length_finder_can_fail():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    assert long_functions(f"def f():\n{body}\n") == {"f:1": MAX_FUNCTION_LINES + 2}


#: Development history: rounds, step letters and dated figures belong in BENCHMARKS.md and git.
HISTORY = re.compile(r"\bsession \d+|\bstep \([a-z]{1,2}\)|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)


def test_no_development_history_in_the_code():
    found = {str(p.relative_to(ROOT.parent)): m.group(0) for p in ROOT.rglob("*.py")
             if (m := HISTORY.search(p.read_text(encoding="utf-8")))}
    assert not found, found
