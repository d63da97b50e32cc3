"""The comparisons of a ``when`` (``==``, ``!=``, ``in``), found by parsing it, and the ``when`` rewritten so that a
run reports the values each one compares (:func:`instrumented`).

The CEL runtime answers ``false`` for ``==`` between values of two types (``inj.noul == "0.9"``, a query
parameter's list ``== "free"``) and ``true`` for ``!=``, where ``<`` raises; the load-time rule check
(``guard/policy/rule_check.py``) runs the rewritten ``when`` on sample values to see such comparisons. The parser
reads CEL's grammar (conditional, ``||``, ``&&``, relations, ``+ -``, ``* / %``, unary ``! -``, members, indexes,
calls, lists, maps, literals); a ``when`` using anything else (message construction ``T{...}``) is not rewritten.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from guard.policy.rules import LITERAL_RE

__all__ = ["RECORD", "Comparison", "instrumented"]

#: The function the rewritten ``when`` calls before each comparison: ``RECORD(index, left, right)``, returning true.
RECORD = "guard_compared"
#: CEL's type names and ``type(...)``: the runtime hands a type to a Python function as its name, a string, so a
#: comparison with one (``type(x) == string``) is not rewritten.
_TYPE_OPERAND = re.compile(r"(?:bool|int|uint|double|string|bytes|list|map|null_type|type)$|type\(")
_TOKEN = re.compile(
    r"(?P<number>0[xX][0-9a-fA-F]+[uU]?|(?:\d+\.\d*|\.\d+)(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+[uU]?)"
    r"|(?P<name>[A-Za-z_]\w*)"
    r"|(?P<op>==|!=|<=|>=|&&|\|\||[-+*/%<>!?:.,()\[\]{}])"
)
_RELATIONS = ("==", "!=", "<", "<=", ">", ">=", "in")
_CHECKED = ("==", "!=", "in")


@dataclass(frozen=True)
class Comparison:
    """One relation of a ``when`` (``==``, ``!=``, ``in``, ``<``, ``<=``, ``>``, ``>=``): its operands as written
    (tokens joined by spaces)."""

    left: str
    op: str
    right: str

    def __str__(self) -> str:
        return f"{self.left} {self.op} {self.right}"

    @property
    def recorded(self) -> bool:
        """Whether the rewritten ``when`` reports its values: an ``==``, ``!=`` or ``in`` without a type operand."""
        return self.op in _CHECKED and not (_TYPE_OPERAND.match(self.left) or _TYPE_OPERAND.match(self.right))


class _Unreadable(Exception):
    """The parser does not read this ``when`` (it compiled: a syntax the parser does not know)."""


def _tokens(source: str) -> list[str]:
    out: list[str] = []
    at = 0
    while at < len(source):
        if source[at].isspace():
            at += 1
            continue
        literal = LITERAL_RE.match(source, at)
        if literal is not None:
            if not literal.group(0).startswith("//"):
                out.append(literal.group(0))
            at = literal.end()
            continue
        token = _TOKEN.match(source, at)
        if token is None:
            raise _Unreadable(source[at])
        out.append(token.group(0))
        at = token.end()
    return out


class _Parser:
    """Recursive descent over CEL's grammar; each rule returns ``(raw, text)``: the operand as written and as
    rewritten (each checked comparison in a conditional on :data:`RECORD`)."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.at = 0
        self.comparisons: list[Comparison] = []

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise _Unreadable(f"expected {expected!r}, found {token!r}")
        self.at += 1
        return token

    def expr(self) -> tuple[str, str]:
        raw, text = self.binary(0)
        if self.peek() != "?":
            return raw, text
        self.take("?")
        then_raw, then_text = self.expr()
        self.take(":")
        else_raw, else_text = self.expr()
        return f"{raw} ? {then_raw} : {else_raw}", f"{text} ? {then_text} : {else_text}"

    _LEVELS = (("||",), ("&&",), _RELATIONS, ("+", "-"), ("*", "/", "%"))

    def binary(self, level: int) -> tuple[str, str]:
        if level == len(self._LEVELS):
            return self.unary()
        raw, text = self.binary(level + 1)
        while self.peek() in self._LEVELS[level]:
            op = self.take()
            right_raw, right_text = self.binary(level + 1)
            comparison = Comparison(raw, op, right_raw) if op in _RELATIONS else None
            if comparison is not None:
                self.comparisons.append(comparison)
            if comparison is not None and comparison.recorded:
                index = len(self.comparisons) - 1
                text = f"({RECORD}({index}, {raw}, {right_raw}) ? ({text}) {op} ({right_text}) : false)"
            else:
                text = f"{text} {op} {right_text}"
            raw = f"{raw} {op} {right_raw}"
        return raw, text

    def unary(self) -> tuple[str, str]:
        if self.peek() in ("!", "-"):
            op = self.take()
            raw, text = self.unary()
            return op + raw, op + text
        return self.member()

    def member(self) -> tuple[str, str]:
        raw, text = self.primary()
        while self.peek() in (".", "["):
            if self.take() == ".":
                name = self.take()
                raw, text = f"{raw}.{name}", f"{text}.{name}"
                if self.peek() == "(":
                    self.take("(")
                    args_raw, args_text = self.items(")")
                    raw, text = f"{raw}({args_raw})", f"{text}({args_text})"
            else:
                index_raw, index_text = self.expr()
                self.take("]")
                raw, text = f"{raw}[{index_raw}]", f"{text}[{index_text}]"
        return raw, text

    def primary(self) -> tuple[str, str]:
        token = self.take()
        if token == "(":
            raw, text = self.expr()
            self.take(")")
            return f"({raw})", f"({text})"
        if token == "[":
            raw, text = self.items("]")
            return f"[{raw}]", f"[{text}]"
        if token == "{":
            raw, text = self.items("}", pairs=True)
            return f"{{{raw}}}", f"{{{text}}}"
        if token == ".":
            token = "." + self.take()
        if token[-1].isalnum() or token[-1] in "_\"'":
            if re.fullmatch(r"\.?[A-Za-z_]\w*", token) and self.peek() == "(":
                self.take("(")
                raw, text = self.items(")")
                return f"{token}({raw})", f"{token}({text})"
            if self.peek() == "{":
                raise _Unreadable("message construction")
            return token, token
        raise _Unreadable(token)

    def items(self, closing: str, *, pairs: bool = False) -> tuple[str, str]:
        """A call's arguments, a list's items or a map's ``key: value`` entries after their opening bracket, up to
        and including ``closing`` (a trailing comma allowed)."""
        raws: list[str] = []
        texts: list[str] = []
        while self.peek() != closing:
            raw, text = self.expr()
            if pairs:
                self.take(":")
                value_raw, value_text = self.expr()
                raw, text = f"{raw}: {value_raw}", f"{text}: {value_text}"
            raws.append(raw)
            texts.append(text)
            if self.peek() != closing:
                self.take(",")
        self.take(closing)
        return ", ".join(raws), ", ".join(texts)


def instrumented(source: str) -> tuple[str, tuple[Comparison, ...]] | None:
    """``source`` with each :attr:`~Comparison.recorded` comparison ``A op B`` written
    ``(guard_compared(i, A, B) ? (A') op (B') : false)``, ``i`` its index in the returned comparisons (every
    relation of ``source``, in the order the parser ends them) and ``A'``, ``B'`` the operands rewritten: the same
    value on every input, or the same error (``A`` and ``B`` are evaluated by the comparison anyway). ``None`` when
    ``source`` has no relation or the parser does not read it, or nests deeper than Python's stack lets the parser
    recurse (about ten frames per bracket: 90 nested brackets, which a ``when`` may have, can pass the limit)."""
    try:
        parser = _Parser(_tokens(source))
        _, text = parser.expr()
        if parser.peek() is not None:
            raise _Unreadable(parser.peek())
    except (_Unreadable, RecursionError):
        return None
    return (text, tuple(parser.comparisons)) if parser.comparisons else None
