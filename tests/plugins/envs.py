"""Environments for the tests (episodes.py): plain functions of (record, turns). follow_up
is README's example."""

import time
import zlib


def follow_up(record, turns):
    """Asks again after each answer, until the model has answered three times."""
    answers = sum(m["role"] == "assistant" for m in turns)
    return None if answers >= 3 else "Again."  # a string is a message in fn.role ("user")


def tool_result(record, turns):
    """One message in the role of a tool, then the end."""
    return {"role": "tool", "content": "42"} if len(turns) <= len(record["prompt_messages"]) + 1 else None


def flaky(record, turns):
    """By the prompt's hash: raises, hangs past any timeout, returns a bad type, or asks once more."""
    kind = zlib.crc32(record["prompt"].encode()) % 4
    if kind == 0:
        raise RuntimeError("the environment broke")
    if kind == 1:
        time.sleep(60)
    if kind == 2:
        return 42
    return "Once more." if sum(m["role"] == "assistant" for m in turns) < 2 else None
