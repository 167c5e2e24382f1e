"""The shape of the code, as worker/__init__.py states it: packages by stage with imports one way
(in-function and TYPE_CHECKING imports count, at any depth), no import cycle, no kiln mixins, and
a module's length explained by its docstring once it passes 400 lines."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

from tests.conftest import ROOT
from worker import ENTRY_POINTS, STAGES


def _modules() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for package in ("worker", "api_client")
        for path in (ROOT / package).rglob("*.py")
    }


def _imports() -> dict[str, set[str]]:
    """module -> the kiln modules it imports, wherever in the module the import stands."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                # `from package import module` depends on the module; anything else on base.
                found = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            graph[name].update(f for f in found if f in modules and f != name)
    return graph


def stage_of(module: str) -> str:
    """'entry', 'ground', one of STAGES, or 'api_client'."""
    parts = module.split(".")
    if parts[0] == "api_client":
        return "api_client"
    if len(parts) == 1:
        return "ground"  # worker/__init__.py itself: the order, no imports
    if parts[1] in STAGES and (len(parts) > 2 or module in _packages()):
        return parts[1]
    return "entry" if parts[1] in ENTRY_POINTS else "ground"


def _packages() -> set[str]:
    return {f"worker.{s}" for s in STAGES}


def may_import(importer: str, imported: str) -> bool:
    """Entry points import anything; a stage imports its own, the stages after it and the
    ground; the ground imports only the ground; api_client imports no worker module."""
    a, b = stage_of(importer), stage_of(imported)
    if b == "api_client" or a == "entry":
        return True
    if a == "api_client":
        return False
    if b == "entry":
        return False
    if a == "ground":
        return b == "ground"
    return b == "ground" or STAGES.index(b) >= STAGES.index(a)


def test_imports_run_one_way_between_stages() -> None:
    wrong = sorted(
        f"{importer} ({stage_of(importer)}) imports {imported} ({stage_of(imported)})"
        for importer, imported_set in _imports().items()
        for imported in imported_set
        if not may_import(importer, imported)
    )
    assert wrong == [], f"stages in order {' -> '.join(STAGES)}:\n" + "\n".join(wrong)


def test_every_worker_module_is_in_a_stage_or_named_at_the_root() -> None:
    """A new module lands in a stage's package; the root holds only entry points (a module, or a
    package such as cli/, one module per audience) and ground."""
    ground = {"settings", "errors", "logs", "quiet", "manifest", "profiles", "startup", "crashes"}
    root = {p.stem for p in (ROOT / "worker").glob("*.py")} - {"__init__"}
    assert root <= set(ENTRY_POINTS) | ground, root - set(ENTRY_POINTS) - ground
    packages = {p.name for p in (ROOT / "worker").iterdir() if p.is_dir()} - {"__pycache__"}
    assert packages - set(ENTRY_POINTS) == set(STAGES), packages - set(ENTRY_POINTS)


@pytest.mark.parametrize(
    ("importer", "imported", "allowed"),
    [
        ("worker.queue.worker", "worker.render.renderer", True),
        ("worker.render.renderer", "worker.queue.upkeep.webhooks", False),
        ("worker.memory.ladder", "worker.pipelines.families", False),
        ("worker.pipelines.loading", "worker.memory.ladder", True),
        ("worker.settings", "worker.memory.device", False),
        ("worker.crashes", "worker.memory.rungs", False),
        ("worker.render.renderer", "worker.crashes", True),
        ("worker.queue.claim", "worker.queue.upkeep.quarantine", True),
        ("worker.cli", "worker.ops.doctor", True),
        ("worker.ops.doctor", "worker.cli", False),
        ("api_client.client", "worker.settings", False),
        ("worker.pipelines.tiny.sd", "worker.pipelines.families", True),
    ],
)
def test_the_rule_itself(importer: str, imported: str, allowed: bool) -> None:
    """The check above would pass on an empty graph; this holds the rule it applies."""
    assert may_import(importer, imported) is allowed


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


def _kiln_classes() -> dict[str, tuple[str, list[str]]]:
    """class name -> (module, names of its bases), for every class defined in worker/."""
    found: dict[str, tuple[str, list[str]]] = {}
    for name, path in _modules().items():
        if not name.startswith("worker"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
                found[node.name] = (name, bases)
    return found


def test_no_kiln_class_shares_code_through_another_kiln_base() -> None:
    """Collaborators are objects handed in, not mixins: only kiln's exceptions (worker/errors.py
    and their kin) subclass a kiln class, to be caught as their kind."""
    classes = _kiln_classes()

    def is_exception(name: str, seen: frozenset[str] = frozenset()) -> bool:
        builtin = getattr(builtins, name, None)
        if isinstance(builtin, type) and issubclass(builtin, BaseException):
            return True
        module_bases = classes.get(name)
        return bool(module_bases) and any(
            b not in seen and is_exception(b, seen | {name}) for b in module_bases[1]
        )

    mixed = sorted(
        f"{module}.{name}({', '.join(bases)})"
        for name, (module, bases) in classes.items()
        for base in bases
        if base in classes and not is_exception(name)
    )
    assert mixed == [], "kiln classes with kiln bases: " + ", ".join(mixed)


LONG, MOST = 400, 600


def _sizes() -> dict[str, tuple[int, str]]:
    """worker/**/*.py -> (lines, module docstring on one line)."""
    found = {}
    for path in sorted((ROOT / "worker").rglob("*.py")):
        text = path.read_text()
        docstring = " ".join((ast.get_docstring(ast.parse(text)) or "").split())
        found[str(path.relative_to(ROOT))] = (len(text.splitlines()), docstring)
    return found


def test_no_worker_module_passes_600_lines() -> None:
    over = {name: n for name, (n, _) in _sizes().items() if n > MOST}
    assert over == {}, f"over {MOST} lines: {over}"


def test_a_module_over_400_lines_says_why() -> None:
    """Cohesion decides a module's size, not a count; past 400 lines its docstring says
    "Over N lines because ..."."""
    silent = [
        f"{name} ({lines} lines)"
        for name, (lines, docstring) in _sizes().items()
        if lines > LONG and f"Over {LONG} lines because" not in docstring
    ]
    assert silent == [], f'say "Over {LONG} lines because ..." in: ' + ", ".join(silent)


def test_every_compose_service_restarts_on_failure() -> None:
    """A worker that exits non-zero (a lost device, a crash) comes back without an operator."""
    import yaml

    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    policies = {name: spec.get("restart") for name, spec in compose["services"].items()}
    assert all(p in ("on-failure", "unless-stopped", "always") for p in policies.values()), policies
