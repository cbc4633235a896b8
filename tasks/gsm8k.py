"""The GSM8K task (Cobbe et al., 2021): its instruction, how an answer is read from a
completion and from a gold solution, and its two rewards, `accuracy` and `format`, which
metrics.jsonl logs under those names. `--dataset gsm8k` loads it from the hub. What a task
file defines is in tasks/__init__.py. Both rewards never raise and run in time linear in
the completion (only anchored or length-capped regexes are used), so they are scored in
the trainer's process."""

import re
from fractions import Fraction

SYSTEM_PROMPT = "Solve the problem. End your reply with a line '#### <answer>'."
HUB_DATASET = ("openai/gsm8k", "main")  # what --dataset gsm8k loads

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d*)?(?:/\d+)?")
TAIL = 200  # characters read after a '####' or 'answer is' marker


def to_number(text):
    """Fraction for '1,000', '$1000', '1000.00', '1000.', '3/4', '-2.5'; None otherwise."""
    if text is None:
        return None
    s = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _boxed_content(text):
    """Content of the last \\boxed{...}, nested braces allowed; None if absent or unbalanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _clean_latex(s):
    s = re.sub(r"\\d?frac\{(-?\d+)\}\{(\d+)\}", r"\1/\2", s[:TAIL])
    for junk in ("\\$", "\\%", "%", "\\!", "\\,", "{", "}"):
        s = s.replace(junk, "")
    return s


def final_answer(completion):
    """The final answer as a string: the last \\boxed{}, else the last '#### N',
    else the number after the last 'answer is'. None when there is none."""
    if not isinstance(completion, str):
        return None
    boxed = _boxed_content(completion)
    if boxed is not None:
        clean = _clean_latex(boxed).strip()
        if NUMBER.fullmatch(clean.replace("$", "")):
            return clean
        numbers = NUMBER.findall(clean)
        return numbers[-1] if numbers else None
    marker = completion.rfind("####")
    if marker >= 0:
        line = completion[marker + 4 : marker + 4 + TAIL].split("\n", 1)[0]
        m = re.match(r"\s*\$?\s*(" + NUMBER.pattern + ")", line)
        return m.group(1) if m else None
    lower = completion.lower()
    marker = lower.rfind("answer is")
    if marker >= 0:
        tail = _clean_latex(completion[marker + len("answer is") : marker + len("answer is") + TAIL])
        m = re.match(r"[\s:=]*\$?\s*(" + NUMBER.pattern + ")", tail)
        return m.group(1) if m else None
    return None


def parse_gsm8k_answer(text):
    """Gold number from a GSM8K answer ('... #### 1,234' -> '1234'), or None."""
    if not isinstance(text, str) or "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "").strip()
    if not re.fullmatch(r"-?\d+(?:\.\d+)?(?:/\d+)?", tail):
        return None
    return tail


def gsm8k_accuracy(completion, record):
    """1.0 when the completion's final answer equals the number after the '####' of the
    record's GSM8K-style "answer" column, else 0.0."""
    try:
        answer, target = to_number(final_answer(completion)), to_number(parse_gsm8k_answer(record["answer"]))
        return float(answer is not None and target is not None and answer == target)
    except Exception:  # rewards never take a run down
        return 0.0


gsm8k_accuracy.needs = ("answer",)
gsm8k_accuracy.check = lambda row: None if parse_gsm8k_answer(row["answer"]) else "answer without a '#### <number>'"
gsm8k_accuracy.system_prompt = SYSTEM_PROMPT
gsm8k_accuracy.answer = lambda completion: to_number(final_answer(completion))  # what maj@n votes on (evals.py)
gsm8k_accuracy.in_process = True

FORMAT = re.compile(r"####[ \t]*\$?-?\d[\d,]*(?:\.\d+)?\.?[ \t]*")


def gsm8k_format(completion, record=None):
    """1.0 when the completion ends with exactly one '#### <number>' line, else 0.0."""
    try:
        if completion.count("####") != 1:
            return 0.0
        last_line = completion.rstrip().rsplit("\n", 1)[-1]
        return float(len(last_line) <= TAIL and FORMAT.fullmatch(last_line.strip()) is not None)
    except Exception:
        return 0.0


gsm8k_format.system_prompt = SYSTEM_PROMPT
gsm8k_format.in_process = True

REWARDS = {"accuracy": gsm8k_accuracy, "format": gsm8k_format}
METRICS = ("accuracy", "format")
