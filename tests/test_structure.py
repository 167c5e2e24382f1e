"""The shape of the code: no import cycle inside worker/ or api_client/ (in-function and
TYPE_CHECKING imports count), so each module can be read without the ones that use it."""

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


def test_every_compose_service_restarts_on_failure() -> None:
    """A worker that exits non-zero (a lost device, a crash) comes back without an operator."""
    import yaml

    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    policies = {name: spec.get("restart") for name, spec in compose["services"].items()}
    assert all(p in ("on-failure", "unless-stopped", "always") for p in policies.values()), policies
