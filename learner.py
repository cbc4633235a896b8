"""The trained policy: a Hugging Face causal LM under FSDP2, token log-probs,
forward/backward over micro-batches, grad clipping and the optimizer step, and
sending full weights to the samplers, and checkpoints."""

import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM


def load_sharded(model_path, mesh, device, gradient_checkpointing=False):
    """The Hugging Face model with each transformer block and the root under FSDP2."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    # Master weights stay float32; on GPU the forward runs in bf16 and gradients
    # are reduced in float32.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else MixedPrecisionPolicy()
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


class Learner:
    def __init__(self, model_path, mesh, device, lr, weight_decay=0.0, gradient_checkpointing=False, reference=False, warmup_steps=0):
        self.device = device
        self.model = load_sharded(model_path, mesh, device, gradient_checkpointing)
        # Losses are normalised by whole-step counts already, so the learners' gradients
        # must be summed; FSDP averages them, so each backward is scaled by the count.
        self.grad_scale = mesh.size()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
        # A linear warm-up: Adam's first, bias-corrected steps move every weight by a
        # full lr, which is enough to wreck a small policy.
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / (warmup_steps + 1)))
        # A frozen copy of the initial weights for the KL term, sharded like the policy.
        self.reference = load_sharded(model_path, mesh, device).requires_grad_(False) if reference else None
        config = self.model.config
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0

    def collate(self, rollouts):
        """Right-padded prompt+completion ids, with the completion tokens' mask,
        sampler log-probs and advantages aligned to the predicted positions. An empty
        micro-batch becomes one masked-out pad sequence, so its learner still joins
        the collectives of the forward and backward."""
        if not rollouts:
            rollouts = [{"prompt_ids": [self.pad_id], "token_ids": [self.pad_id], "logprobs": [0.0], "advantage": 0.0, "empty": True}]
        width = max(len(r["prompt_ids"]) + len(r["token_ids"]) for r in rollouts)
        ids = torch.full((len(rollouts), width), self.pad_id, dtype=torch.long)
        # From lengths, not from pad ids: a sampled completion may contain the pad token.
        attention = torch.zeros(len(rollouts), width, dtype=torch.long)
        mask = torch.zeros(len(rollouts), width - 1)
        old_logp = torch.zeros(len(rollouts), width - 1)
        for i, r in enumerate(rollouts):
            p, c = len(r["prompt_ids"]), len(r["token_ids"])
            ids[i, : p + c] = torch.tensor(r["prompt_ids"] + r["token_ids"])
            attention[i, : p + c] = 1
            mask[i, p - 1 : p + c - 1] = 0 if r.get("empty") else 1  # position t predicts token t+1
            old_logp[i, p - 1 : p + c - 1] = torch.tensor(r["logprobs"])
        advantages = torch.tensor([r["advantage"] for r in rollouts], dtype=torch.float32)
        return [x.to(self.device) for x in (ids, attention, mask, old_logp, advantages)]

    def token_logprobs(self, model, ids, attention, temperature):
        """log p(token t+1 | tokens <= t) at the sampling temperature, and the entropy of
        each next-token distribution."""
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        if temperature > 0:
            logits = logits / temperature
        logz = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - logz
        with torch.no_grad():
            entropy = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return logp, entropy

    def forward_backward(self, micro_batches, loss_fn, temperature):
        """Accumulate gradients of sum(loss_fn(...)) over micro-batches. loss_fn gets
        whole-step normalisers from the caller, so summing micro-batch losses gives the
        full-batch loss exactly. Returns per-step sums of the loss's metrics."""
        totals = {}
        for rollouts in micro_batches:
            ids, attention, mask, old_logp, advantages = self.collate(rollouts)
            logp, entropy = self.token_logprobs(self.model, ids, attention, temperature)
            ref_logp = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logp = self.token_logprobs(self.reference, ids, attention, temperature)[0]
            loss, metrics = loss_fn(logp, old_logp, advantages, mask, ref_logp=ref_logp)
            (loss * self.grad_scale).backward()
            # Synchronous sampling used the weights the learner holds before its update,
            # so any gap is numerical mismatch between the two engines (or a broken
            # weight sync); one step ahead, it also holds that step's policy change.
            diff = (logp.detach() - old_logp).abs() * mask
            metrics.update(mismatch_sum=diff.sum(), entropy_sum=(entropy * mask).sum())
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v)
            totals["mismatch_max"] = max(totals.get("mismatch_max", 0.0), float(diff.max()))
        return totals

    def clip_grad_and_step(self, max_grad_norm):
        """Clip to max_grad_norm and step. Every learner sees the same global norm, so a
        non-finite norm skips the step on all of them alike. Returns the norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if torch.isfinite(norm):
            self.optimizer.step()
            self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def full_parameters(self, dtype):
        """(name, full tensor) for every parameter; each learner takes part in each
        all-gather, in the same order."""
        for name, p in self.model.named_parameters():
            yield name, _full(p).to(dtype)

    def send_weights(self, pg, buckets, dtype, comm_device):
        """Learner 0 broadcasts full weights over the weight group, bucket by bucket in
        the order of `buckets` (lists of (name, shape) that the samplers hold too); the
        other learners only join the all-gathers (pg is None there)."""
        params = dict(self.model.named_parameters())
        flats = (torch.cat([_full(params[name]).to(dtype).flatten() for name, _ in bucket]).to(comm_device) for bucket in buckets)
        if pg is None:
            for _ in flats:
                pass
        else:
            broadcast_buckets(pg, flats)

    def train_state(self):
        """Policy, optimizer and reference state dicts, sharded as they live."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optim": optim}
        if self.reference is not None:
            state["reference"] = get_model_state_dict(self.reference)
        return state

    def save_state(self, path):
        """The training state with torch.distributed.checkpoint: each learner writes its
        own shards. Returns the LR schedule's state, which is small and the same everywhere."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.train_state(), checkpoint_id=path)
        return self.schedule.state_dict()

    def load_state(self, path, schedule):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        state = self.train_state()
        dcp.load(state, checkpoint_id=path)  # in place, into the shards of `state`
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self.reference is not None:
            set_model_state_dict(self.reference, state["reference"])
        self.schedule.load_state_dict(schedule)

    def save(self, path, tokenizer=None):
        """Full weights in Hugging Face format; all learners call it, rank 0 writes."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            self.model.save_pretrained(path, state_dict=state)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)


def save_checkpoint(learner, root, step, info, keep_last=0, tokenizer=None):
    """root/step_<step>: the policy in Hugging Face format, the sharded training state,
    every learner's RNG state, and trainer.json (step, LR schedule, and `info`). Written
    under a temporary name and renamed when complete; `latest` moves only after that,
    so a kill at any moment leaves `latest` on a complete checkpoint. All learners call
    it; rank 0 holds the tokenizer."""
    rank = dist.get_rank()
    final, tmp = os.path.join(root, f"step_{step}"), os.path.join(root, f"step_{step}.tmp")
    started = time.time()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    learner.save(tmp, tokenizer)
    schedule = learner.save_state(os.path.join(tmp, "train_state"))
    torch.save(torch.get_rng_state(), os.path.join(tmp, f"rng_{rank}.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, "trainer.json"), "w") as f:
            json.dump({"step": step, "schedule": schedule, **info}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(f"step_{step}\n")
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        kept = sorted((d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp")), key=lambda d: int(d[5:]))
        for old in kept[:-keep_last] if keep_last else []:
            shutil.rmtree(os.path.join(root, old))
        print(f"checkpoint {final} saved in {time.time() - started:.2f} s", file=sys.stderr)
    dist.barrier()


def load_checkpoint(learner, path):
    """Restore what save_checkpoint wrote; returns its trainer.json."""
    with open(os.path.join(path, "trainer.json")) as f:
        trainer = json.load(f)
    learner.load_state(os.path.join(path, "train_state"), trainer["schedule"])
    rng = os.path.join(path, f"rng_{dist.get_rank()}.pt")
    if os.path.exists(rng):
        torch.set_rng_state(torch.load(rng))
    return trainer


def broadcast_buckets(pg, flats):
    """Broadcast each flat tensor from rank 0 of pg. The next one is built (on the
    learners: all-gathered) while the last is still on the wire, and at most those
    two are alive at once."""
    in_flight = None
    for flat in flats:
        work = pg.broadcast(flat, 0)
        if in_flight is not None:
            in_flight[0].wait()
        in_flight = (work, flat)
    if in_flight is not None:
        in_flight[0].wait()


def _full(p):
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()
