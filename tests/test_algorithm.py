"""Group advantages and policy losses against plain loops written independently here,
and the invariance of one optimizer step to how the work is split (real torchrun + FSDP2)."""

import glob
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from config import Config, parse_config, resolve
from conftest import ROOT, free_port, refusal
from grpo import group_advantages, overlong_penalty, policy_loss

# ---------------------------------------------------------------- independent references


def ref_advantages(rewards, G, scale, eps=1e-4):
    rewards = [float(r) for r in rewards]
    n = len(rewards)
    batch_mean = sum(rewards) / n
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in rewards) / (n - 1))
    out = []
    for start in range(0, n, G):
        group = rewards[start : start + G]
        mean = sum(group) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (G - 1))
        for r in group:
            if scale == "group":
                out.append((r - mean) / (std + eps))
            elif scale == "batch":
                out.append((r - mean) / (batch_std + eps))
            else:
                out.append(r - mean)
    return out


def ref_loss(
    logp,
    old,
    adv,
    mask,
    loss_type,
    eps_low,
    eps_high,
    importance="token",
    max_new=None,
    ref=None,
    beta=0.0,
    mismatch="none",
    low=None,
    high=None,
    teacher=None,
    distill_coef=0.0,
):
    B, T = len(logp), len(logp[0])
    per_seq, total, tokens = [], 0.0, 0
    for i in range(B):
        idx = [t for t in range(T) if mask[i][t]]
        geometric = math.exp(sum(logp[i][t] - old[i][t] for t in idx) / max(1, len(idx)))
        seq_sum = 0.0
        for t in idx:
            r = math.exp(logp[i][t] - old[i][t])
            # a correction weighs sampler against learner; the ratio is then the learner's own (1)
            if mismatch == "none":
                weight, ratio = 1.0, (geometric if importance == "sequence" else r)
            elif mismatch == "tis":
                weight, ratio = min(r, high), 1.0
            elif mismatch == "mask":
                weight, ratio = (r if low <= r <= high else 0.0), 1.0
            elif mismatch == "seq-mask":
                weight, ratio = (1.0 if low <= geometric <= high else 0.0), 1.0
            a = adv[i] - (distill_coef * (logp[i][t] - teacher[i][t]) if teacher else 0.0)
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            term = -min(ratio * a, clipped * a)
            if beta > 0:
                d = ref[i][t] - logp[i][t]
                term += beta * (math.exp(d) - d - 1)
            seq_sum += weight * term
        per_seq.append(seq_sum / max(1, len(idx)))
        total += seq_sum
        tokens += len(idx)
    if loss_type == "grpo":
        return sum(per_seq) / B
    if loss_type in ("bnpo", "dapo"):
        return total / tokens
    if loss_type == "dr_grpo":
        return total / (B * max_new)


def loss_config(**overrides):
    """The loss flags of a test case, with no KL unless the case asks for it."""
    return Config(**{"epsilon": 0.2, "epsilon_high": 0.2, "max_new_tokens": 7, "beta": 0.0, **overrides})


def random_batch(seed, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    ref = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    return logp, old, ref, adv, mask


# ---------------------------------------------------------------- advantages


def test_advantages_hand_checked():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4, "group")
    # group 1: mean 0.25, unbiased std 0.5
    assert torch.allclose(adv[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-3)
    assert torch.equal(adv[4:], torch.zeros(4))  # equal rewards: advantage 0
    assert torch.allclose(group_advantages(rewards, 4, "none")[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("seed", range(5))
def test_advantages_match_loops(scale, seed):
    g = torch.Generator().manual_seed(seed)
    G = [2, 4, 8][seed % 3]
    rewards = torch.randint(0, 3, (G * 6,), generator=g).double()
    got = group_advantages(rewards, G, scale)
    assert torch.allclose(
        got, torch.tensor(ref_advantages(rewards.tolist(), G, scale), dtype=torch.float64), atol=1e-10
    )


# ---------------------------------------------------------------- losses


@pytest.mark.parametrize("mode", ["tis", "mask", "seq-mask"])
def test_a_token_past_exps_range_weighs_nothing_and_the_loss_stays_finite(mode):
    """A token whose learner/sampler log ratio is past float32's exp range (a stale or
    broken sample: ratio inf) is dropped by the masks with weight exactly 0, capped by TIS,
    and never makes the step's loss or gradient NaN; the other tokens keep their weights."""
    logp = torch.full((2, 3), -1.0, requires_grad=True)  # float32, as the learner's
    sampler_logp = torch.full((2, 3), -1.0)
    sampler_logp[0, 1] = -150.0  # log ratio +149: exp overflows to inf
    mask = torch.ones(2, 3)
    cfg = loss_config(mismatch=mode, mismatch_low=0.5, mismatch_high=2.0)
    loss, _ = policy_loss(logp, sampler_logp, torch.tensor([1.0, -1.0]), mask, cfg)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    from grpo import mismatch_weight

    weight, _ = mismatch_weight(logp, sampler_logp, mask, mode, 0.5, 2.0)
    want = {"tis": [[1, 2, 1], [1, 1, 1]], "mask": [[1, 0, 1], [1, 1, 1]], "seq-mask": [[0, 0, 0], [1, 1, 1]]}[mode]
    assert weight.tolist() == want
    if mode != "tis":
        assert logp.grad[0, 1] == 0  # the dropped token moves nothing


def test_loss_hand_checked():
    # one sequence, two tokens; ratios 2 and 0.5 against eps 0.2
    logp = torch.log(torch.tensor([[0.4, 0.1]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.2, 0.2]], dtype=torch.float64))
    mask = torch.ones(1, 2, dtype=torch.float64)
    # A = +1: min(2, 1.2) = 1.2 and min(0.5, 0.8) = 0.5 -> loss -(1.2 + 0.5) / 2
    loss, m = policy_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), mask, loss_config())
    assert loss.item() == pytest.approx(-0.85)
    assert m["clip_high_frac"] == 1 and m["clip_low_frac"] == 0
    # A = -1: min(-2, -1.2) = -2 and min(-0.5, -0.8) = -0.8 -> loss (2 + 0.8) / 2
    loss, m = policy_loss(logp, old, torch.tensor([-1.0], dtype=torch.float64), mask, loss_config())
    assert loss.item() == pytest.approx(1.4)
    assert m["clip_low_frac"] == 1 and m["clip_high_frac"] == 0


CASES = [
    dict(loss_type="grpo"),
    dict(loss_type="bnpo"),
    dict(loss_type="dapo", epsilon_high=0.28),
    dict(loss_type="dr_grpo"),
    dict(loss_type="grpo", importance="sequence"),
    dict(loss_type="bnpo", beta=0.05),
    dict(loss_type="grpo", mismatch="tis", mismatch_high=1.5),
    dict(loss_type="dr_grpo", beta=0.1, mismatch="tis", mismatch_high=2.0, epsilon_high=0.3),
    dict(loss_type="grpo", mismatch="mask", mismatch_low=0.8, mismatch_high=1.25),
    dict(loss_type="bnpo", beta=0.1, mismatch="mask", mismatch_low=0.9, mismatch_high=1.1),
    dict(loss_type="grpo", mismatch="seq-mask", mismatch_low=0.95, mismatch_high=1.05),
    dict(loss_type="dr_grpo", mismatch="seq-mask", mismatch_low=0.9, mismatch_high=1.1),
    dict(loss_type="grpo", distill_coef=1.0),
    dict(loss_type="dapo", distill_coef=0.3, beta=0.1, mismatch="mask", mismatch_low=0.8, mismatch_high=1.25),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("seed", range(4))
def test_loss_matches_loops(case, seed):
    logp, old, ref, adv, mask = random_batch(seed)
    eps_high = case.get("epsilon_high", 0.2)
    teacher = None
    if "distill_coef" in case:  # a teacher that disagrees with the policy by about 0.5 per token
        teacher = logp + torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed), dtype=logp.dtype) / 2
    got, stats = policy_loss(logp, old, adv, mask, loss_config(**case), ref_logp=ref, teacher_logp=teacher)
    if teacher is not None:
        assert stats["teacher_kl"].item() == pytest.approx(((logp - teacher) * mask).sum().item(), rel=1e-12)
    want = ref_loss(
        logp.tolist(),
        old.tolist(),
        adv.tolist(),
        mask.tolist(),
        case["loss_type"],
        0.2,
        eps_high,
        case.get("importance", "token"),
        7,
        ref.tolist(),
        case.get("beta", 0.0),
        case.get("mismatch", "none"),
        case.get("mismatch_low"),
        case.get("mismatch_high"),
        None if teacher is None else teacher.tolist(),
        case.get("distill_coef", 0.0),
    )
    assert got.item() == pytest.approx(want, rel=1e-10, abs=1e-12)


# The other objectives, through the same aggregation and KL.
ALL_CASES = CASES + [
    dict(loss_type="bnpo", objective="cispo", epsilon_high=0.3),
    dict(loss_type="dr_grpo", objective="sapo", beta=0.05),
    dict(objective="sapo", mismatch="tis", mismatch_high=1.5),
    dict(objective="cispo", mismatch="mask", mismatch_low=0.8, mismatch_high=1.25),
]


@pytest.mark.parametrize("case", ALL_CASES, ids=[str(c) for c in ALL_CASES])
def test_micro_batch_losses_sum_to_the_batch_loss(case):
    logp, old, ref, adv, mask = random_batch(11, B=6)
    cfg = loss_config(**case)
    whole, _ = policy_loss(logp, old, adv, mask, cfg, ref_logp=ref)
    parts = sum(
        policy_loss(
            logp[i : i + 2],
            old[i : i + 2],
            adv[i : i + 2],
            mask[i : i + 2],
            cfg,
            ref_logp=ref[i : i + 2],
            num_sequences=6,
            num_tokens=mask.sum(),
        )[0]
        for i in range(0, 6, 2)
    )
    assert parts.item() == pytest.approx(whole.item(), rel=1e-12)


@pytest.mark.parametrize("mode", ["mask", "seq-mask"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_masking_a_token_removes_exactly_its_gradient(mode, loss_type):
    """Against the same loss with the weight of plain IS (TIS with no cap): each token the
    mask drops has a gradient of exactly 0, and every other token keeps its gradient as
    it was (times 1/ratio for seq-mask, which keeps tokens at weight 1), bit for bit."""
    logp, old, ref, adv, mask = random_batch(7, B=8)
    band = {"mask": (0.8, 1.25), "seq-mask": (0.95, 1.05)}[mode]
    grads, stats = {}, {}
    plain_is = dict(mismatch="tis", mismatch_high=math.inf)
    for name, case in [("is", plain_is), (mode, dict(mismatch=mode, mismatch_low=band[0], mismatch_high=band[1]))]:
        x = logp.clone().requires_grad_()
        cfg = loss_config(loss_type=loss_type, beta=0.1, **case)
        loss, stats[name] = policy_loss(x, old, adv, mask, cfg, ref_logp=ref)
        loss.backward()
        grads[name] = x.grad
    ratio = torch.exp(logp - old)
    geometric = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))[:, None]
    inside = (
        (ratio >= band[0]) & (ratio <= band[1]) if mode == "mask" else (geometric >= band[0]) & (geometric <= band[1])
    )
    kept, dropped = mask.bool() & inside, mask.bool() & ~inside
    assert 0 < dropped.sum() < mask.sum()  # the batch has both
    assert torch.all(grads[mode][dropped] == 0) and torch.all(grads[mode][kept] != 0)
    want = grads["is"] if mode == "mask" else grads["is"] / ratio.expand_as(mask)
    assert torch.allclose(grads[mode][kept], want[kept], rtol=1e-12, atol=0)
    assert stats[mode]["mismatch_masked_tokens"] == dropped.sum()
    assert stats[mode]["mismatch_masked_seqs"] == dropped.any(-1).sum()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_gradient_at_ratio_one(loss_type):
    """With rho = 1 the gradient is -A * grad(logp), averaged as the type defines."""
    _, _, _, adv, mask = random_batch(3)
    logp = (-torch.rand(mask.shape, dtype=torch.float64)).requires_grad_()
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, loss_config(loss_type=loss_type))
    loss.backward()
    B, lengths, tokens = mask.shape[0], mask.sum(-1, keepdim=True), mask.sum()
    norm = {"grpo": B * lengths, "bnpo": tokens, "dr_grpo": B * 7}[loss_type]
    assert torch.allclose(logp.grad, -adv[:, None] * mask / norm, atol=1e-12)


def test_gspo_gradient_flows_per_token():
    _, old, _, adv, mask = random_batch(5)
    logp = old.clone().requires_grad_()  # ratio 1: GSPO's gradient is s_i * mean_t grad logp
    loss, _ = policy_loss(logp, old, adv, mask, loss_config(importance="sequence"))
    loss.backward()
    assert torch.allclose(logp.grad, -adv[:, None] * mask / (mask.shape[0] * mask.sum(-1, keepdim=True)), atol=1e-12)


def ref_clip_gradient(logp, old, adv, mask, importance, eps_low=0.2, eps_high=0.2):
    """d loss / d logp of the clipped objective under grpo aggregation, by hand: the
    unclipped side passes ratio * A (the sequence ratio s under GSPO, since each token's
    ratio is s * exp(logp_t - sg(logp_t))); a clipped side passes nothing."""
    B, T = len(logp), len(logp[0])
    grad = [[0.0] * T for _ in range(B)]
    for i in range(B):
        idx = [t for t in range(T) if mask[i][t]]
        s = math.exp(sum(logp[i][t] - old[i][t] for t in idx) / len(idx))
        for t in idx:
            r = s if importance == "sequence" else math.exp(logp[i][t] - old[i][t])
            clipped = (adv[i] > 0 and r > 1 + eps_high) or (adv[i] < 0 and r < 1 - eps_low)
            grad[i][t] = 0.0 if clipped else -adv[i] * r / (B * len(idx))
    return torch.tensor(grad, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(4))
def test_importance_modes_differ_away_from_ratio_one(seed):
    """Ratios spread around 1, some sequences and tokens past the clip range: the token
    and sequence (GSPO) gradients each match their hand-written form, and differ."""
    logp, _, _, adv, mask = random_batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    old = logp + torch.randn(logp.shape, generator=g, dtype=torch.float64) * 0.4
    grads = {}
    for importance in ("token", "sequence"):
        x = logp.clone().requires_grad_()
        loss, _ = policy_loss(x, old, adv, mask, loss_config(importance=importance))
        loss.backward()
        want = ref_clip_gradient(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), importance)
        assert torch.allclose(x.grad, want, atol=1e-12), importance
        grads[importance] = x.grad
    seq_ratio = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    assert ((seq_ratio > 1.2) | (seq_ratio < 0.8)).any() or seed != 0  # some sequence leaves the clip range
    assert (grads["token"] - grads["sequence"]).abs().max() > 1e-3


# ---------------------------------------------------------------- CISPO and SAPO against loops


def ref_cispo_gradient(logp, old, adv, mask, eps_high):
    """CISPO's gradient, by hand: each token passes min(r, 1 + eps_high) * A, normalised per sequence (grpo)."""
    B, T = len(logp), len(logp[0])
    grad = [[0.0] * T for _ in range(B)]
    for i in range(B):
        idx = [t for t in range(T) if mask[i][t]]
        for t in idx:
            weight = min(math.exp(logp[i][t] - old[i][t]), 1 + eps_high)
            grad[i][t] = -weight * adv[i] / (B * len(idx))
    return torch.tensor(grad, dtype=torch.float64)


def ref_sapo(logp, old, adv, mask, tau_pos, tau_neg):
    """SAPO's loss and gradient, by hand, grpo aggregation: f(r) = 4/tau sigmoid(tau (r - 1)),
    loss -f(r) A, and d/dlogp = -4 s (1 - s) r A."""
    B, T = len(logp), len(logp[0])
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        idx = [t for t in range(T) if mask[i][t]]
        tau = tau_pos if adv[i] > 0 else tau_neg
        for t in idx:
            r = math.exp(logp[i][t] - old[i][t])
            s = 1 / (1 + math.exp(-tau * (r - 1)))
            loss += -(4 / tau) * s * adv[i] / (B * len(idx))
            grad[i][t] = -4 * s * (1 - s) * r * adv[i] / (B * len(idx))
    return loss, torch.tensor(grad, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(4))
def test_cispo_matches_loop(seed):
    logp, old, _, adv, mask = random_batch(seed)
    x = logp.clone().requires_grad_()
    loss, m = policy_loss(x, old, adv, mask, loss_config(objective="cispo", epsilon_high=0.1))
    loss.backward()
    assert torch.allclose(
        x.grad, ref_cispo_gradient(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.1), atol=1e-12
    )
    assert 0 < m["clip_high_frac"] < mask.sum()  # the cap binds on some tokens, not all


@pytest.mark.parametrize("seed", range(4))
def test_sapo_matches_loop(seed):
    logp, old, _, adv, mask = random_batch(seed)
    x = logp.clone().requires_grad_()
    loss, _ = policy_loss(x, old, adv, mask, loss_config(objective="sapo", objective_args="tau_pos=1.0,tau_neg=1.5"))
    loss.backward()
    want_loss, want_grad = ref_sapo(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 1.0, 1.5)
    assert loss.item() == pytest.approx(want_loss, rel=1e-10)
    assert torch.allclose(x.grad, want_grad, atol=1e-12)


def test_a_user_objective_loads_by_module_path():
    """--objective module:function: a user's objective plugs in without touching grpo.py."""
    logp, old, _, adv, mask = random_batch(1)
    loss, m = policy_loss(logp, old, adv, mask, loss_config(objective="user_objective:reinforce"))
    want = sum(
        -adv[i].item() * logp[i][t].item() * mask[i][t].item() / mask[i].sum().item()
        for i in range(len(logp))
        for t in range(logp.shape[1])
    ) / len(logp)
    assert loss.item() == pytest.approx(want, rel=1e-10) and "ratio_mean" in m


def test_an_objective_declares_its_own_parameters():
    """An objective's keyword defaults are its parameters: --objective-args sets them, the
    flags of the same name (epsilon, ...) fill the shared ones, and a bad one is refused
    when the config resolves, before any model loads."""
    from grpo import bind_objective

    logp, old, _, adv, mask = random_batch(2)
    base, _ = policy_loss(logp, old, adv, mask, loss_config(objective="user_objective:scaled_reinforce"))
    twice, _ = policy_loss(
        logp, old, adv, mask, loss_config(objective="user_objective:scaled_reinforce", objective_args="scale=2")
    )
    assert twice.item() == pytest.approx(2 * base.item(), rel=1e-12)
    bound = bind_objective(loss_config(objective="clip", epsilon=0.1, epsilon_high=0.3))
    assert bound.keywords == {"epsilon": 0.1, "epsilon_high": 0.3, "importance": "token"}
    bound = bind_objective(loss_config(objective="sapo", objective_args="tau_neg=2"))
    assert bound.keywords["tau_neg"] == 2.0 and "tau_pos" not in bound.keywords  # its own default
    for args, why in [
        ("--objective-args scale=-1", "scale must be > 0"),
        ("--objective-args scale=abc", "is not a float"),
        ("--objective-args temperature=2", "has no parameter 'temperature'"),
    ]:
        argv = ["--objective", "user_objective:scaled_reinforce", *args.split(), "--out-dir", "/nonexistent/run"]
        with pytest.raises(SystemExit) as e:
            resolve(parse_config(argv), world_size=3, has_gpu=False)
        assert e.value.code == 2
    for args in ("tau_pos=0", "tau_pos=x"):
        with pytest.raises(ValueError):
            bind_objective(loss_config(objective="sapo", objective_args=args))


def test_the_mismatch_flags_resolve_to_one_band_or_refuse_in_one_line(capsys):
    def resolved(args):
        argv = [*args.split(), "--out-dir", "/nonexistent/run"]
        cfg = resolve(parse_config(argv), world_size=3, has_gpu=False)
        return cfg.mismatch, cfg.mismatch_low, cfg.mismatch_high

    assert resolved("") == ("none", None, None)
    assert resolved("--tis-cap 1.5") == resolved("--mismatch tis --mismatch-high 1.5") == ("tis", None, 1.5)
    assert resolved("--mismatch tis") == ("tis", None, 2.0)
    assert resolved("--mismatch mask") == ("mask", 0.5, 5.0)  # IcePop's band
    assert resolved("--mismatch seq-mask --mismatch-low 0.98") == ("seq-mask", 0.98, 1.01)
    for args, why in [
        ("--mismatch icepop", "--mismatch must be one of none, tis, mask, seq-mask"),
        ("--tis-cap 2 --mismatch mask", "--tis-cap 2.0 is short for --mismatch tis"),
        ("--tis-cap 2 --mismatch-high 3", "--tis-cap 2.0 is short for --mismatch tis"),
        ("--mismatch-high 3", "need a --mismatch correction"),
        ("--mismatch tis --mismatch-low 0.5", "caps the ratio from above only"),
        ("--mismatch tis --mismatch-high 0", "must be > 0"),
        ("--mismatch mask --mismatch-low 1.1", "band must hold 1"),
        ("--mismatch seq-mask --mismatch-high 0.9", "band must hold 1"),
    ]:
        assert why in refusal(capsys, args), args


def test_overlong_penalty():
    assert overlong_penalty(10, 32, 8) == 0.0
    assert overlong_penalty(24, 32, 8) == 0.0
    assert overlong_penalty(28, 32, 8) == -0.5
    assert overlong_penalty(32, 32, 8) == -1.0


# ---------------------------------------------------------------- invariance to the split


def test_one_step_is_invariant_to_learners_and_micro_batches(tiny_model, tmp_path):
    """1 or 2 FSDP learners, micro-batches of 1, 2 or all sequences or packed to 30 or
    4096 tokens: the same updated weights for every loss type (SGD, so a wrong
    normaliser cannot hide)."""
    from safetensors.torch import load_file

    worker = os.path.join(ROOT, "tests", "plugins", "invariance_worker.py")
    for n in (1, 2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(n),
            "--master-port",
            str(free_port()),
            worker,
            tiny_model,
            str(tmp_path),
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
    initial = load_file(os.path.join(tiny_model, "model.safetensors"))
    names = sorted({os.path.basename(f).split("-")[0] for f in glob.glob(str(tmp_path / "*.pt"))})
    assert names == sorted(
        ["bnpo", "cispo", "dapo", "dr_grpo", "grpo", "gspo", "icepop", "kl_tis", "lora", "sapo", "seq_mask"]
        + ["episodes", "episodes_env0"]
    )
    # the environment's ids carry no loss: whatever log-probs they hold, the same step
    same = (
        torch.load(tmp_path / "episodes-seq1-L2.pt")["state"],
        torch.load(tmp_path / "episodes_env0-seq1-L2.pt")["state"],
    )
    assert all(torch.equal(same[0][k], same[1][k]) for k in same[0])
    masked = torch.load(tmp_path / "episodes-seq1-L1.pt")["sums"]
    plain = torch.load(tmp_path / "grpo-seq1-L1.pt")["sums"]
    assert 0 < masked["tokens"] < plain["tokens"]  # the counts leave the environment's ids out
    for name in ("icepop", "seq_mask"):  # the masks drop some tokens (on one learner, its sums are the step's)
        sums = torch.load(tmp_path / f"{name}-seq1-L1.pt")["sums"]
        assert 0 < sums["mismatch_masked_tokens"] < sums["tokens"], sums
        assert 0 < sums["mismatch_masked_seqs"] <= sums["sequences_trained"], sums
    for name in names:
        runs = {os.path.basename(f): torch.load(f)["state"] for f in sorted(glob.glob(str(tmp_path / f"{name}-*.pt")))}
        assert len(runs) == 10
        first = next(iter(runs.values()))
        moved = max((first[k] - initial[k]).abs().max().item() for k in initial)
        assert moved > 1e-3, f"{name}: the step did not move the weights"
        worst = max((w[k] - first[k]).abs().max().item() for w in runs.values() for k in first)
        print(f"{name}: moved {moved:.3g}, max diff across splits {worst:.2e}")
        # float32 summation order only (measured 6e-7 to 1.0e-6: BLAS blocks a matmul by its
        # row count, so micro-batches of other sizes round differently); a wrong normaliser
        # or a dropped micro-batch moves the weights by 1e-3 and more.
        assert worst < 2e-6, name


def test_packing_keeps_every_sequence_within_the_budget_and_pads_little():
    from grpo import Rollout, micro_batches, sequence_length

    rng = random.Random(0)
    rollouts = [Rollout([0] * rng.randint(20, 60), [0] * rng.randint(1, 40), [], "", False) for _ in range(200)]
    packed = micro_batches(rollouts, 512, 8)
    assert sorted(id(c) for mb in packed for c in mb) == sorted(id(c) for c in rollouts)
    positions = [len(mb) * max(map(sequence_length, mb)) for mb in packed]
    assert max(positions) <= 512
    padded = 1 - sum(map(sequence_length, rollouts)) / sum(positions)
    print(f"packed {len(rollouts)} sequences into {len(packed)} micro-batches, {padded:.1%} padding")
    assert padded < 0.05
    fixed = micro_batches(rollouts, 0, 8)
    assert len(fixed) == 25 and all(len(mb) == 8 for mb in fixed)
