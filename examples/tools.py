"""Tools for agentic GRPO (`--tools examples/tools.py:calculator`): plain functions with type hints
and a docstring whose Args section describes each argument; the chat template shows the model their
JSON schema, and what a call returns goes back to it as the tool's message.

    lora-tune train --objective grpo --base MODEL --data examples/data/arithmetic.jsonl \
        --tools examples/tools.py:calculator --reward examples/rewards.py:correct --max-tool-calls 2 ...
"""

import ast
import operator

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
}


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand))
    raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression of numbers, + - * / // % and parentheses.

    Args:
        expression: the expression, e.g. "37 * 12 + 4"
    """
    result = _value(ast.parse(expression, mode="eval").body)
    return str(int(result) if float(result).is_integer() else round(result, 6))
