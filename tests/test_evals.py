"""The eval estimators on cases worked by hand, and against the binomial form."""

import math
from fractions import Fraction

import pytest

from conftest import refusal
from evals import ks, majority_correct, pass_at_k
from tasks.gsm8k import gsm8k_accuracy


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the mean
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k wrong: every k-subset holds a right one


@pytest.mark.parametrize("n", [1, 2, 5, 16, 64])
def test_pass_at_k_is_the_binomial_ratio(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            want = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
    # and it is not the biased 1 - (1 - c/n)^k
    assert n < 2 or pass_at_k(n, 1, 2) != pytest.approx(1 - (1 - 1 / n) ** 2)


def test_majority_vote_by_hand():
    assert majority_correct(["3", "3", "4", None], [True, True, False, False])
    assert not majority_correct(["4", "3", "4", None], [False, True, False, False])
    assert not majority_correct([None, None], [False, False])  # no answer, no vote
    assert majority_correct([None, None, "7"], [False, False, True])  # missing answers do not vote
    assert not majority_correct(["3", "4"], [False, True])  # a tie goes to the first seen


def test_the_reported_ks():
    assert ks(1) == [] and ks(2) == [2] and ks(8) == [2, 4, 8] and ks(6) == [2, 4, 6]


def test_votes_are_by_value():
    answer = gsm8k_accuracy.answer
    assert answer("so #### 1,000") == answer("The answer is $1000.") == Fraction(1000)
    assert answer("no number here") is None and answer(None) is None


def test_the_eval_flags_resolve_or_refuse_in_one_line(capsys):
    from config import parse_config, resolve

    def resolved(args):
        cfg = resolve(parse_config([*args.split(), "--out-dir", "/nonexistent/run"]), world_size=3, has_gpu=False)
        return cfg.eval_samples, cfg.eval_temperature

    assert resolved("") == (1, 0.0)  # greedy, as before
    assert resolved("--eval-samples 8 --temperature 0.7") == (8, 0.7)
    assert resolved("--eval-samples 8 --eval-temperature 0.6") == (8, 0.6)
    for args, why in [
        ("--eval-samples 0", "--eval-samples must be at least 1"),
        ("--eval-samples 4 --eval-temperature 0", "give a temperature > 0"),
        ("--eval-samples 4 --rewards format", "need a reward in --rewards that declares the answer"),
    ]:
        assert why in refusal(capsys, args), args
