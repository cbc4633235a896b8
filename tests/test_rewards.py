import json
import math
import os
import random
import re
import signal
import time

import pytest

from rewards import check_failures, parse_reward_spec, score_batch
from tasks.gsm8k import final_answer, gsm8k_accuracy, gsm8k_format, parse_gsm8k_answer


def gsm8k(gold):
    """A GSM8K-shaped record whose answer ends in '#### gold' (None: no answer at all)."""
    return {"question": "q", "answer": None if gold is None else f"work\n#### {gold}"}


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        # equal numbers in every written style
        ("#### 1000", "1000", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### $1000", "1000", 1.0),
        ("#### $ 1,000", "1000", 1.0),
        ("#### 1000.00", "1000", 1.0),
        ("#### 1000.", "1000", 1.0),
        ("#### -7", "-7", 1.0),
        ("#### 0.5", "1/2", 1.0),
        ("#### 3/4", "0.75", 1.0),
        # near misses
        ("#### 1000.5", "1000", 0.0),
        ("#### 10000", "1000", 0.0),
        ("#### 100", "1000", 0.0),
        ("#### -1000", "1000", 0.0),
        # \boxed wins over everything, the last one counts, nested braces allowed
        ("The answer is 5. \\boxed{7}", "7", 1.0),
        ("#### 5\nActually \\boxed{7}", "7", 1.0),
        ("\\boxed{5} then \\boxed{7}", "5", 0.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\$1,250}", "1250", 1.0),
        ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
        ("\\boxed{x = 6}", "6", 1.0),
        ("\\boxed{{12}}", "12", 1.0),
        ("unbalanced \\boxed{12", "12", 0.0),
        # the last '####' counts
        ("#### 3\n#### 4", "4", 1.0),
        ("#### 3\n#### 4", "3", 0.0),
        # 'answer is' only without the other two
        ("So the answer is 42.", "42", 1.0),
        ("The answer is: $42", "42", 1.0),
        ("The Answer is 41. No wait, the answer is 42", "42", 1.0),
        ("the answer is 41 #### 42", "42", 1.0),
        # the gold number mid-reasoning is not the final answer
        ("She has 72 apples, so she has 70 left.\n#### 70", "72", 0.0),
        ("72 apples in total", "72", 0.0),
        ("", "72", 0.0),
        ("#### ", "72", 0.0),
        ("#### seventy", "70", 0.0),
        ("#### 5", None, 0.0),
        ("#### 5", "not a number", 0.0),
        # real GSM8K answer style, calculator annotations and all
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72", "72", 1.0),
    ],
)
def test_accuracy(completion, gold, expected):
    assert gsm8k_accuracy(completion, gsm8k(gold)) == expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("2+3=5\n#### 5", 1.0),
        ("#### 5", 1.0),
        ("reasoning\n#### 1,000\n", 1.0),
        ("reasoning\n#### $12.50", 1.0),
        ("reasoning\n#### -3.", 1.0),
        ("#### 5 apples", 0.0),  # the line must hold the number alone
        ("#### 5\nmore text", 0.0),  # must end with the answer
        ("#### 4\n#### 5", 0.0),  # exactly one final answer
        ("\\boxed{5}", 0.0),  # not the prompted format
        ("", 0.0),
        ("5", 0.0),
    ],
)
def test_format(completion, expected):
    assert gsm8k_format(completion) == expected


@pytest.mark.parametrize(
    "text, gold",
    [
        ("a\n#### 1,234", "1234"),
        ("#### $5", "5"),
        ("x #### -3 ", "-3"),
        ("#### 2.5", "2.5"),
        ("no marker", None),
        ("#### many", None),
        (None, None),
        ("#### ", None),
    ],
)
def test_parse_gsm8k_answer(text, gold):
    assert parse_gsm8k_answer(text) == gold


def test_final_answer_order():
    assert final_answer("\\boxed{1} #### 2 the answer is 3") == "1"
    assert final_answer("#### 2 the answer is 3") == "2"
    assert final_answer("the answer is 3") == "3"
    assert final_answer("nothing here") is None


def test_reward_spec_and_weighted_sum():
    fns = parse_reward_spec("accuracy=2,format=0.5")
    totals, parts, counts = score_batch(["#### 5", "#### 4 apples"], [gsm8k(5), gsm8k(5)], fns)
    assert parts == [{"accuracy": 1.0, "format": 1.0}, {"accuracy": 0.0, "format": 0.0}] and totals == [2.5, 0.0]
    assert counts == {"reward_errors": 0, "reward_timeouts": 0, "rewards_failed": 0, "rewards": 2, "sandbox_errors": 0}
    # the built-ins are ordinary rewards of the same signature, by module:function too
    fns = parse_reward_spec("accuracy,tasks.gsm8k:gsm8k_format=3")
    assert score_batch(["#### 5"], [gsm8k(5)], fns)[0] == [4.0]
    for bad in ["nope", "accuracy=x", "no_such_module_xyz:fn", "rewards:no_such_fn", "rewards:TAIL", ""]:
        with pytest.raises(ValueError):
            parse_reward_spec(bad)


ADVERSARIAL = [
    "\\boxed{" * 20000,
    "{" * 50000 + "\\boxed{1}",
    "\\boxed{" + "{" * 50000,
    "####" * 25000,
    "#### " + "9" * 100000,
    "the answer is " + "9," * 50000,
    "1" * 100000,
    ",".join(["1"] * 50000),
    "answer is " * 10000,
    "é€😀" * 30000,
    "\\boxed{\\frac{" + "1" * 5000 + "}{3}}",
    "#### " + "1/" * 50000,
    "\x00\n\t" * 30000,
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_inputs_are_fast_and_safe(text):
    text = text[:100_000]
    start = time.perf_counter()
    for fn in (gsm8k_accuracy, gsm8k_format):
        assert fn(text, gsm8k(5)) in (0.0, 1.0)
    # Measured 1-3 ms each. The bound is generous for a loaded machine and still far below
    # a real regression: a backtracking regex over 100 kB takes minutes.
    assert time.perf_counter() - start < 1.0


def test_fuzz_never_raises_and_is_bounded():
    rng = random.Random(0)
    alphabet = list("0123456789.,$-/ \n#{}\\boxedfracanswerisAIé€") + ["####", "\\boxed{", "answer is", "\\frac{"]
    worst = 0.0
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
        record = gsm8k(rng.choice(["5", "1000", "-3", "0.5", "", None, "abc"]))
        start = time.perf_counter()
        assert gsm8k_accuracy(text, record) in (0.0, 1.0)
        assert gsm8k_format(text, record) in (0.0, 1.0)
        worst = max(worst, time.perf_counter() - start)
    assert worst < 0.25  # measured under 1 ms; an exponential regex on 300 characters never ends
    for bad in (None, 5, b"#### 5", ["#### 5"]):
        assert gsm8k_accuracy(bad, gsm8k(5)) == 0.0 and gsm8k_format(bad) == 0.0
    for bad_record in (None, {}, "#### 5", {"answer": 5}, {"answer": ["#### 5"]}):
        assert gsm8k_accuracy("#### 5", bad_record) == 0.0


def test_real_gsm8k_gold_solutions_score_one(gsm8k):
    with open(os.path.join(gsm8k, "test.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 1319
    golds = [parse_gsm8k_answer(r["answer"]) for r in rows]
    assert all(g is not None for g in golds)
    for row, gold in zip(rows, golds):
        # the gold solution in the prompted format: reasoning, then '#### N'
        reasoning, number = row["answer"].rsplit("####", 1)
        solution = re.sub(r"<<[^>]*>>", "", reasoning).strip() + "\n#### " + number.strip()
        assert gsm8k_accuracy(solution, row) == 1.0, solution  # the real row is the record
        assert gsm8k_format(solution, row) == 1.0, solution
    mismatched = 0
    for i, row in enumerate(rows):
        other = rows[(i + 1) % len(rows)]
        if float(golds[(i + 1) % len(rows)]) != float(golds[i]):
            assert gsm8k_accuracy(row["answer"], other) == 0.0
            mismatched += 1
    assert mismatched > 1200


# ---------------------------------------------------------------- user rewards on a task of their own

TASK = "tests.plugins.task_rewards"


@pytest.fixture(scope="module")
def task_records(tmp_path_factory):
    """The 300 records of a non-GSM8K task, as the trainer loads them (tests/plugins/task_rewards.py)."""
    from task_rewards import write_task

    import tiny
    from data import load_prompts

    path = write_task(str(tmp_path_factory.mktemp("task") / "task.jsonl"))
    fns = parse_reward_spec(f"{TASK}:passes_tests,{TASK}:sees_record")
    return load_prompts(path, "train", tiny.build_tiny_tokenizer(), 512, fns, prompt_field="problem")


def test_user_reward_sees_every_column_the_prompt_and_the_step(task_records):
    assert len(task_records) == 300
    fns = parse_reward_spec(f"{TASK}:passes_tests,{TASK}:sees_record=0,format")
    solutions = [r["solution"] for r in task_records]
    wrong = [r["solution"].replace("return ", "return 1 + ") for r in task_records]
    totals, parts, counts = score_batch(solutions + wrong, task_records * 2, fns, step=7, timeout=10, workers=2)
    assert counts == {
        "reward_errors": 0,
        "reward_timeouts": 0,
        "rewards_failed": 0,
        "rewards": 600,
        "sandbox_errors": 0,
    }
    # the reference answers pass the row's own tests, and shifted ones fail them
    assert [p[f"{TASK}:passes_tests"] for p in parts] == [1.0] * 300 + [0.0] * 300
    assert totals == [1.0] * 300 + [0.0] * 300  # weight 0 leaves sees_record out of the sum
    # id and problem columns, the step, the prompt text and the right completion, each row in its place
    seen = [p[f"{TASK}:sees_record"] for p in parts]
    assert seen == [r["id"] + 7000 + 0.75 for r in task_records] + [r["id"] + 7000 + 0.5 for r in task_records]


def test_slow_calls_time_out_score_zero_and_are_counted(task_records, capsys):
    fns = parse_reward_spec(f"{TASK}:passes_tests")
    records = task_records[:6]
    completions = [
        records[0]["solution"],
        "while True:\n    pass\n",  # never returns: its worker is killed
        "import time\ntime.sleep(1.3)\n" + records[2]["solution"],  # returns, but past the timeout
        records[3]["solution"],
        "def f(x):\n    return 'wrong'\n",
        records[5]["solution"],
    ]
    start = time.monotonic()
    totals, parts, counts = score_batch(completions, records, fns, timeout=1.0, workers=1)
    assert time.monotonic() - start < 10
    assert totals == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]  # the calls after the killed one still run, in a fresh worker
    assert counts == {"reward_errors": 0, "reward_timeouts": 2, "rewards_failed": 2, "rewards": 6, "sandbox_errors": 0}
    err = capsys.readouterr().err
    assert err.count(f"reward '{TASK}:passes_tests' ran past --reward-timeout 1 s") == 1


def test_reward_workers_run_calls_in_parallel(task_records, tmp_path, monkeypatch):
    # Measured by overlap, not wall time (a loaded machine slows both): the four calls
    # were all asleep at one moment, which one worker cannot do.
    monkeypatch.setenv("NAP_LOG", str(tmp_path / "naps"))
    fns = parse_reward_spec(f"{TASK}:nap_logged")
    totals, _, counts = score_batch(["2"] * 4, task_records[:4], fns, timeout=30, workers=4)
    assert totals == [1.0] * 4 and counts["reward_timeouts"] == 0
    spans = [tuple(map(float, line.split())) for line in (tmp_path / "naps").read_text().splitlines()]
    assert len(spans) == 4 and max(s for s, _ in spans) < min(e for _, e in spans), spans


def test_errors_are_counted_printed_once_and_abort_past_the_fraction(task_records, capfd):
    fns = parse_reward_spec(f"{TASK}:flaky,format")
    records = task_records[:40]
    totals, parts, counts = score_batch(["#### 1"] * 40, records, fns, timeout=10)
    failed = [r["id"] % 4 == 0 for r in records]
    assert totals == [1.0 if bad else 2.0 for bad in failed]  # the failed call scores 0, the others count
    assert counts == {
        "reward_errors": 10,
        "reward_timeouts": 0,
        "rewards_failed": 10,
        "rewards": 40,
        "sandbox_errors": 0,
    }
    out, err = capfd.readouterr()
    assert err.count("Traceback") == 1 and f"reward '{TASK}:flaky' failed" in err and "KeyError: 'expected'" in err
    assert "flaky: row 1\n" in err  # what a reward prints is shown, and does not garble its worker's replies
    check_failures(counts, 0.5, step=3)  # a quarter failed: go on
    check_failures(counts, 0.25, step=3)  # "more than" the fraction
    with pytest.raises(SystemExit, match=r"step 3: 10 of 40 completions had a reward fail \(10 errors, 0 timeouts\)"):
        check_failures(counts, 0.2, step=3)
    # a reward that kills its own process, and one that returns what is not a number
    totals, parts, counts = score_batch(["x"] * 4, records[:4], parse_reward_spec(f"{TASK}:crash,{TASK}:verdict"))
    assert counts["reward_errors"] == 8 and counts["rewards_failed"] == 4
    err = capfd.readouterr().err
    assert "reward worker died (exit status 3)" in err and "could not convert string to float: 'pass'" in err
    with pytest.raises(SystemExit, match="more than --max-reward-errors 0.5"):
        check_failures(counts, 0.5, step=0)
    # NaN is a value, not an error: it reaches the learner, whose non-finite step is skipped (test_checkpoint)
    totals, parts, counts = score_batch(["x"], records[:1], parse_reward_spec("tests.plugins.nan_reward:nan"))
    assert math.isnan(totals[0]) and counts["reward_errors"] == 0


def test_a_hanging_reward_does_not_hang_the_job(task_records, tmp_path):
    """A reward that never returns, in a process of its own, as a sampler would run it: the
    batch ends at the timeout, the process exits at once, and no worker outlives it, even
    when the caller is killed in the middle of a call."""
    import subprocess
    import sys

    from conftest import ROOT

    records = tmp_path / "records.json"
    records.write_text(json.dumps(task_records[:3]))
    script = (
        "import json, sys, time\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from rewards import parse_reward_spec, score_batch\n"
        f"records = json.load(open({str(records)!r}))\n"
        f"fns = parse_reward_spec('{TASK}:hang,{TASK}:passes_tests')\n"
        "completions = [r['solution'] for r in records]\n"
        "totals, parts, counts = score_batch(completions, records, fns, timeout=float(sys.argv[1]))\n"
        "import rewards\n"
        "idle = [p.pid for pool in rewards._pools.values() for p in pool.procs if p]\n"
        "print(json.dumps([totals, counts, idle]), flush=True)\n"
    )
    pid_file = tmp_path / "hang.pid"
    env = {**os.environ, "HANG_PID_FILE": str(pid_file)}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script, "0.5"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    totals, counts, idle = json.loads(done.stdout)
    assert totals == [1.0] * 3  # the other reward still scores
    assert counts == {"reward_errors": 0, "reward_timeouts": 3, "rewards_failed": 3, "rewards": 3, "sandbox_errors": 0}
    assert time.monotonic() - start < 30
    assert idle and not any(map(_alive, idle + [int(pid_file.read_text())]))  # no worker outlives the job

    # killed mid-call (-9, nothing of it runs at exit): its hung worker dies with it
    pid_file.unlink()
    caller = subprocess.Popen([sys.executable, "-c", script, "600"], env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and caller.poll() is None
        time.sleep(0.1)
    worker = int(pid_file.read_text())
    try:
        assert _alive(worker)
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker)
    finally:  # a failed run leaves no busy loop behind
        caller.kill()
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


def _alive(pid):
    """Whether pid runs (a zombie, dead but not yet reaped by its parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
