"""The code task: its reward, `code_tests` (logged as `reward_code_tests`), the fraction
of a row's tests that the code in a completion passes, run in the sandbox (sandbox.py),
never in the trainer or its workers.

A row holds `tests`, a list of Python statements that raise when the code is wrong
(asserts, as MBPP's `test_list`). One program runs the completion's code (its last fenced
block, else the whole text), then each test in turn, each printing a line of its own
once it passed; a test that raises counts as failed, and so do the ones after a crash,
an exit or a limit. Code that does not compile fails its tests; they still run. The
sandbox protects the machine, not the score: a completion that inspects its own process
can forge a pass, as with any harness that runs tests beside the code they test."""

import json
import re
import secrets

import sandbox

FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
TIMEOUT = 5.0  # seconds of wall clock for one completion's code and all its tests

# The program. The marker is drawn per call, so code cannot print a pass it did not earn
# without reading its own process's memory.
HARNESS = """
import json as _json
try:
    exec(compile({code!r}, "<completion>", "exec"), globals())
except BaseException:
    pass
for _i, _test in enumerate(_json.loads({tests!r})):
    try:
        exec(_test, globals())
    except BaseException:
        continue
    print({marker!r}, _i, flush=True)
"""


def extract_code(completion):
    """The last ```python fenced block of a completion, or the whole of it."""
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def code_tests(completion, record):
    """Fraction of record["tests"] that the completion's code passes in the sandbox."""
    tests, marker = record["tests"], secrets.token_hex(8)
    program = HARNESS.format(code=extract_code(completion), tests=json.dumps(tests), marker=marker)
    result = sandbox.run(program, timeout=TIMEOUT)
    passed = {line.split()[1] for line in result["stdout"].splitlines() if line.startswith(marker + " ")}
    return len(passed) / len(tests)


def _check(row):
    tests = row["tests"]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        return "'tests' is not a non-empty list of Python statements"
    return None


code_tests.needs = ("tests",)
code_tests.check = _check
code_tests.system_prompt = "Answer with Python code in a ```python block."

REWARDS = {"code_tests": code_tests}
