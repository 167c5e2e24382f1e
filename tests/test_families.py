"""A family is one row of api_client.families.FAMILIES (what the client and the worker ask of it)
and, for a pipeline, one FamilySpec in worker.pipelines.families.SPECS (its pipeline classes).
The two rows agree, and nothing in worker/ or api_client/ keeps a family table of its own or
compares a family's name: code asks the row."""

from __future__ import annotations

import ast
from typing import get_args

from api_client.families import FAMILIES, Family
from tests.conftest import ROOT
from worker.pipelines.families import SPECS, tiny_models

NAMES = frozenset(get_args(Family))
# The modules that may hold a family table: the row's and the worker's.
TABLES = {"api_client/families.py", "worker/pipelines/families.py"}
MOST_COMPARISONS = 2  # issue 37: at most two comparisons against a family name remain


def _sources() -> dict[str, ast.Module]:
    return {
        str(path.relative_to(ROOT)): ast.parse(path.read_text())
        for package in ("worker", "api_client")
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def _names_in(node: ast.AST) -> set[str]:
    return {
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in NAMES
    }


def _is_family(node: ast.expr) -> bool:
    """`family`, `x.family`, or `x.get("family")`: a family's name."""
    if isinstance(node, ast.Name):
        return node.id == "family"
    if isinstance(node, ast.Attribute):
        return node.attr == "family"
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and [ast.unparse(a) for a in node.args[:1]] == ["'family'"]
    )


def family_comparisons(tree: ast.Module) -> list[str]:
    """Comparisons against a family's name: a name as a literal on either side (`== "upscaler"`,
    `in ("sd15", "sdxl")`, whatever the other side), or a family compared by == or != or with
    `in` a literal collection."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literal = any(
            _names_in(o) and isinstance(o, ast.Constant | ast.Tuple | ast.List | ast.Set)
            for o in operands
        )
        by_name = any(_is_family(o) for o in operands) and any(
            isinstance(op, ast.Eq | ast.NotEq)
            or (
                isinstance(op, ast.In | ast.NotIn)
                and isinstance(node.comparators[0], ast.Tuple | ast.List | ast.Set)
            )
            for op in node.ops
        )
        if literal or by_name:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def family_tables(tree: ast.Module) -> list[str]:
    """Module-level names bound to two or more family names (a dict keyed by them, a tuple of
    them, the Family alias itself)."""
    found = []
    for node in tree.body:
        if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
            continue
        if len(_names_in(node.value)) >= 2:
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            found.append(ast.unparse(target))
    return found


def test_family_tables_live_in_two_modules() -> None:
    tables = {path: names for path, tree in _sources().items() if (names := family_tables(tree))}
    assert set(tables) <= TABLES, {p: n for p, n in tables.items() if p not in TABLES}
    assert "Family" in tables["api_client/families.py"]  # the alias beside its table


def test_code_asks_a_family_s_row_never_its_name() -> None:
    compared = [
        f"{path} {where}" for path, tree in _sources().items() for where in family_comparisons(tree)
    ]
    assert len(compared) <= MOST_COMPARISONS, "\n".join(compared)


def test_the_checks_find_what_they_look_for() -> None:
    """The two checks above would pass on code they cannot read; these hold what they count."""
    counted = family_comparisons(
        ast.parse(
            'a == "upscaler"\n"upscaler" != m.kind\nfamily in ("sd15", "sdxl")\n'
            "m.family == other\nx.get('family') != y\nfamily in TABLE\nmode == 'edit'\n"
        )
    )
    assert len(counted) == 5, counted
    tables = family_tables(
        ast.parse('A = {"sd15": 8, "flux": 16}\nB = ("sd2", "zimage")\nC = {"x": 1}\n')
    )
    assert tables == ["A", "B"]


def test_every_family_has_one_row_and_every_pipeline_family_its_spec() -> None:
    """The row and the worker's spec agree: modes, edit model, ControlNet modes."""
    assert set(FAMILIES) == NAMES
    assert all(row.name == name for name, row in FAMILIES.items())
    pipelines = {name for name, row in FAMILIES.items() if not row.weights_files}
    assert set(SPECS) == pipelines
    for name, spec in SPECS.items():
        row = FAMILIES[name]
        resident = "txt2video" if row.video else "txt2img"  # the resident pipeline's mode
        derived = {resident, *spec.modes, *(["edit"] if spec.edit is not None else [])}
        assert set(row.modes) == derived, name
        assert bool(row.edit_modes) == (spec.edit is not None), name
        rule = row.control_rule
        served = set(spec.control.pipelines) if spec.control is not None else set()
        assert served == set(rule.modes if rule is not None else ()), name


def test_every_family_brings_its_tiny_model_in_its_row() -> None:
    """A family's tiny builder, TAESD and ControlNets are its worker row's (FamilySpec.tiny, or a
    weights-file family's in WEIGHTS_FILE_TINIES): each family has one, and ControlNets only
    where its spec runs them."""
    tinies = tiny_models()
    served = {spec.tiny.name for spec in SPECS.values() if spec.tiny is not None}
    assert NAMES - {"sd2"} <= set(tinies) and served <= set(tinies)  # sd2 renders with sd15's
    assert SPECS["sd2"] is SPECS["sd15"]
    for name, (tiny, spec) in tinies.items():
        assert tiny.name == name and "." in tiny.builder, name
        if tiny.controlnets:
            assert spec is not None and spec.control is not None, name
    assert tinies["flux-kontext"][1] is SPECS["flux"].edit


def test_a_family_s_differences_are_its_rows_attributes() -> None:
    """What the upscaler does differently is its row's: a file, tiles, no prompt, fixed fields."""
    upscaler, sd15 = FAMILIES["upscaler"], FAMILIES["sd15"]
    assert (upscaler.prompted, sd15.prompted) == (False, True)
    assert upscaler.weights_files and not sd15.weights_files
    assert upscaler.tiles and not sd15.tiles
    assert "steps" in upscaler.foreign and "scale" in sd15.foreign
    packed = ["flux", "flux2", "qwenimage", "ltx"]
    assert [n for n, r in FAMILIES.items() if r.packed_latents] == packed
    # A video family's frame rule is its row's: its VAE's compression in time, plus one.
    wan, ltx = FAMILIES["wan"], FAMILIES["ltx"]
    assert (wan.frame_step, ltx.frame_step, sd15.frame_step) == (4, 8, 0)
    assert [n for n in (1, 5, 9, 17, 33) if wan.frames_refusal(n) is None] == [1, 5, 9, 17, 33]
    assert [n for n in (1, 9, 17, 25, 33) if ltx.frames_refusal(n) is None] == [1, 9, 17, 25, 33]
    assert "4k+1" in str(wan.frames_refusal(8)) and "8k+1" in str(ltx.frames_refusal(13))
    assert sd15.frames_refusal(10) is None  # an image family has no frame rule: resolve refuses


def test_no_api_client_module_passes_600_lines() -> None:
    """The client's modules stay under the sanity limit too (the worker's: tests/test_structure.py):
    api_client/manifest.py passed it while it held the family tables."""
    over = {
        str(path.relative_to(ROOT)): lines
        for path in (ROOT / "api_client").rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > 600
    }
    assert over == {}
