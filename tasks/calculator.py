"""The calculator task: the `calculator` tool (--tools calculator, with any dataset:
recipes/gsm8k_calculator.sh gives it to GSM8K), and a dataset the tiny model cannot do
without it (benchmarks/tool_task.py): "What is 47 multiplied by 8?", a 2-digit number
plus, minus, multiplied by or divided by a digit, results of up to three digits, scored
by GSM8K's rewards on the last answer (tasks/gsm8k.py)."""

import ast
import operator
import random

from tasks import gsm8k

SYSTEM_PROMPT = gsm8k.SYSTEM_PROMPT
REWARDS, METRICS = gsm8k.REWARDS, gsm8k.METRICS

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _arithmetic(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_arithmetic(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise ValueError("exponent too large")
        return OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / // % ** and parentheses."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _arithmetic(ast.parse(expression.strip(), mode="eval").body)  # no names, calls or attributes
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


TOOLS = {"calculator": calculator}

# One character per operator: with "**" for a power, "*" would start the right call for
# half the questions, and GRPO raised it for all of them before it learned which. With
# "times", the policy settled on "-" for it as for "minus" and stayed there (0.71).
WORDS = {"+": "plus", "-": "minus", "*": "multiplied by", "/": "divided by"}
SPLITS = {"train": 4096, "test": 256}  # drawn in this order from one stream, seed 1


def problem(rng):
    """One record: the question, its answer as '#### N', and its two numbers a and b."""
    op = rng.choice(list(WORDS))
    a, b = rng.randint(10, 99), rng.randint(2, 9)
    if op == "/":
        a = b * rng.randint(10, 99 // b)  # a whole quotient, and operands as short as the others'
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    return {"question": f"What is {a} {WORDS[op]} {b}?", "answer": f"#### {value}", "a": a, "b": b}


def rows(split):
    """--dataset calculator: 4096 train records, then 256 test ones, the same every time."""
    rng = random.Random(1)
    drawn = {s: [problem(rng) for _ in range(n)] for s, n in SPLITS.items()}
    return drawn[split]
