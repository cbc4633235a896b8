"""The trained policy: a Hugging Face causal LM under FSDP2, its token log-probs
(logprobs.py) and forward/backward over micro-batches, grad clipping and the optimizer
step, its full parameters for the weight sync, and its state for checkpoints."""

import os
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

import lora as lora_module
import metrics
from checkpoint import Preempted
from comm import param_key
from logprobs import attention_kernel, token_logprobs
from models import restore_architecture


def load_sharded(
    model_path,
    mesh,
    device,
    compute_dtype,
    gradient_checkpointing=False,
    frozen=False,
    adapters=None,
    compile=False,
    kept_dtypes=None,
):
    """The Hugging Face model with each transformer block and the root under FSDP2.
    frozen (the reference): stored in compute_dtype itself with no gradients, since a
    model that never steps needs no float32 master copy (half the bytes in bf16).
    adapters (rank, alpha, targets): LoRA on those linear layers, the rest frozen.
    compile: each block's forward through torch.compile (compile_block).
    kept_dtypes ({param_key: dtype}, the sampler's): parameters the engine keeps in
    another dtype than compute_dtype are used in that dtype here too (use_kept_dtypes)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=compute_dtype if frozen else torch.float32).to(
        device
    )
    if frozen:
        model.requires_grad_(False)
    if adapters:
        lora_module.add_adapters(model, *adapters)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        # transformers recomputes a block only while the block itself is in training mode,
        # and from_pretrained loads in eval mode. Only the blocks switch: every other
        # module (dropout, attention dropout) stays in eval mode, so the learner's
        # log-probs remain the sampler's.
        for module in model.modules():
            if isinstance(module, GradientCheckpointingLayer):
                module.training = True
    # Master weights and AdamW's state stay float32; the forward and backward run in
    # compute_dtype, and gradients are reduced in float32.
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, mp_policy=mp)
            if compile:
                compile_block(module)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if kept_dtypes:
        use_kept_dtypes(model, kept_dtypes)
    return model


def use_kept_dtypes(model, kept_dtypes):
    """Parameters the engine keeps in another dtype than the compute dtype (a gated delta
    net's A_log, float32 under bf16) enter the learner's forward in that dtype too, with
    the float32 master's exact values: else the learner would compute Qwen3.5's decay
    exp(A_log) from a bf16-rounded A_log while vLLM uses the float32 one.

    FSDP2 gathers a whole unit in one dtype, and such a leaf sits in a module whose other
    parameters are read directly by its parent (the delta net's conv1d), so it cannot be
    a unit of its own. Instead, a hook around that module swaps in, for its forward only,
    master + (p - p.detach()): the value of the master (one all-gather of a few floats
    per layer and forward, in the same order on every learner) with p's gradient path,
    so the gradient still reaches the master through FSDP's reduce. Frozen models
    (stored in the compute dtype already) have nothing more exact to give. Returns the
    (module, name) pairs it covers."""
    covered = []
    for prefix, module in model.named_modules():
        for name, master in module.named_parameters(recurse=False):
            dtype = kept_dtypes.get(param_key(f"{prefix}.{name}"))
            if dtype is None or master.dtype != dtype:
                continue
            held = {}  # FSDP2's gathered parameter, while the master's value stands in for it
            module.register_forward_pre_hook(partial(_swap_in_master, name=name, master=master, held=held))
            module.register_forward_hook(partial(_swap_back, name=name, held=held), always_call=True)
            covered.append((module, name))
    return covered


def _swap_in_master(module, args, name, master, held):
    gathered = held["param"] = module._parameters[name]  # FSDP2's unsharded parameter, compute dtype
    full = master.detach()
    full = full.full_tensor() if isinstance(full, DTensor) else full
    module._parameters[name] = full + (gathered - gathered.detach())  # [n], the master's dtype and values


def _swap_back(module, args, output, name, held):
    module._parameters[name] = held.pop("param")  # FSDP2 finds its own parameter again


def compile_block(block):
    """torch.compile one transformer block's forward, in place. Only the forward: FSDP2's
    hooks, which gather and free the block's parameters, stay eager around it, and the
    compiled code sees the gathered parameters as inputs, so one graph serves every
    block. What it buys is fusion: the bf16 elementwise work around the matmuls (norms,
    rotary, SiLU, the attention's softmax, casts) took more time than the matmuls did
    (benchmarks/speed.py --limit). Shapes: the first micro-batch compiles for its own
    sizes, and a later one with another batch or width recompiles once with that
    dimension symbolic (torch's automatic dynamic shapes); the hidden size stays fixed,
    which keeps its reductions vectorised (dynamic=True made every size symbolic and
    was no faster than eager). Each kind of block (a hybrid model has two), each grad
    mode (the reference runs without) and each attention kernel (attention_kernel) gets
    graphs of its own: torch's default of 8 per code object would send the later ones
    back to eager, so the limit is raised."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    block.forward = torch.compile(block.forward)


def device_memory(device, learners):
    """(bytes free on the device, bytes this process already holds there, how many
    learners share that memory): on a GPU its free memory (torch.cuda.mem_get_info) and
    this process's reserved memory, one learner per GPU; on CPU MemAvailable and this
    process's resident set, shared by this node's learners."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device), 1
    fields = {}
    for name in ("/proc/meminfo", "/proc/self/status"):
        with open(name) as f:
            fields.update(line.split(":", 1) for line in f if ":" in line)

    def kib(key):
        return int(fields[key].split()[0]) * 1024 if key in fields else 0

    local = int(os.environ.get("LOCAL_WORLD_SIZE", learners))
    return kib("MemAvailable"), kib("VmRSS"), max(1, min(learners, local))


def learner_from_config(cfg, path, mesh, device, engine_dtypes):
    """The run's Learner: its flags, and the dtypes the samplers' engine keeps."""
    adapters = (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets.split(",")) if cfg.lora_rank else None
    return Learner(
        path,
        mesh,
        device,
        cfg.lr,
        cfg.weight_decay,
        cfg.gradient_checkpointing,
        reference=cfg.beta > 0,
        warmup_steps=cfg.warmup_steps,
        compute_dtype=getattr(torch, cfg.dtype),
        lora=adapters,
        lora_b_lr=cfg.lora_b_lr,
        logprob_chunk=cfg.logprob_chunk,
        teacher=cfg.teacher,
        compile=cfg.compile,
        kept_dtypes=engine_dtypes["kept_dtypes"],
    )


class Learner:
    def __init__(
        self,
        model_path,
        mesh,
        device,
        lr,
        weight_decay=0.0,
        gradient_checkpointing=False,
        reference=False,
        warmup_steps=0,
        compute_dtype=torch.float32,
        logprob_chunk=1024,
        lora=None,
        lora_b_lr=1.0,
        teacher=None,
        compile=False,
        kept_dtypes=None,
    ):
        self.device = device
        self.model_path = model_path  # where save() takes a composite's other parts from
        self.lora = lora  # (rank, alpha, targets) or None: full fine-tuning
        # Positions per output-projection chunk in token_logprobs; 0: the dense path.
        self.logprob_chunk, self.compute_dtype = logprob_chunk, compute_dtype
        # The frozen models below are sharded alike, so that all three compute alike.
        frozen = dict(frozen=True, compile=compile, kept_dtypes=kept_dtypes)
        self.model = load_sharded(
            model_path,
            mesh,
            device,
            compute_dtype,
            gradient_checkpointing,
            adapters=lora,
            compile=compile,
            kept_dtypes=kept_dtypes,
        )
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        # Losses are normalised by whole-step counts already, so the learners' gradients
        # must be summed; FSDP averages them, so each backward is scaled by the count.
        self.grad_scale = mesh.size()
        # LoRA+ (Hayou et al., 2024): B starts at zero and alone moves the output at first,
        # so it may learn faster than A; the schedule scales both groups alike.
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        b_params = [p for n, p in trainable if n.endswith(".lora_B")]
        groups = [{"params": [p for n, p in trainable if not n.endswith(".lora_B")]}]
        groups += [{"params": b_params, "lr": lr * lora_b_lr}] if b_params else []
        self.optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
        # float16's 5 exponent bits flush small gradients to zero in the backward: the loss
        # is scaled up first, the float32 gradients unscaled before clipping, and the
        # scale halves after a step whose gradients overflowed (that step is skipped).
        self.scaler = ShardedGradScaler(device=device.type) if compute_dtype == torch.float16 else None
        # A linear warm-up: Adam's first, bias-corrected steps move every weight by a
        # full lr, which is enough to wreck a small policy.
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / (warmup_steps + 1))
        )
        # The KL term's reference: with LoRA, the policy with its adapters switched off (no
        # second copy); else a frozen copy of the initial weights, sharded like the policy.
        self.reference = None
        if reference:
            self.reference = self.model if lora else load_sharded(model_path, mesh, device, compute_dtype, **frozen)
        # On-policy distillation's teacher (a folder or hub name): frozen, sharded like
        # the reference, its log-probs taken on the sampled tokens.
        self.teacher = load_sharded(teacher, mesh, device, compute_dtype, **frozen) if teacher else None
        self.named_params = dict(self.model.named_parameters())
        self.loaded_attention = self.model.config._attn_implementation
        config = self.model.config
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0

    def collate(self, rollouts):
        """Right-padded prompt+completion ids, with the mask of the completion's model
        tokens (an environment's tokens in an episode carry no loss), the sampler's
        log-probs and the advantages aligned to the predicted positions (t predicts t+1)."""
        width = max(len(r.prompt_ids) + len(r.token_ids) for r in rollouts)
        ids = torch.full((len(rollouts), width), self.pad_id, dtype=torch.long)  # [B, T]
        # From lengths, not from pad ids: a sampled completion may contain the pad token.
        attention = torch.zeros(len(rollouts), width, dtype=torch.long)  # [B, T]
        mask = torch.zeros(len(rollouts), width - 1)  # [B, T-1]
        sampler_logp = torch.zeros(len(rollouts), width - 1)  # [B, T-1]
        for i, r in enumerate(rollouts):
            p, c = len(r.prompt_ids), len(r.token_ids)
            ids[i, : p + c] = torch.tensor(r.prompt_ids + r.token_ids)
            attention[i, : p + c] = 1
            mask[i, p - 1 : p + c - 1] = 1 if r.model_mask is None else torch.tensor(r.model_mask, dtype=mask.dtype)
            sampler_logp[i, p - 1 : p + c - 1] = torch.tensor(r.sampler_logprobs)
        advantages = torch.tensor([r.advantage for r in rollouts], dtype=torch.float32)  # [B]
        return [x.to(self.device) for x in (ids, attention, mask, sampler_logp, advantages)]

    def token_logprobs(self, model, ids, attention, temperature, entropy=True):
        """log p(token t+1 | tokens <= t) at the sampling temperature [B, T-1], and the
        entropy of each next-token distribution [B, T-1] (or None): chunked (the
        default), or dense with logprob_chunk 0."""
        # Set on every call (the setter reaches a composite's sub-configs too), so each
        # micro-batch's width picks its own kernel.
        kernel = attention_kernel(self.device.type, self.compute_dtype, ids.shape[1], self.loaded_attention)
        model.config._attn_implementation = kernel
        return token_logprobs(model, ids, attention, temperature, self.logprob_chunk, entropy)

    def memory_line(self, learners, tokens, seq_len, gradient_checkpointing=False):
        """One line for the start of a run: this rank's estimated peak memory at the
        configured sizes (metrics.estimate_learner_memory), by component, against what
        the device has free, with a warning when it does not fit."""
        estimate = metrics.estimate_learner_memory(
            self.model,
            learners,
            tokens,
            self.device,
            self.compute_dtype,
            self.reference is not None,
            self.logprob_chunk,
            gradient_checkpointing,
            seq_len,
        )
        free, held, sharing = device_memory(self.device, learners)

        def gib(b):
            return f"{b / 2**30:.2f}"

        parts = ", ".join(f"{k} {gib(v)}" for k, v in estimate.items() if k != "total")
        need = estimate["total"] * sharing
        line = f"learner memory: estimated peak {gib(estimate['total'])} GiB per rank ({parts}; {tokens} positions per micro-batch, log-prob chunk {self.logprob_chunk or 'dense'})"
        line += f" against {gib(free + held)} GiB for {'each learner' if sharing == 1 else f'the {sharing} learners here'} on {self.device.type} (free {gib(free)} + held {gib(held)})"
        if need > free + held:
            line += ": WARNING: it may not fit; lower --max-tokens-per-microbatch or --logprob-chunk, or use --gradient-checkpointing or more learners"
        return line

    def idle_batch(self):
        """What a learner with no micro-batch left runs: it must still join each
        forward's and backward's collectives (FSDP's all-gathers and reduce-scatters) and
        report every metric, so it runs one pad sequence whose mask is all zero."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        zeros = torch.zeros(1, 1, device=self.device)
        return ids, torch.ones_like(ids), zeros, zeros, torch.zeros(1, device=self.device)

    def forward_backward(self, micro_batches, loss_fn, temperature, stop=None):
        """Accumulate gradients of sum(loss_fn(...)) over micro-batches. loss_fn gets
        whole-step normalisers from the caller, so summing micro-batch losses gives the
        full-batch loss exactly. Returns this learner's (counts, sums over its tokens of
        the per-token metrics, maxima), with one host sync at the end, not one per
        micro-batch. `stop()`, asked before each micro-batch by every learner alike (it is
        a collective), drops the step: its gradients are cleared and Preempted raised."""
        sums, token_sums, maxima = {}, {}, {}

        def add(into, key, value):
            into[key] = into.get(key, 0.0) + value.detach()

        for rollouts in micro_batches:
            if stop is not None and stop():
                self.optimizer.zero_grad(set_to_none=True)
                raise Preempted
            ids, attention, mask, sampler_logp, advantages = self.collate(rollouts) if rollouts else self.idle_batch()
            with record_function("forward"):  # the phases benchmarks/speed.py --limit profiles
                logp, entropy = self.token_logprobs(self.model, ids, attention, temperature)
                ref_logp = None
                if self.reference is not None:
                    with torch.no_grad(), lora_module.adapters_off(self.reference):
                        ref_logp = self.token_logprobs(self.reference, ids, attention, temperature, entropy=False)[0]
                teacher_logp = None
                if self.teacher is not None:
                    with torch.no_grad():
                        teacher_logp = self.token_logprobs(self.teacher, ids, attention, temperature, entropy=False)[0]
                loss, stats = loss_fn(logp, sampler_logp, advantages, mask, ref_logp, teacher_logp)
                for i, r in enumerate(rollouts):  # samples.jsonl's few: one host copy each, on logged steps
                    if r.keep_logprobs:
                        p = len(r.prompt_ids)
                        r.learner_logprobs = logp[i, p - 1 : p - 1 + len(r.token_ids)].detach().float().tolist()
            scaled = loss * self.grad_scale
            with record_function("backward"):
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            # Synchronous sampling used the weights the learner holds before its update,
            # so any gap is numerical mismatch between the two engines (or a broken
            # weight sync); one step ahead, it also holds that step's policy change.
            diff = (logp.detach() - sampler_logp).abs() * mask  # [B, T-1]
            add(sums, "loss", loss)
            add(sums, "tokens", mask.sum())
            for k, v in {**stats, "mismatch_mean": diff.sum(), "entropy": (entropy * mask).sum()}.items():
                add(token_sums, k, v)
            maxima["mismatch"] = torch.maximum(maxima.get("mismatch", diff.new_zeros(())), diff.max().detach())
        return [{k: float(v) for k, v in d.items()} for d in (sums, token_sums, maxima)]

    def clip_grad_and_step(self, max_grad_norm):
        """Clip to max_grad_norm and step. Every learner sees the same global norm, so a
        non-finite norm skips the step on all of them alike. Returns the norm."""
        with record_function("optimizer"):
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            norm = torch.nn.utils.clip_grad_norm_(self.trainable, max_grad_norm)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            if torch.isfinite(norm):
                self.optimizer.step()
                self.schedule.step()
        if self.scaler:
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def full_tensor(self, name, dtype):
        """One parameter, whole, in dtype: every learner takes part in its all-gather,
        which moves dtype's bytes (cast before gathering, not after)."""
        p = self.named_params[name].detach().to(dtype)
        return p.full_tensor() if isinstance(p, DTensor) else p

    def train_state(self):
        """Policy, optimizer and reference state dicts, sharded as they live."""
        model, optim = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optim": optim}
        if self.reference is not None and self.reference is not self.model:
            state["reference"] = get_model_state_dict(self.reference)
        return state

    def save_state(self, path):
        """The training state with torch.distributed.checkpoint: each learner writes its
        own shards. Returns the LR schedule's state, which is small and the same everywhere."""
        dcp.save(self.train_state(), checkpoint_id=path)
        schedule = self.schedule.state_dict()
        return {**schedule, "grad_scaler": self.scaler.state_dict()} if self.scaler else schedule

    def load_state(self, path, schedule):
        state = self.train_state()
        dcp.load(state, checkpoint_id=path)  # in place, into the shards of `state`
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if "reference" in state:
            set_model_state_dict(self.reference, state["reference"])
        schedule = dict(schedule)
        if "grad_scaler" in schedule:
            self.scaler.load_state_dict(schedule.pop("grad_scaler"))
        self.schedule.load_state_dict(schedule)

    def save(self, path, tokenizer=None):
        """Full weights in Hugging Face format (with LoRA: merged, and the adapters in
        PEFT's format in path/adapter); all learners call it, rank 0 writes."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() != 0:
            return
        # A tied head is one parameter under two names. On a GPU, cpu_offload copies each
        # name on its own, so save_pretrained no longer sees the tie and writes the head
        # as a weight the checkpoint never had (a composite's save then fails): keep each
        # parameter under its first name only, as save_pretrained itself would.
        first = {}
        aliases = {n for n, p in self.model.named_parameters(remove_duplicate=False) if first.setdefault(p, n) != n}
        state = {n: t for n, t in state.items() if n not in aliases}
        if self.lora:
            rank, alpha, targets = self.lora
            adapters = {n: t for n, t in state.items() if n.endswith((".lora_A", ".lora_B"))}
            base = {lora_module.base_name(n): t for n, t in state.items() if n not in adapters}
            state = dict(lora_module.merged_weights(base, adapters, alpha / rank))
            lora_module.save_peft(
                os.path.join(path, "adapter"), adapters, rank, alpha, targets, self.model.config._name_or_path
            )
        self.model.save_pretrained(path, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        restore_architecture(path, self.model_path)
