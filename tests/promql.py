"""What a PromQL expression asks of the series it reads: the metric names it selects, the label
names it matches on ({label="..."}) and groups by (by/without/on/ignoring (...)), and the
functions it calls. Enough of PromQL for a dashboard's expressions; anything it does not know (an
unknown function, a selector without a metric name, an unbalanced bracket) is an error, so a
check built on it cannot pass by not understanding."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# PromQL's functions and operators, as word lists (one per line would be 60 lines).
FUNCTIONS = frozenset(
    """abs absent absent_over_time avg_over_time ceil changes clamp clamp_max clamp_min
    count_over_time day_of_month day_of_week delta deriv exp floor histogram_quantile holt_winters
    idelta increase irate label_join label_replace last_over_time ln log2 log10 max_over_time
    min_over_time predict_linear quantile_over_time rate resets round scalar sgn sort sort_desc
    sqrt stddev_over_time sum_over_time time timestamp vector""".split()  # noqa: SIM905
)
AGGREGATIONS = frozenset(
    "sum min max avg group stddev stdvar count count_values bottomk topk quantile".split()  # noqa: SIM905
)
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
OPERATORS = frozenset({"and", "or", "unless", "bool", "offset"})
# Grafana's variables, as the values Grafana puts there before Prometheus sees the expression.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range": "1h",
}

TOKEN = re.compile(
    r"""\s*(?:
      (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    | (?P<range>\[[^\]]*\])
    | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<number>[0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)
    | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^=<>(){},])
    )""",
    re.VERBOSE,
)


class PromQLError(ValueError):
    pass


@dataclass
class Query:
    """What one expression reads: metric -> label names matched in its selectors, the labels it
    groups by, and the functions it calls."""

    metrics: dict[str, set[str]] = field(default_factory=dict)
    grouping: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)


def substitute(expr: str) -> str:
    """Grafana's built-in variables replaced by values of their kind; $name dashboard variables
    appear only inside matcher strings here, where they are left as text."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def tokens(expr: str) -> list[tuple[str, str]]:
    found, at = [], 0
    expr = expr.rstrip()
    while at < len(expr):
        match = TOKEN.match(expr, at)
        if match is None or match.end() == at:
            raise PromQLError(f"cannot read {expr[at : at + 20]!r} in {expr!r}")
        kind = match.lastgroup or ""
        found.append((kind, match.group(kind)))
        at = match.end()
    return found


def parse(expr: str) -> Query:
    """The metrics, labels and functions of one expression (see the module docstring)."""
    query, items = Query(), tokens(substitute(expr))
    depth, i = 0, 0
    while i < len(items):
        kind, text = items[i]
        after = items[i + 1][1] if i + 1 < len(items) else None
        if kind == "name" and text in GROUPING and after == "(":
            labels, i = _label_list(items, i + 2, expr)
            query.grouping |= labels
            continue
        if kind == "name" and text in AGGREGATIONS and after in GROUPING:  # sum by (x) (...)
            query.functions.add(text)
        elif kind == "name" and after == "(":
            if text not in FUNCTIONS | AGGREGATIONS:
                raise PromQLError(f"unknown function {text!r} in {expr!r}")
            query.functions.add(text)
        elif kind == "name" and text not in OPERATORS and text not in GROUPING:
            labels = set()
            if after == "{":
                labels, i = _matchers(items, i + 2, expr)
                i -= 1
            query.metrics.setdefault(text, set()).update(labels)
        elif kind == "op" and text == "{":
            raise PromQLError(f"a selector without a metric name in {expr!r}")
        elif kind == "op" and text == "(":
            depth += 1
        elif kind == "op" and text == ")":
            depth -= 1
            if depth < 0:
                raise PromQLError(f"unbalanced ')' in {expr!r}")
        i += 1
    if depth:
        raise PromQLError(f"unbalanced '(' in {expr!r}")
    return query


def _label_list(items: list[tuple[str, str]], i: int, expr: str) -> tuple[set[str], int]:
    """Label names up to the closing ')': the index after it."""
    labels = set()
    while i < len(items) and items[i][1] != ")":
        kind, text = items[i]
        if kind == "name":
            labels.add(text)
        elif text != ",":
            raise PromQLError(f"{text!r} in a label list in {expr!r}")
        i += 1
    if i == len(items):
        raise PromQLError(f"unclosed label list in {expr!r}")
    return labels, i + 1


def _matchers(items: list[tuple[str, str]], i: int, expr: str) -> tuple[set[str], int]:
    """label op "value" pairs up to the closing '}': the index after it."""
    labels = set()
    while i < len(items) and items[i][1] != "}":
        if items[i][1] == ",":
            i += 1
            continue
        if i + 2 >= len(items):
            raise PromQLError(f"unclosed selector in {expr!r}")
        (kind, label), (_, op), (value_kind, _) = items[i : i + 3]
        if kind != "name" or op not in ("=", "!=", "=~", "!~") or value_kind != "string":
            raise PromQLError(f"cannot read a label matcher at {label!r} in {expr!r}")
        labels.add(label)
        i += 3
    if i == len(items):
        raise PromQLError(f"unclosed selector in {expr!r}")
    return labels, i + 1


LABEL_VALUES = re.compile(r"^label_values\(\s*(?:(?P<selector>.+?)\s*,\s*)?(?P<label>\w+)\s*\)$")


def parse_variable(query: str) -> Query:
    """A Grafana template variable's label_values(metric{...}, label) as the Query it makes."""
    match = LABEL_VALUES.match(query.strip())
    if match is None:
        raise PromQLError(f"not a label_values() query: {query!r}")
    parsed = parse(match.group("selector")) if match.group("selector") else Query()
    for labels in parsed.metrics.values():
        labels.add(match.group("label"))
    return parsed
