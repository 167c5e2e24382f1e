"""The shape of the code: no import cycle inside worker/ or api_client/ (in-function and
TYPE_CHECKING imports count), so each module can be read without the ones that use it; no
module in worker/ over 450 lines, and one over 300 says why in its docstring."""

from __future__ import annotations

import ast

from tests.conftest import ROOT


def _imports() -> dict[str, set[str]]:
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts): path
        for package in ("worker", "api_client")
        for path in (ROOT / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            graph[name].update(f for f in found if f in modules and f != name)
    return graph


def test_no_import_cycles() -> None:
    graph = _imports()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        for dependency in sorted(graph[name]):
            assert dependency not in path, "import cycle: " + " -> ".join([*path, dependency])
            if dependency not in done:
                visit(dependency, [*path, dependency])
        done.add(name)

    for name in sorted(graph):
        visit(name, [name])


MAX_LINES, EXPLAINED_LINES = 450, 300


def _worker_modules() -> dict[str, tuple[int, str]]:
    """worker/*.py (the package's top level) -> (lines, module docstring on one line)."""
    found = {}
    for path in sorted((ROOT / "worker").glob("*.py")):
        text = path.read_text()
        docstring = " ".join((ast.get_docstring(ast.parse(text)) or "").split())
        found[str(path.relative_to(ROOT))] = (len(text.splitlines()), docstring)
    return found


def test_no_worker_module_is_over_450_lines() -> None:
    sizes = {name: lines for name, (lines, _) in _worker_modules().items()}
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert over == {}, f"over {MAX_LINES} lines, split along its seams: {over}"


def test_a_worker_module_over_300_lines_says_why() -> None:
    """As families.py and ladder.py do: "Over 300 lines because ..." in the module docstring."""
    silent = [
        f"{name} ({lines} lines)"
        for name, (lines, docstring) in _worker_modules().items()
        if lines > EXPLAINED_LINES and "300 lines" not in docstring
    ]
    assert silent == [], "say in the docstring why these are over 300 lines: " + ", ".join(silent)


def test_every_compose_service_restarts_on_failure() -> None:
    """A worker that exits non-zero (a lost device, a crash) comes back without an operator."""
    import yaml

    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    policies = {name: spec.get("restart") for name, spec in compose["services"].items()}
    assert all(p in ("on-failure", "unless-stopped", "always") for p in policies.values()), policies
