import json
import os
import random
import re
import time

import pytest

from conftest import GSM8K
from data import parse_gsm8k_answer
from rewards import final_answer, gsm8k_accuracy, gsm8k_format, parse_reward_spec, score


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
    assert gsm8k_accuracy(completion, gold) == expected


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
    [("a\n#### 1,234", "1234"), ("#### $5", "5"), ("x #### -3 ", "-3"), ("#### 2.5", "2.5"), ("no marker", None), ("#### many", None), (None, None), ("#### ", None)],
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
    total, parts = score("#### 5", "5", fns)
    assert parts == {"accuracy": 1.0, "format": 1.0} and total == 2.5
    total, parts = score("#### 4 apples", "5", fns)
    assert parts == {"accuracy": 0.0, "format": 0.0} and total == 0.0
    # a user reward by module:function, with the same signature
    fns = parse_reward_spec("accuracy,rewards:gsm8k_format=3")
    assert score("#### 5", "5", fns)[0] == 4.0
    for bad in ["nope", "accuracy=x", "no_such_module_xyz:fn", "rewards:no_such_fn", ""]:
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
        assert fn(text, "5") in (0.0, 1.0)
    assert time.perf_counter() - start < 0.02  # 10 ms each for a 100 kB string


def test_fuzz_never_raises_and_is_bounded():
    rng = random.Random(0)
    alphabet = list("0123456789.,$-/ \n#{}\\boxedfracanswerisAIé€") + ["####", "\\boxed{", "answer is", "\\frac{"]
    worst = 0.0
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
        gold = rng.choice(["5", "1000", "-3", "0.5", "", None, "abc"])
        start = time.perf_counter()
        assert gsm8k_accuracy(text, gold) in (0.0, 1.0)
        assert gsm8k_format(text, gold) in (0.0, 1.0)
        worst = max(worst, time.perf_counter() - start)
    assert worst < 0.01
    for bad in (None, 5, b"#### 5", ["#### 5"]):
        assert gsm8k_accuracy(bad, "5") == 0.0 and gsm8k_format(bad) == 0.0


def _gsm8k_rows(split):
    path = os.path.join(GSM8K, f"{split}.jsonl")
    if not os.path.exists(path):
        pytest.skip("the shared GSM8K copy is not here")
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_real_gsm8k_gold_solutions_score_one():
    rows = _gsm8k_rows("test")
    assert len(rows) == 1319
    golds = [parse_gsm8k_answer(r["answer"]) for r in rows]
    assert all(g is not None for g in golds)
    for row, gold in zip(rows, golds):
        # the gold solution in the prompted format: reasoning, then '#### N'
        reasoning, number = row["answer"].rsplit("####", 1)
        solution = re.sub(r"<<[^>]*>>", "", reasoning).strip() + "\n#### " + number.strip()
        assert gsm8k_accuracy(solution, gold) == 1.0, solution
        assert gsm8k_format(solution) == 1.0, solution
    mismatched = 0
    for i, row in enumerate(rows):
        other = golds[(i + 1) % len(rows)]
        if float(other.replace(",", "")) != float(golds[i]):
            assert gsm8k_accuracy(row["answer"], other) == 0.0
            mismatched += 1
    assert mismatched > 1200
