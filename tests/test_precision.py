"""One precision policy for both devices: the table of what --dtype resolves to, the
per-parameter wire dtypes, and the learner really computing in bf16 over float32 master
weights (a real FSDP2 learner on the tiny model)."""

import math

import pytest
import torch

from comm import bucket_plan, plan_bytes, wire_dtype
from config import cpu_has_bf16, precision


@pytest.mark.parametrize(
    "flag, has_gpu, cpu_bf16, expected",
    [
        (None, True, False, "bfloat16"),  # CUDA GPUs compute in bf16
        (None, False, True, "bfloat16"),  # CPUs with AVX512-BF16 or AMX
        (None, False, False, "float32"),  # other CPUs: bf16 would be emulated, slower
        ("float32", True, True, "float32"),  # an explicit choice wins everywhere
        ("bfloat16", False, False, "bfloat16"),
        ("float16", True, True, "float16"),  # only ever asked for
    ],
)
def test_precision_table(flag, has_gpu, cpu_bf16, expected):
    assert precision(flag, has_gpu, cpu_bf16) == expected


def test_cpu_bf16_is_read_from_the_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n")
    assert cpu_has_bf16(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n")
    assert cpu_has_bf16(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n")
    assert not cpu_has_bf16(str(info))
    assert not cpu_has_bf16(str(tmp_path / "absent"))


def test_parameters_kept_in_float32_travel_in_float32():
    """A gated delta net's A_log stays float32 in a bf16 engine: the bucket plan gives it
    a float32 bucket of its own, and the rest travels in bf16."""
    plan = [
        (f"model.layers.{i}.{leaf}", torch.Size([4, 4]))
        for i in range(2)
        for leaf in ("linear_attn.A_log", "linear_attn.in_proj.weight", "mlp.up_proj.weight")
    ]
    kept = {"linear_attn.A_log": torch.float32}
    buckets = bucket_plan(plan, lambda name: wire_dtype(name, torch.bfloat16, kept), bucket_bytes=10**9)
    assert [(d, [n.split(".", 3)[-1] for n, _ in b]) for d, b in buckets] == [
        (torch.float32, ["linear_attn.A_log"]),
        (torch.bfloat16, ["linear_attn.in_proj.weight", "mlp.up_proj.weight"]),
        (torch.float32, ["linear_attn.A_log"]),
        (torch.bfloat16, ["linear_attn.in_proj.weight", "mlp.up_proj.weight"]),
    ]
    assert plan_bytes(buckets) == 2 * 16 * 4 + 4 * 16 * 2
    # Buckets still close at the byte budget within one dtype.
    assert len(bucket_plan(plan, lambda name: torch.bfloat16, bucket_bytes=32)) == 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_learner_computes_in_half_precision_over_float32_master_weights(tiny_model, gloo_world, dtype):
    """bf16, and float16 with its loss scaler: the gradient norm the step clips is the
    unscaled one, as a float32 learner's (a forgotten unscale makes it 65536x), and a
    backward that overflows float16 skips the step and halves the scale."""
    from torch.distributed.device_mesh import init_device_mesh

    from learner import Learner

    mesh = init_device_mesh("cpu", (1,))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    exact = Learner(tiny_model, mesh, torch.device("cpu"), lr=1e-3, compute_dtype=torch.float32)
    (-exact.token_logprobs(exact.model, ids, torch.ones_like(ids), 1.0)[0].mean()).backward()
    exact_norm = exact.clip_grad_and_step(1e9)
    learner = Learner(tiny_model, mesh, torch.device("cpu"), lr=1e-3, compute_dtype=dtype)
    assert (learner.scaler is not None) == (dtype == torch.float16)
    seen = []
    learner.model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    logp, entropy = learner.token_logprobs(learner.model, ids, torch.ones_like(ids), 1.0)
    assert seen == [dtype]  # the blocks compute in half precision
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32  # the log-prob maths do not
    for _ in range(20):
        scale = learner.scaler.get_scale() if learner.scaler else 1.0
        loss = -learner.token_logprobs(learner.model, ids, torch.ones_like(ids), 1.0)[0].mean()
        (learner.scaler.scale(loss) if learner.scaler else loss).backward()
        norm = learner.clip_grad_and_step(1e9)
        if math.isfinite(norm):
            break
        assert learner.scaler.get_scale() == scale / 2  # an overflow: no step, half the scale
    assert norm == pytest.approx(exact_norm, rel=0.05)
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}  # master weights
    assert {p.grad is None for p in learner.model.parameters()} == {True}
    states = [v for s in learner.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    assert states and {v.dtype for v in states} == {torch.float32}  # AdamW's moments


def test_bf16_run_keeps_sampler_and_learner_close(tiny_model, tmp_path):
    """Both engines in bf16 (the GPU path, and the default on a CPU with native bf16;
    elsewhere the console says it is emulated): after each sync the sampler's and the
    learner's log-probs of the same tokens differ by bf16 rounding only. bf16 keeps 8
    bits of mantissa (a relative step of 2^-8 = 0.4%); the two engines round different
    sums in different orders, so a logit of magnitude ~10 can move by a few hundredths,
    and a token's log-prob by as much. Measured on this model: mean
    3e-4 to 8e-4, max 0.003 to 0.044 per step. The bounds are 10x and 5x that: a stale or
    broken sync gives gaps of order 1 (see the tied-head test: 1.4)."""
    import json

    from conftest import torchrun

    out = tmp_path / "run"
    args = ["--learners", 2, "--steps", 3, "--prompts-per-step", 8, "--group-size", 4, "--eval-every", 0]
    result = torchrun(3, *args, "--max-staleness", 0, "--dtype", "bfloat16", "--out-dir", out)
    assert result.returncode == 0, result.stdout[-4000:]
    assert ("bf16 is emulated here" in result.stdout) == (not cpu_has_bf16()), result.stdout[-4000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    print(
        "bf16 mismatch mean/max per step:", [(round(r["mismatch_mean"], 5), round(r["mismatch_max"], 4)) for r in rows]
    )
    for r in rows:
        assert r["mismatch_mean"] < 5e-3 and r["mismatch_max"] < 0.2, r
        assert r["grad_norm"] > 0


def test_fp16_run_keeps_sampler_and_learner_closer_still(tiny_model, tmp_path):
    """Both engines in float16 (Qi et al., 2025): 10 mantissa bits to bf16's 7, so the two
    engines' log-probs of the same tokens differ less. Measured on this model (Xeon with
    AVX512-FP16): mean 1e-5 to 1e-4, max 4e-4 to 3e-3 per step; the bounds are 10x and
    15x that, and 5x tighter than bf16's. The loss scaler's state goes into checkpoints."""
    import json

    from conftest import torchrun

    out = tmp_path / "run"
    args = ["--learners", 1, "--steps", 3, "--prompts-per-step", 8, "--group-size", 4, "--eval-every", 0]
    result = torchrun(2, *args, "--max-staleness", 0, "--dtype", "float16", "--save-every", 2, "--out-dir", out)
    assert result.returncode == 0, result.stdout[-4000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    print("fp16 mismatch mean/max per step:", [(r["mismatch_mean"], r["mismatch_max"]) for r in rows])
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["mismatch_mean"] < 1e-3 and r["mismatch_max"] < 0.04 and r["grad_norm"] > 0, r
    trainer = json.loads((out / "checkpoints" / "step_2" / "trainer.json").read_text())
    assert trainer["schedule"]["grad_scaler"]["scale"] == 2.0**16  # no overflow in 2 steps


@pytest.mark.parametrize(
    "device, dtype, width, expected",
    [
        ("cpu", torch.bfloat16, 100, "eager"),  # torch's CPU flash kernel is slow in bf16 here
        ("cpu", torch.bfloat16, 240, "eager"),
        ("cpu", torch.bfloat16, 241, "sdpa"),  # wider, eager's score tensors outgrow the caches
        ("cpu", torch.float32, 100, "sdpa"),  # float32: flash is the faster
        ("cuda", torch.bfloat16, 100, "sdpa"),  # GPUs keep what the model loaded with
    ],
)
def test_attention_kernel_table(device, dtype, width, expected):
    from logprobs import attention_kernel

    assert attention_kernel(device, dtype, width, "sdpa") == expected


def test_bf16_learner_on_cpu_takes_eager_attention_for_short_batches(tiny_model, gloo_world, monkeypatch):
    """The kernel follows each micro-batch's width, and both give the same log-probs to
    bf16 rounding: these random tokens are improbable (log-probs near -10, where bf16's
    logit step is 0.06), measured mean 8e-3 and max 0.06 apart. A wrong mask or scale
    moves them by order 1."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from learner import Learner
    from logprobs import EAGER_MAX_WIDTH

    used = []
    functions = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS
    original = functions["sdpa"]
    monkeypatch.setitem(functions, "sdpa", lambda *a, **k: used.append("sdpa") or original(*a, **k))
    mesh = init_device_mesh("cpu", (1,))
    learner = Learner(tiny_model, mesh, torch.device("cpu"), lr=1e-3, compute_dtype=torch.bfloat16)
    torch.manual_seed(0)
    short = torch.randint(3, 200, (2, 40))
    logp_eager = learner.token_logprobs(learner.model, short, torch.ones_like(short), 1.0)[0]
    assert used == []  # eager for every layer
    long = torch.cat([short, torch.randint(3, 200, (2, EAGER_MAX_WIDTH + 1 - 40))], dim=1)
    logp_sdpa = learner.token_logprobs(learner.model, long, torch.ones_like(long), 1.0)[0][:, : 40 - 1]
    assert used == ["sdpa"] * learner.model.config.num_hidden_layers
    diff = (logp_eager - logp_sdpa).abs()
    print(f"eager vs sdpa in bf16: mean {diff.mean():.2e}, max {diff.max():.2e}")
    assert diff.mean() < 0.03 and diff.max() < 0.25
