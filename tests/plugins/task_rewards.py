"""A task that is not GSM8K, and user rewards for it, as `--rewards tests.plugins.task_rewards:NAME`.

The task: write a Python function from a one-line spec. Each row has its own columns:
the prompt ("problem"), the function's name ("entry_point"), test cases ("tests") and a
reference answer ("solution"), none of which a '#### <number>' check would accept."""

import json
import os
import time

import sandbox


def write_task(path, n=300):
    """n rows of the task as .jsonl; row i asks for f(x) = k*x + b with its own k and b."""
    with open(path, "w") as f:
        for i in range(n):
            k, b = i % 7 + 2, i % 5
            tests = [[[x], k * x + b] for x in (0, 1, 5)]
            row = {
                "id": i,
                "problem": f"Write a Python function f(x) that returns {k} * x + {b}.",
                "entry_point": "f",
                "tests": tests,
                "solution": f"def f(x):\n    return {k} * x + {b}\n",
            }
            f.write(json.dumps(row) + "\n")
    return path


def passes_tests(completion, record):
    """Fraction of the row's tests that the function in the completion passes, run in the sandbox."""
    checks = "".join(f"print({record['entry_point']}(*{args!r}) == {want!r})\n" for args, want in record["tests"])
    result = sandbox.run(completion + "\n" + checks, timeout=5)  # the model wrote it: never exec it here
    return result["stdout"].split().count("True") / len(record["tests"])


passes_tests.needs = ("entry_point", "tests")


def sees_record(completion, record):
    """Encodes what the reward was given: the row's id, the step, and whether the prompt
    and the completion are the ones the caller meant, so a test can read them back."""
    right_prompt, right_completion = record["prompt"] == record["problem"], completion == record["solution"]
    return record["id"] + 1000 * record["step"] + 0.5 * right_prompt + 0.25 * right_completion


sees_record.needs = ("id", "problem")


def flaky(completion, record):
    """A buggy reward: raises on every fourth row (a column it expects is not there), and
    prints as it goes, as one being debugged would."""
    print(f"flaky: row {record['id']}")
    if record["id"] % 4 == 0:
        return record["expected"]
    return 1.0


def verdict(completion, record):
    """A buggy reward: returns a label, not a number."""
    return "pass"


def hang(completion, record):
    """Never returns: a busy loop (holding its CPU), after writing its pid where the
    test asked (HANG_PID_FILE), so the test can see the process is gone afterwards."""
    if os.environ.get("HANG_PID_FILE"):
        with open(os.environ["HANG_PID_FILE"], "w") as f:
            f.write(str(os.getpid()))
    while True:
        pass


def nap(completion, record):
    """Sleeps the number of seconds the completion says, then scores 1."""
    time.sleep(float(completion))
    return 1.0


def nap_logged(completion, record):
    """nap, appending its start and end times to the file $NAP_LOG names: whether calls overlapped."""
    start = time.time()
    time.sleep(float(completion))
    with open(os.environ["NAP_LOG"], "a") as f:
        f.write(f"{start} {time.time()}\n")
    return 1.0


def crash(completion, record):
    """Kills its own process, as a segfaulting extension would."""
    os._exit(3)


def brevity(completion, record):
    """1 for an empty reply, down to 0 at 100 characters: a reward whose groups are never
    uniform, so every step of a short test run moves the weights."""
    return 1.0 - min(len(completion), 100) / 100


def slow_at_step(completion, record):
    """0, after 600 s at the step that GRPO_TEST_SLOW_STEP ('<step>:<marker file>') names,
    where it first touches the marker: a step made minutes long, for the preemption tests."""
    step, _, marker = os.environ.get("GRPO_TEST_SLOW_STEP", "-1:").partition(":")
    if record["step"] == int(step):
        open(marker, "a").close()
        time.sleep(600)
    return 0.0
