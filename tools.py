"""Tools: a ready environment (episodes.py) that runs the functions the model calls.
`--tools calculator,my_tools:search` lists them: each a plain function with type hints
and a docstring, turned into the JSON schema a chat template receives (`tools=`). A name
is `python` (here), a tool of the tasks (their TOOLS: `calculator`, tasks/calculator.py;
resolved as tasks/__init__.py says), or module:function.

Calls are recognised in the Hermes format that Qwen2.5's template teaches,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the model's last
answer, every one of them; their results come back as one message in the role "tool",
one line each. A call that does not parse, names no known tool or raises gets an error
line as its result, which the model can learn from. An answer without a call ends the
episode. A template that renders no tools (a plain ChatML one, as SmolLM2's) gets the
schemas and the call format in its system prompt instead (tools_prompt).

The environment runs in the workers of episodes.py, which read the tool list from the
GRPO_TOOLS variable the sampler sets (they start as `python rewards.py SPEC`)."""

import inspect
import json
import os
import re

import sandbox
import tasks
from plugins import load_function

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def python(code: str) -> str:
    """Run a Python program and return what it printed (or its error)."""
    result = sandbox.run(code, timeout=5.0)  # in the sandbox: the model wrote it
    printed = result["stdout"][-2000:]
    return printed if result["error"] is None else f"{printed}error: {result['error']}"


BUILTIN = {"python": python}  # the tasks' tools (their TOOLS) are found by name too


def load_tools(spec):
    """[fn] from 'python,calculator,module:function,...'. Raises ValueError: unknown, or
    without the type hints and docstring a schema is made of."""
    tools = []
    for name in filter(None, (s.strip() for s in spec.split(","))):
        if name in BUILTIN:
            fn = BUILTIN[name]
        elif ":" in name or (fn := tasks.find("TOOLS", name, "tool")) is None:
            fn = load_function(name, "tool")  # for a plain name unknown to the tasks: "not of the form module:function"
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
