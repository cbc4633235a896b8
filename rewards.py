"""Scoring: GSM8K accuracy and format rewards, and their weighted sum.

Every reward has the signature `fn(completion: str, gold: str) -> float`, never raises,
and runs in time linear in the completion: only anchored or length-capped regexes
are used, so no input can make them backtrack catastrophically."""

import importlib
import re
from fractions import Fraction

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


def gsm8k_accuracy(completion, gold):
    """1.0 when the completion's final answer equals the gold number, else 0.0."""
    try:
        answer, target = to_number(final_answer(completion)), to_number(gold)
        return float(answer is not None and target is not None and answer == target)
    except Exception:  # rewards never take a run down
        return 0.0


FORMAT = re.compile(r"####[ \t]*\$?-?\d[\d,]*(?:\.\d+)?\.?[ \t]*")


def gsm8k_format(completion, gold=None):
    """1.0 when the completion ends with exactly one '#### <number>' line, else 0.0."""
    try:
        if completion.count("####") != 1:
            return 0.0
        last_line = completion.rstrip().rsplit("\n", 1)[-1]
        return float(len(last_line) <= TAIL and FORMAT.fullmatch(last_line.strip()) is not None)
    except Exception:
        return 0.0


BUILTIN = {"accuracy": gsm8k_accuracy, "format": gsm8k_format}


def parse_reward_spec(spec):
    """'accuracy,format=0.5,my.module:fn=2' -> [(name, fn, weight)]. Raises ValueError
    with a readable message, so a bad flag fails before any model loads."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, weight = item.partition("=") if "=" in item else (item, "", "1")
        try:
            weight = float(weight)
        except ValueError:
            raise ValueError(f"reward weight of {name!r} is not a number: {weight!r}")
        if name in BUILTIN:
            fn = BUILTIN[name]
        elif ":" in name:
            module, _, attr = name.partition(":")
            try:
                fn = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"cannot load reward {name!r}: {e}")
        else:
            raise ValueError(f"unknown reward {name!r}: use one of {sorted(BUILTIN)} or module:function")
        out.append((name, fn, weight))
    if not out:
        raise ValueError("no reward given")
    return out


def score(completion, gold, reward_fns):
    """(total, {name: value}) for one completion under the weighted reward functions."""
    parts = {name: float(fn(completion, gold)) for name, fn, _ in reward_fns}
    return sum(w * parts[name] for name, _, w in reward_fns), parts
