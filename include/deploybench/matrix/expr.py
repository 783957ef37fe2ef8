"""Constraints of a matrix: small expressions over parameter names, evaluated without ``eval``.

A constraint such as ``tensor_parallel_size * replicas <= gpus`` or
``not (max_num_seqs > 64 and load_rate < 2)`` rules combinations out. Whoever may trigger a
matrix may type one, so it is parsed with ``ast`` and walked by a tiny interpreter that knows
only arithmetic, comparisons, ``and``/``or``/``not``, ``in`` over literal lists, names and
literals. Anything else (calls, attributes, subscripts, lambdas, comprehensions, ``**``) is
refused when the matrix is planned, naming the construct, before any cell runs.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from deploybench.errors import ConfigError

MAX_LENGTH = 500
MAX_NODES = 200  # AST nodes: keeps one constraint cheap whatever is typed

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}
_LITERALS = (int, float, str, bool, type(None))


class ConstraintError(ConfigError):
    """A constraint that cannot be parsed or evaluated; names the constraint and what is wrong."""


class Constraint:
    """One parsed constraint; ``holds(names)`` evaluates it against a cell's parameter values."""

    def __init__(self, text: str):
        self.text = text
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError(f"constraint {text!r}: an empty constraint; write e.g. "
                                  "'tensor_parallel_size * replicas <= gpus'")
        if len(text) > MAX_LENGTH:
            raise ConstraintError(f"constraint {text[:40]!r}...: {len(text)} characters, at most {MAX_LENGTH}")
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError as exc:
            raise ConstraintError(f"constraint {text!r} is not an expression: {exc.msg}") from None
        nodes = list(ast.walk(tree))
        if len(nodes) > MAX_NODES:
            raise ConstraintError(f"constraint {text!r} is too long ({len(nodes)} parts, at most {MAX_NODES})")
        for node in nodes:
            self._check(node)
        self.tree = tree.body
        self.names = sorted({n.id for n in nodes if isinstance(n, ast.Name)})

    def _check(self, node: ast.AST) -> None:
        allowed = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.BinOp, ast.Compare, ast.Name,
                   ast.Load, ast.Constant, ast.List, ast.Tuple, *_BINARY, *_COMPARE, *_UNARY)
        if not isinstance(node, allowed):
            raise ConstraintError(
                f"constraint {self.text!r}: {type(node).__name__} is not allowed; use parameter names, numbers, "
                "strings, + - * / // %, comparisons, and/or/not and 'in [..]'")
        if isinstance(node, ast.Constant) and not isinstance(node.value, _LITERALS):
            raise ConstraintError(f"constraint {self.text!r}: the literal {node.value!r} is not allowed")

    def holds(self, names: dict[str, Any]) -> bool:
        unknown = [n for n in self.names if n not in names]
        if unknown:
            raise ConstraintError(f"constraint {self.text!r} names unknown parameter(s) {unknown}; known: "
                                  f"{', '.join(sorted(names))}")
        try:
            return bool(self._eval(self.tree, names))
        except (TypeError, ZeroDivisionError, OverflowError, ValueError) as exc:
            shown = ", ".join(f"{n}={names[n]!r}" for n in self.names)
            raise ConstraintError(f"constraint {self.text!r} cannot be evaluated with {shown}: {exc}") from None

    def _eval(self, node: ast.AST, names: dict[str, Any]) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return names[node.id]
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self._eval(e, names) for e in node.elts]
        if isinstance(node, ast.UnaryOp):
            return _UNARY[type(node.op)](self._eval(node.operand, names))
        if isinstance(node, ast.BinOp):
            a, b = self._eval(node.left, names), self._eval(node.right, names)
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
                raise TypeError(f"arithmetic needs numbers, got {a!r} and {b!r}")
            return _BINARY[type(node.op)](a, b)
        if isinstance(node, ast.BoolOp):
            values = (self._eval(v, names) for v in node.values)
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.Compare):
            left = self._eval(node.left, names)
            for op, right_node in zip(node.ops, node.comparators):
                right = self._eval(right_node, names)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        raise ConstraintError(f"constraint {self.text!r}: {type(node).__name__} is not allowed")  # _check stops it

    def __repr__(self) -> str:
        return f"Constraint({self.text!r})"
