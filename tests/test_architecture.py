"""The package's shape: no import cycle inside ``etp/`` (imports inside functions included), no
file above 600 lines, and the ETP engine at the top level knows nothing of ``etp.ep``.

The graph is built from the source (``ast``), not by importing, so a cycle hidden behind a
call-time import is found as well.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "etp"
MAX_LINES = 600


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


def test_no_file_above_600_lines():
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
