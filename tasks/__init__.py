"""Tasks: each one file here, `tasks/NAME.py`, found by its name. A task file is a plain
module; it defines any of these attributes, all optional:

  rows(split) -> [dict]    its dataset ('train' or 'test'): what `--dataset NAME` loads
  HUB_DATASET              (hub name, config): what `--dataset NAME` loads where there is
                           no rows(); `--dataset <hub name>` then loads that config too
  REWARDS = {name: fn}     its rewards, `fn(completion, record) -> float`, for `--rewards`;
                           a reward may declare `fn.needs` (the columns it reads),
                           `fn.check(row)` (why a row cannot be scored, or None),
                           `fn.system_prompt` (the instruction it scores, the prompts'
                           system message), `fn.answer(completion)` (the answer maj@n votes
                           on, evals.py) and `fn.in_process = True` (it never raises or
                           hangs: scored in the trainer, not in a worker, rewards.py)
  METRICS = (name, ...)    which of its rewards metrics.jsonl logs under their own name
                           (`accuracy`); every other reward is logged as `reward_<name>`
  TOOLS = {name: fn}       the functions `--tools` may give the model (tools.py: type
                           hints and a docstring)
  SYSTEM_PROMPT            its instruction (its rewards carry it as `fn.system_prompt`);
                           set to None, its prompts get no system message at all

Names resolve so: `--dataset NAME` is tasks/NAME.py when there is one, before any file or
hub name. In `--rewards` and `--tools`, `module:function` is a function anywhere, as
before; `task.name` is that task's `name`; a plain `name` is the function the tasks here
define under that name: several may, when it is the same function (synthetic.py scores
with gsm8k.py's), and where they define different ones the plain name is refused, naming
the `task.name` forms to choose from. Files whose name starts with '_' are no tasks."""

import importlib
import os


def names():
    """The tasks there are, sorted: NAME for each tasks/NAME.py."""
    found = set()
    for folder in __path__:
        for file in os.listdir(folder):
            if file.endswith(".py") and not file.startswith("_") and file[:-3].isidentifier():
                found.add(file[:-3])
    return sorted(found)


def load(name):
    """The module tasks/NAME.py, or None where there is no such task. Raises ValueError
    where the file fails to import."""
    if name not in names():
        return None
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except Exception as e:  # a task file's own error, in one line
        raise ValueError(f"cannot load task {name!r} (tasks/{name}.py): {type(e).__name__}: {e}")


def find(table, name, what):
    """The function `name` ('task.name' or a plain name) resolves to in the tasks' `table`
    ('REWARDS' or 'TOOLS'), or None where no task defines it. Raises ValueError where the
    task is not there or several tasks define different functions by that name; `what`
    ('reward', 'tool') names it in the message."""
    if "." in name:
        task, _, attr = name.partition(".")
        module = load(task)
        if module is None:
            raise ValueError(f"{what} {name!r}: there is no task {task!r} in tasks/ (one of {names()})")
        fn = getattr(module, table, {}).get(attr)
        if fn is None:
            raise ValueError(
                f"{what} {name!r}: task {task!r} defines none by that name: {sorted(getattr(module, table, {}))}"
            )
        return fn
    by_fn = {}
    for task in names():
        fn = getattr(load(task), table, {}).get(name)
        if fn is not None:
            by_fn.setdefault(fn, []).append(task)
    if len(by_fn) > 1:
        choices = [f"{task}.{name}" for tasks in by_fn.values() for task in tasks]
        raise ValueError(f"{what} {name!r} is defined differently by several tasks: write one of {choices}")
    return next(iter(by_fn), None)


def defined(table):
    """Every plain name the tasks define in `table`, sorted (for messages)."""
    return sorted({name for task in names() for name in getattr(load(task), table, {})})


def metric_names():
    """The reward names the tasks log under their own name (their METRICS), in the tasks'
    order and each one's own."""
    return list(dict.fromkeys(name for task in names() for name in getattr(load(task), "METRICS", ())))


def hub_dataset(dataset):
    """(hub name, config) where --dataset is a task with a HUB_DATASET or that hub name,
    else None."""
    task = load(dataset)
    if task is not None:
        return getattr(task, "HUB_DATASET", None)
    return next((hub for t in names() if (hub := getattr(load(t), "HUB_DATASET", None)) and hub[0] == dataset), None)
