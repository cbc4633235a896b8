"""Tools: a ready environment (episodes.py) that runs the functions the model calls.
`--tools calculator,my_tools:search` lists them: each a plain function with type hints
and a docstring, turned into the JSON schema a chat template receives (`tools=`).

Calls are recognised in the Hermes format that Qwen2.5's template teaches,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the model's last
answer, every one of them; their results come back as one message in the role "tool",
one line each. A call that does not parse, names no known tool or raises gets an error
line as its result, which the model can learn from. An answer without a call ends the
episode. A template that renders no tools (a plain ChatML one, as SmolLM2's) gets the
schemas and the call format in its system prompt instead (tools_prompt).

The environment runs in the workers of episodes.py, which read the tool list from the
GRPO_TOOLS variable the sampler sets (they start as `python rewards.py SPEC`)."""

import ast
import inspect
import json
import operator
import os
import re

import sandbox
from plugins import load_function

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
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


def python(code: str) -> str:
    """Run a Python program and return what it printed (or its error)."""
    result = sandbox.run(code, timeout=5.0)  # in the sandbox: the model wrote it
    printed = result["stdout"][-2000:]
    return printed if result["error"] is None else f"{printed}error: {result['error']}"


BUILTIN = {"calculator": calculator, "python": python}


def load_tools(spec):
    """[fn] from 'calculator,module:function,...'. Raises ValueError: unknown, or without
    the type hints and docstring a schema is made of."""
    tools = []
    for name in filter(None, (s.strip() for s in spec.split(","))):
        fn = BUILTIN[name] if name in BUILTIN else load_function(name, "tool")
        schema(fn)  # raises where it has none
        tools.append(fn)
    if not tools:
        raise ValueError("no tool given")
    return tools


def schema(fn):
    """The JSON schema of a function from its signature and docstring."""
    if not inspect.getdoc(fn):
        raise ValueError(f"tool {fn.__name__} has no docstring to describe it")
    properties, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        if p.annotation not in JSON_TYPES:
            raise ValueError(f"tool {fn.__name__}'s parameter {name} needs a type hint: str, int, float or bool")
        properties[name] = {"type": JSON_TYPES[p.annotation]}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    description = inspect.getdoc(fn).split("\n\n")[0].replace("\n", " ")
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": fn.__name__, "description": description, "parameters": parameters}}


def tools_prompt(tools):
    """The instruction for a template that renders no tools: the schemas and the format."""
    return (
        "You can call these tools:\n"
        + "\n".join(json.dumps(schema(fn)) for fn in tools)
        + '\nTo call one, write <tool_call>{"name": <tool name>, "arguments": {<arguments>}}</tool_call>;'
        " its result comes back in the next message."
    )


def call(tools, raw):
    """One call's result line, or an error line the model can read."""
    try:
        request = json.loads(raw)
        fn = {fn.__name__: fn for fn in tools}[request["name"]]
        return str(fn(**request.get("arguments", {})))
    except KeyError as e:
        return f"error: no tool or field {e}"
    except Exception as e:  # a malformed call, bad arguments, or the tool raised
        return f"error: {type(e).__name__}: {e}"


def use_tools(record, turns):
    """The environment --tools runs: the results of every call in the last answer, or None."""
    calls = CALL.findall(turns[-1]["content"])
    if not calls:
        return None
    tools = load_tools(os.environ["GRPO_TOOLS"])
    return {"role": "tool", "content": "\n".join(call(tools, raw) for raw in calls)}
