"""Code a user names on the command line as 'module:function': a reward, an objective, an
environment or a tool. The module is imported as Python imports any other, so a file
beside the run (or anywhere on PYTHONPATH) is enough; nothing is registered."""

import importlib


def load_function(name, what, builtin=None):
    """builtin[name] when `builtin` has it, else the function 'module:function' names.
    Raises ValueError naming `what` it was to be."""
    if builtin and name in builtin:
        return builtin[name]
    module, _, attr = name.partition(":")
    if not attr:
        if builtin:
            raise ValueError(f"unknown {what} {name!r}: use one of {', '.join(sorted(builtin))} or module:function")
        raise ValueError(f"{what} {name!r} is not of the form module:function")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as e:  # ImportError, AttributeError, or whatever the module raises on import
        raise ValueError(f"cannot load {what} {name!r}: {e}")
    if not callable(fn):
        raise ValueError(f"{what} {name!r} is not a function")
    return fn
