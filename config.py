"""The run's configuration: one field per flag, each with its help as its comment; what
None (the only "auto") becomes for each model; and the rules a config must satisfy, each
with its one-line refusal, checked before any model loads (launch.sh runs them once,
before torchrun starts a rank)."""

import argparse
import contextlib
import dataclasses
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import sys
import types
from dataclasses import dataclass

HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"  # the default with a GPU


@dataclass
class Config:
    # ---- model and data
    model: str | None = None  # 'tiny', a hub name or a local HF folder; None: tiny without a GPU, else HUB_MODEL
    dataset: str | None = None  # 'synthetic', 'gsm8k' (the hub) or a .jsonl/.json/.parquet path; None: per model
    split: str = "train"  # the dataset's split to train on
    prompt_field: str = "question"  # dataset column with the prompt: the user message's text, or chat messages
    messages_field: str = "messages"  # column of chat messages [{role, content}]; where a row has it, the prompt
    env: str = ""  # an environment for episodes of several turns: module:function (episodes.py); empty: one turn
    max_turns: int = 1  # assistant turns per episode at most; > 1 needs --env or --tools
    tools: str = ""  # a ready environment: the functions the model may call, 'calculator,module:fn' (tools.py)
    # ---- the step
    learners: int = 1  # ranks 0..learners-1 train; the other ranks sample
    steps: int | None = None  # optimizer steps; None: per model
    prompts_per_step: int = 64  # prompts per step, over all samplers
    group_size: int | None = None  # completions per prompt (G); None: per model
    max_new_tokens: int | None = None  # tokens per completion (an episode's, both sides') at most; None: per model
    max_prompt_len: int = 512  # longer prompts are dropped (and counted)
    temperature: float = 1.0  # sampling temperature; the log-probs are those of the tempered policy
    max_staleness: int = 1  # 1: sample step k+1 while step k trains (the ratio corrects the lag); 0: on-policy
    # ---- the objective (grpo.py)
    objective: str = "clip"  # per-token objective: clip | cispo | sapo | my.module:fn (grpo.OBJECTIVES)
    objective_args: str = ""  # the objective's own parameters: 'name=value,...' (its keyword defaults otherwise)
    loss_type: str = "grpo"  # how per-token losses aggregate: grpo | bnpo | dr_grpo | dapo (grpo.aggregate)
    epsilon: float = 0.2  # the ratio's clip range below 1 (clip), and above 1 unless --epsilon-high
    epsilon_high: float | None = None  # the clip range above 1 (DAPO's clip-higher; CISPO's cap - 1); None: epsilon
    importance: str = "token"  # token | sequence (GSPO): the ratio every objective sees
    scale: str = "group"  # advantage scaling: group | batch | none
    beta: float | None = None  # k3 KL to the initial policy, as DeepSeekMath (a frozen, sharded copy); None: per model
    mismatch: str = "none"  # sampler/learner mismatch correction: none | tis | mask | seq-mask (grpo.mismatch_weight)
    mismatch_low: float | None = None  # the band's low end (mask, seq-mask); None: MISMATCH_BANDS
    mismatch_high: float | None = None  # the band's high end, tis's cap; None: MISMATCH_BANDS
    tis_cap: float = 0.0  # > 0: short for --mismatch tis --mismatch-high C
    drop_uniform_groups: bool | None = None  # DAPO: drop groups of all-equal rewards; None: per model
    overlong: str = "none"  # completions cut at --max-new-tokens: none | mask (out of the loss) | penalty (DAPO)
    overlong_buffer: int | None = None  # penalty ramp length in tokens; None: max-new-tokens // 4
    # ---- the optimizer
    lr: float | None = None  # AdamW's learning rate (with LoRA, A's); None: per model (x LORA_LR with LoRA)
    warmup_steps: int = 10  # linear learning-rate warm-up, then constant
    weight_decay: float = 0.0  # AdamW's weight decay
    max_grad_norm: float = 1.0  # the gradient norm is clipped to this
    # ---- the learner's memory and precision
    micro_batch_size: int = 8  # sequences per forward/backward, when not packing by tokens
    max_tokens_per_microbatch: int | None = None  # padded tokens per micro-batch; None: max(4096, one sequence)
    logprob_chunk: int = 1024  # positions per output-projection chunk in the log-probs; 0: the whole [T, V] at once
    gradient_checkpointing: bool = False  # recompute blocks in the backward: 1/15 the activations, 1/3 more compute
    compile: bool = False  # torch.compile the learner's blocks, and on CPU vLLM's model too; the first steps compile
    dtype: str | None = None  # bfloat16 | float32 | float16 (loss-scaled); None: bf16 where native (precision)
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank on --lora-targets (the base stays frozen)
    lora_alpha: float = 32.0  # the adapters scale by alpha / rank: a fixed alpha keeps one lr right across ranks
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # linear layers given adapters
    lora_b_lr: float = 16.0  # the adapters' B learn at this multiple of --lr, A at --lr (LoRA+; LORA_LR has why)
    # ---- the samplers and the sync
    sampler_gpu_memory: float | None = None  # vLLM's GPU fraction; None: 0.8 of a GPU alone, 0.3 beside a learner
    sampler_kv_cache_gb: float = 1.0  # vLLM's KV cache size (CPU only)
    sync_bucket_mb: float = 64.0  # weight broadcast bucket size
    timeout_minutes: float = 30.0  # every process group's timeout: how long a rank waits for a stuck peer
    hang_seconds: float = 60.0  # a rank silent this long (stopped, frozen, its node lost) ends the job; 0: never
    # ---- rewards (rewards.py)
    rewards: str = "accuracy,format"  # weighted sum: 'accuracy=1,format=0.5,my.module:fn=2'; fn(completion, record)
    reward_timeout: float = 10.0  # seconds per user-reward call; a slower call scores 0 and is counted
    reward_workers: int = 1  # processes running user rewards (built-ins run in the sampler)
    max_reward_errors: float = 0.5  # stop when more than this fraction of a step's completions had a reward fail
    # ---- on-policy distillation (grpo.policy_loss)
    teacher: str = ""  # a teacher (folder or hub name, same tokenizer): its per-token reverse KL joins the advantage
    distill_coef: float = 1.0  # weight of the teacher's per-token term; --rewards accuracy=0 distils alone
    # ---- eval, logs and checkpoints
    eval_every: int = 50  # greedy held-out eval every K steps, and at the start and end; 0: never
    eval_dataset: str = ""  # held-out set (its 'test' split); empty: --dataset's
    eval_size: int = 256  # held-out prompts per eval; 0: the whole test split
    eval_samples: int = 1  # completions per held-out prompt; > 1: pass@k and maj@n too (evals.py)
    eval_temperature: float | None = None  # None: greedy for one sample, --temperature for several
    eval_only: bool = False  # evaluate --model and exit
    samples_every: int = 10  # write two whole groups to samples.jsonl every K steps; 0: never
    seed: int = 0  # data order, sampling and initialisation
    out_dir: str = "runs/default"  # where the run writes
    save_every: int = 0  # checkpoint every N steps (and always on preemption); 0: only on preemption
    keep_last: int = 0  # keep the newest K checkpoints; 0: keep all
    resume: str = ""  # '--resume': out_dir's newest complete checkpoint; 'auto': that, else a fresh start; or a PATH
    overwrite: bool = False  # replace a run already in out_dir
    max_skips: int = 3  # abort after this many consecutive steps with a non-finite grad norm
    report_to: str = ""  # 'wandb' or 'tensorboard': also send every metrics row there


# What None becomes, per model: (the embedded tiny model, any other). The tiny model's
# reasons are in docs/results.md ("The embedded tiny model"): it learns arithmetic from chance
# at a high rate with few samples per prompt, needs a stronger pull to its reference to
# keep from collapsing in bf16, and at chance most of its groups carry no signal.
MODEL_DEFAULTS = {
    "dataset": ("synthetic", "gsm8k"),
    "steps": (300, 250),
    "group_size": (4, 8),
    "max_new_tokens": (24, 512),
    "lr": (1e-3, 1e-6),
    "beta": (0.1, 0.04),
    "drop_uniform_groups": (True, False),
}
# With --lora-rank and no --lr, the adapters' A learn at LORA_LR x the model's full fine-
# tuning lr, and B at --lora-b-lr x that: 0.5x and 8x on the tiny default. B starts at zero,
# so at first it alone moves the output, at a rate set by A's fixed random rows; a fast A
# turns those rows under what B has learnt (Hayou et al., 2024, LoRA+). Equal rates learned
# later than full fine-tuning at every lr tried, and collapsed above 3x (docs/results.md, LoRA).
LORA_LR = 0.5
# Each --mismatch correction's default band (low, high) on pi_learner / pi_sampler: TIS's
# cap of 2 (Yao et al., 2025), IcePop's [0.5, 5] (Ling team, 2025), and SkyRL's advice of
# about 1 +- 0.01 for a sequence's geometric mean.
MISMATCH_BANDS = {"none": (None, None), "tis": (None, 2.0), "mask": (0.5, 5.0), "seq-mask": (0.99, 1.01)}
TOOLS_ENV = "tools:use_tools"  # the environment --tools runs
DTYPES = ("bfloat16", "float32", "float16")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")


def field_help():
    """{field: its comment}: each field's comment in Config's source is its --help."""
    lines = inspect.getsource(Config).splitlines()
    helps = dict(m.groups() for m in (re.match(r"\s+(\w+): [^#]*#\s*(.*)", line) for line in lines) if m)
    return {f.name: helps.get(f.name, "") for f in dataclasses.fields(Config)}


def parse_config(argv):
    parser = argparse.ArgumentParser(
        prog="job.py", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    helps = field_help()
    for f in dataclasses.fields(Config):
        flag, kind = "--" + f.name.replace("_", "-"), _value_type(f.type)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=helps[f.name])
        elif f.name == "resume":
            parser.add_argument(flag, nargs="?", const="latest", default=f.default, help=helps[f.name])
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=helps[f.name])
    return Config(**vars(parser.parse_args(argv)))


def _value_type(annotation):
    """int for `int` and `int | None`, and so on."""
    if isinstance(annotation, types.UnionType):
        return next(t for t in annotation.__args__ if t is not type(None))
    return annotation


def parse_flags(argv):
    """parse_config, with argparse's usage and error (some fifty lines) cut to its one
    line of error, in fail()'s form; --help is unchanged."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_config(argv)
    except SystemExit as e:
        if e.code:
            fail(err.getvalue().strip().splitlines()[-1].partition("error: ")[2])
        raise


def fail(message, every_rank=False):
    """One clear line and a non-zero exit, before anything heavy loads. Under torchrun
    every rank checks the same flags, so only local rank 0 says why (`every_rank`: a
    check whose answer differs between ranks)."""
    if every_rank or os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"job.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def cpu_has_bf16(cpuinfo="/proc/cpuinfo"):
    """Whether this CPU multiplies in bf16 natively (AVX512-BF16 or AMX), from its flags."""
    try:
        with open(cpuinfo) as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def precision(dtype, has_gpu, cpu_bf16):
    """The one compute dtype of a run, for both devices: None is bfloat16 where the
    hardware multiplies in bf16 natively (CUDA GPUs; CPUs with AVX512-BF16 or AMX), else
    float32. From it: FSDP2 keeps float32 master weights and AdamW state, computes in it
    and reduces gradients in float32; vLLM runs in it; each parameter travels in the
    dtype the engine keeps it in (comm.wire_dtype); log-probs and the loss are float32
    always (logprobs.token_logprobs). float16 is only ever asked for: its 3 more mantissa
    bits shrink the sampler/learner mismatch (Qi et al., 2025), but its 5 exponent bits
    need a loss scaler (learner.Learner) and it is slow where the hardware lacks it."""
    if dtype is None:
        return "bfloat16" if has_gpu or cpu_bf16 else "float32"
    return dtype


def resolve(cfg, world_size, has_gpu, cpu_bf16=False, network=False):
    """Fill every None and check every rule against the world, so that a config that
    cannot work stops here with the flag's name, before any model loads. `network`:
    also ask the hub for a hub model (launch.sh's check does, once)."""
    cfg.model = cfg.model or (HUB_MODEL if has_gpu else "tiny")
    if cfg.teacher and cfg.drop_uniform_groups is None:  # a group of equal rewards still learns from the teacher
        cfg.drop_uniform_groups = False
    lr_given = cfg.lr is not None
    for name, (for_tiny, for_others) in MODEL_DEFAULTS.items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, for_tiny if cfg.model == "tiny" else for_others)
    if cfg.lora_rank and not lr_given:
        cfg.lr *= LORA_LR
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        fail(f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    cfg.dtype = precision(cfg.dtype, has_gpu, cpu_bf16)
    cfg.epsilon_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    cfg.overlong_buffer = cfg.max_new_tokens // 4 if cfg.overlong_buffer is None else cfg.overlong_buffer
    if cfg.max_tokens_per_microbatch is None:  # room for one whole sequence at least
        cfg.max_tokens_per_microbatch = max(4096, cfg.max_prompt_len + cfg.max_new_tokens)
    if cfg.tis_cap and cfg.mismatch in ("none", "tis") and cfg.mismatch_high is None:  # the shorthand
        cfg.mismatch, cfg.mismatch_high = "tis", cfg.tis_cap
    low, high = MISMATCH_BANDS.get(cfg.mismatch, (None, None))
    cfg.mismatch_low = low if cfg.mismatch_low is None else cfg.mismatch_low
    cfg.mismatch_high = high if cfg.mismatch_high is None else cfg.mismatch_high
    if cfg.eval_only:
        cfg.steps = 0
    if cfg.tools and not cfg.env:
        cfg.env = TOOLS_ENV
    if cfg.eval_temperature is None:
        cfg.eval_temperature = 0.0 if cfg.eval_samples == 1 else cfg.temperature
    for section in RULES:
        for ok, message in section(cfg, world_size, has_gpu):
            if not ok:
                fail(message)
    return check_loadable(cfg, has_gpu, network)


# ---------------------------------------------------------------- the rules, by Config's sections
# Each yields (holds, the one line that says why not); resolve stops at the first that
# fails, so a rule may count on those before it. None of them loads anything.


def step_rules(cfg, world_size, has_gpu):
    samplers = world_size - cfg.learners
    yield cfg.learners >= 1, f"--learners must be at least 1, got {cfg.learners}"
    yield (
        samplers >= 1,
        f"--learners {cfg.learners} leaves no sampler rank in a world of {world_size}; use --learners {world_size - 1} or more ranks",
    )
    yield cfg.group_size >= 2, f"--group-size must be at least 2 for group advantages, got {cfg.group_size}"
    yield (
        cfg.prompts_per_step >= 1 and cfg.prompts_per_step % samplers == 0,
        f"--prompts-per-step {cfg.prompts_per_step} must be a positive multiple of the {samplers} sampler ranks",
    )
    yield (
        cfg.prompts_per_step * cfg.group_size % cfg.learners == 0,
        f"--prompts-per-step x --group-size ({cfg.prompts_per_step * cfg.group_size}) must divide across the {cfg.learners} learners",
    )
    yield (
        cfg.max_staleness in (0, 1),
        f"--max-staleness must be 0 or 1, got {cfg.max_staleness}: rollouts travel over blocking collectives, so the samplers run at most one step ahead",
    )
    yield from at_least(cfg, steps=0, max_new_tokens=1, max_prompt_len=1)
    yield cfg.temperature > 0, f"--temperature must be positive for sampling, got {cfg.temperature}"
    yield bool(cfg.prompt_field), "--prompt-field must name a dataset column"
    yield cfg.max_turns >= 1, f"--max-turns must be at least 1, got {cfg.max_turns}"
    yield not cfg.tools or cfg.env == TOOLS_ENV, "--tools is an environment of its own: give --tools or --env"
    yield (
        bool(cfg.env) == (cfg.max_turns > 1),
        "--env (or --tools) and --max-turns go together: an environment needs --max-turns 2 or more, and more turns need one",
    )


def objective_rules(cfg, world_size, has_gpu):
    yield (
        cfg.lr >= 0 and cfg.epsilon > 0 and cfg.epsilon_high >= cfg.epsilon,
        "--lr must be >= 0, --epsilon > 0 and --epsilon-high >= --epsilon",
    )
    yield cfg.beta >= 0 and cfg.tis_cap >= 0, "--beta and --tis-cap must be >= 0"
    yield (
        cfg.mismatch in MISMATCH_BANDS,
        f"--mismatch must be one of {', '.join(MISMATCH_BANDS)}, got {cfg.mismatch!r}",
    )
    low, high = cfg.mismatch_low, cfg.mismatch_high
    yield (
        not cfg.tis_cap or (cfg.mismatch == "tis" and high == cfg.tis_cap),
        f"--tis-cap {cfg.tis_cap} is short for --mismatch tis --mismatch-high {cfg.tis_cap}: give one or the other",
    )
    if cfg.mismatch == "none":
        yield low is None and high is None, "--mismatch-low and --mismatch-high need a --mismatch correction"
    elif cfg.mismatch == "tis":
        yield low is None, "--mismatch tis caps the ratio from above only: drop --mismatch-low"
        yield high > 0, f"--mismatch-high (the TIS cap) must be > 0, got {high}"
    else:
        yield (
            0 <= low <= 1 <= high,
            f"--mismatch {cfg.mismatch}'s band must hold 1: 0 <= --mismatch-low ({low}) <= 1 <= --mismatch-high ({high})",
        )
    yield from one_of(
        cfg,
        loss_type=LOSS_TYPES,
        scale=SCALES,
        importance=("token", "sequence"),
        overlong=("none", "mask", "penalty"),
    )


def memory_rules(cfg, world_size, has_gpu):
    seq = cfg.max_prompt_len + cfg.max_new_tokens
    yield (
        cfg.max_tokens_per_microbatch == 0 or cfg.max_tokens_per_microbatch >= seq,
        f"--max-tokens-per-microbatch {cfg.max_tokens_per_microbatch} cannot hold one sequence of --max-prompt-len + --max-new-tokens ({seq}) tokens",
    )
    yield from at_least(cfg, micro_batch_size=1, max_tokens_per_microbatch=0, logprob_chunk=0, lora_rank=0)
    yield (cfg.lora_b_lr > 0, f"--lora-b-lr must be > 0 (a multiple of --lr), got {cfg.lora_b_lr}")
    yield (
        not cfg.compile or has_gpu or any(shutil.which(c) for c in ("g++", "c++", "clang++")),
        "--compile on a CPU needs a C++ compiler (g++ or clang++) for torch.compile's kernels: install one or drop it",
    )
    yield (
        not cfg.lora_rank or any(cfg.lora_targets.split(",")),
        "--lora-targets must name at least one linear layer, e.g. q_proj,v_proj",
    )
    outer = sorted({"embed_tokens", "lm_head"} & set(cfg.lora_targets.split(",")))
    yield (
        not cfg.lora_rank or not outer,
        f"--lora-targets {','.join(outer)}: adapters go on the blocks' linear layers only, the embeddings and the output layer stay frozen (the tiny default learns as well with them frozen: docs/results.md, LoRA)",
    )


def reward_rules(cfg, world_size, has_gpu):
    yield from at_least(cfg, reward_workers=1)
    yield (
        cfg.reward_timeout > 0,
        f"--reward-timeout must be > 0 seconds (a hung reward must not stall a sampler), got {cfg.reward_timeout}",
    )
    yield (
        0 <= cfg.max_reward_errors <= 1,
        f"--max-reward-errors is a fraction in [0, 1], got {cfg.max_reward_errors}",
    )
    if cfg.teacher:
        yield (
            not cfg.drop_uniform_groups,
            "--teacher with --drop-uniform-groups would drop groups of equal rewards that still learn from the teacher: use --no-drop-uniform-groups",
        )
        yield cfg.distill_coef > 0, f"--distill-coef must be > 0 with a --teacher, got {cfg.distill_coef}"


def output_rules(cfg, world_size, has_gpu):
    yield cfg.eval_samples >= 1, f"--eval-samples must be at least 1, got {cfg.eval_samples}"
    yield (
        cfg.eval_temperature > 0 or cfg.eval_samples == 1,
        f"--eval-samples {cfg.eval_samples} at --eval-temperature 0 would draw one greedy completion {cfg.eval_samples} times: give a temperature > 0",
    )
    yield cfg.eval_temperature >= 0, f"--eval-temperature must be >= 0, got {cfg.eval_temperature}"
    yield (
        cfg.report_to in ("", "wandb", "tensorboard"),
        f"--report-to must be wandb or tensorboard, got {cfg.report_to!r}",
    )
    yield (
        not cfg.report_to or importlib.util.find_spec(cfg.report_to) is not None,
        f"--report-to {cfg.report_to}: the {cfg.report_to} package is not installed (pip install {cfg.report_to})",
    )
    yield cfg.hang_seconds >= 0, f"--hang-seconds must be >= 0 (0: no hang detection), got {cfg.hang_seconds}"
    yield (
        not (cfg.overwrite and cfg.resume == "auto"),
        "--overwrite with --resume auto (launch.sh's RESTARTS) would resume the run it replaces: remove the folder instead",
    )
    yield (
        cfg.resume or cfg.overwrite or cfg.eval_only or not os.path.exists(os.path.join(cfg.out_dir, "metrics.jsonl")),
        f"--out-dir {cfg.out_dir} already holds a run: pass --resume to continue it or --overwrite to replace it",
    )


RULES = (step_rules, objective_rules, memory_rules, reward_rules, output_rules)


def at_least(cfg, **lows):
    for name, low in lows.items():
        yield getattr(cfg, name) >= low, f"--{name.replace('_', '-')} must be at least {low}, got {getattr(cfg, name)}"


def one_of(cfg, **allowed):
    for name, values in allowed.items():
        value = getattr(cfg, name)
        yield value in values, f"--{name.replace('_', '-')} must be one of {', '.join(values)}, got {value!r}"


# ---------------------------------------------------------------- what the flags name


def check_loadable(cfg, has_gpu, network=False):
    """What the flags name must exist and load: the user's code (objective, rewards,
    environment, tools), the datasets, the model folders and the checkpoint to resume,
    which becomes a path; with `network`, a hub model must be in the cache or on the hub.
    The project's modules are imported here, not at import, so config.py stands alone."""
    import checkpoint
    from data import dataset_error
    from episodes import load_env
    from evals import accuracy_reward
    from grpo import bind_objective
    from models import is_hybrid
    from rewards import parse_reward_spec
    from tools import load_tools

    for name in ("dataset", "eval_dataset"):
        if error := getattr(cfg, name) and dataset_error(getattr(cfg, name)):
            fail(f"--{name.replace('_', '-')}: {error}")
    for flag, model in [("model", cfg.model if cfg.model != "tiny" else ""), ("teacher", cfg.teacher)]:
        if model and (error := model_folder_error(model)):
            fail(f"--{flag} {model}: {error}")
    if cfg.teacher and (error := teacher_tokenizer_error(cfg.model, cfg.teacher)):
        fail(f"--teacher {cfg.teacher}: {error}")
    # a hub model's config is not fetched here
    if not has_gpu and cfg.dtype == "float32" and os.path.isdir(cfg.model) and is_hybrid(cfg.model):
        fail(
            "--dtype float32: vLLM's CPU kernel for this model's linear-attention layers runs only in bf16 ('CPU GDN attention requires BF16'); use --dtype bfloat16"
        )
    for flag, check in [
        ("objective", lambda: bind_objective(cfg)),
        ("rewards", lambda: parse_reward_spec(cfg.rewards)),
        ("eval-samples", lambda: answers_read(cfg, accuracy_reward(parse_reward_spec(cfg.rewards)))),
        ("env", lambda: cfg.env and load_env(cfg.env)),
        ("tools", lambda: cfg.tools and load_tools(cfg.tools)),
    ]:
        try:
            check()
        except ValueError as e:
            fail(f"--{flag}: {e}")
    if cfg.resume:
        check_resume(cfg, checkpoint)
    if network and cfg.model != "tiny" and not os.path.isdir(cfg.model) and (error := hub_model_error(cfg.model)):
        fail(f"--model {cfg.model}: {error}")
    return cfg


# What a resumed run may change: where and how long it runs, what it logs and evaluates,
# and the knobs that change memory, not the maths (micro-batches are normalised exactly).
RESUME_MAY_CHANGE = {
    *("resume", "overwrite", "out_dir", "steps", "save_every", "keep_last", "samples_every", "report_to"),
    *("eval_every", "eval_dataset", "eval_size", "eval_samples", "eval_temperature", "eval_only"),
    *("timeout_minutes", "hang_seconds", "reward_workers", "compile", "gradient_checkpointing"),
    *("micro_batch_size", "max_tokens_per_microbatch", "logprob_chunk", "sync_bucket_mb"),
    *("sampler_gpu_memory", "sampler_kv_cache_gb", "learners"),
}


def check_resume(cfg, checkpoint):
    """--resume becomes a checkpoint's path (or "" for a fresh start under auto), each
    broken newer checkpoint passed over said in one line. Under auto, which a restart
    reruns unattended, the folder's run must be this config's, and a disk that cannot
    hold one more checkpoint is refused now rather than at the next save."""
    requested = cfg.resume
    try:
        cfg.resume, skipped = checkpoint.find_checkpoint(cfg.resume, cfg.out_dir)
    except ValueError as e:
        fail(f"--resume: {e}")
    for reason in skipped:
        print(f"job.py: --resume: {reason}: passed over", file=sys.stderr)
    if skipped:
        print(f"job.py: --resume: falling back to {cfg.resume}", file=sys.stderr)
    if requested != "auto":
        return
    # the run in the folder: its newest checkpoint's config, else (none saved yet) run.json's
    saved = os.path.join(cfg.resume, "trainer.json") if cfg.resume else os.path.join(cfg.out_dir, "run.json")
    if os.path.exists(saved):
        with open(saved) as f:
            changed = checkpoint.config_changes(json.load(f)["config"], cfg, RESUME_MAY_CHANGE)
        if changed:
            fail(
                f"--resume auto: {cfg.out_dir} holds a run with another config ({'; '.join(changed)}): use another --out-dir"
            )
    if cfg.resume and cfg.save_every and (short := checkpoint.disk_short(cfg.resume, cfg.out_dir)):
        free, need = short
        fail(
            f"--resume auto: {cfg.out_dir} has {free / 2**20:.0f} MB free and a checkpoint takes {need / 2**20:.0f} MB: free some space (or --keep-last)"
        )


def answers_read(cfg, accuracy):
    """pass@k and maj@n need to know which samples are right: a reward with `fn.answer`."""
    if cfg.eval_samples > 1 and not accuracy:
        raise ValueError(
            f"pass@k and maj@n need a reward in --rewards that declares the answer it reads (fn.answer), as accuracy does; got {cfg.rewards!r}"
        )


def check_placement(cfg, world_size, local_world_size, node, gpus):
    """Every local rank's placement on this node, as launch.sh's check runs it."""
    from comm import placement

    for local in range(local_world_size):
        try:
            placement(
                node * local_world_size + local,
                local,
                local_world_size,
                world_size,
                cfg.learners,
                gpus,
                cfg.sampler_gpu_memory,
            )
        except ValueError as e:
            fail(str(e))


def model_folder_error(model):
    """Why `model` cannot be a model folder, where it names one: anything but a hub name
    of the form 'namespace/name' must be a folder holding a config.json."""
    hub_name = model.count("/") == 1 and not model.startswith((".", "~")) and not os.path.exists(model)
    if not hub_name and not os.path.isfile(os.path.join(model, "config.json")):
        what = "a folder without a config.json" if os.path.isdir(model) else "no such folder"
        return f"{what} (a model is 'tiny', a local Hugging Face folder or a hub name 'namespace/name')"
    return None


def teacher_tokenizer_error(model, teacher):
    """Why the teacher cannot score the policy's tokens (another vocabulary), or None.
    Compared where both are folders (the tiny model once built); a hub name is not
    fetched here."""
    from tiny import tiny_model_dir

    model = tiny_model_dir() if model == "tiny" else model
    if not (os.path.isdir(model) and os.path.isdir(teacher)):
        return None
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(model).get_vocab() != AutoTokenizer.from_pretrained(teacher).get_vocab():
        return f"its tokenizer is not the policy's ({model}): the teacher must score the same token ids"
    return None


def hub_model_error(model):
    """Why a hub name cannot be loaded (no network and not in the local cache, no such
    repository), in one line, or None. launch.sh's check asks once, before any rank starts."""
    import huggingface_hub  # light next to transformers; only launch.sh's check needs it

    try:
        huggingface_hub.hf_hub_download(model, "config.json", local_files_only=True)
        return None
    except Exception:  # not in the cache: the hub must know it
        pass
    try:
        huggingface_hub.model_info(model, timeout=10)
        return None
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"not in the local Hugging Face cache, and the hub cannot give it ({type(e).__name__}: {reason})"
