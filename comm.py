"""Processes and transport: where each rank runs (the GPUs a node shows, a pure placement
function, launch.sh's layout table), the process groups every rank builds on torchrun's
store, the pickled exchange of rollouts, the go/stop flag, and both sides of the weight
sync (the bucket plan that learner 0 and the samplers share, the broadcast, the receive)."""

import os
import pickle
import socket
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist


def driver_gpus(driver="/proc/driver/nvidia/gpus", smi="nvidia-smi"):
    """How many GPUs the NVIDIA driver lists: its /proc folder, else `nvidia-smi -L` (WSL2
    and some containers have no such folder); 0 without a driver. launch.sh counts the same
    way before any Python package is installed (`bash launch.sh gpus`)."""
    if os.path.isdir(driver):
        return len(os.listdir(driver))
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0


def visible_gpus(environ=os.environ, driver="/proc/driver/nvidia/gpus", smi="nvidia-smi"):
    """This node's usable GPU ids as strings: CUDA_VISIBLE_DEVICES (indices or UUIDs)
    where it is set, else every GPU the driver lists; none without a driver. Read from
    the environment and the driver, not torch.cuda: touching CUDA here would fix the
    visible devices before a rank can narrow them to its own."""
    count = driver_gpus(driver, smi)
    if not count:
        return []
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip() and g.strip() != "-1"]
    return [str(i) for i in range(count)]


@dataclass
class Placement:
    """Where one rank runs and how it talks: what main applies, decided in one place."""

    learner: bool
    gpu: str | None  # the GPU id this rank alone sees (CUDA_VISIBLE_DEVICES), None on CPU
    learner_backend: str  # the learners' own group: one group for CPU and CUDA tensors alike
    weight_backend: str  # learner 0 + the samplers; the same on every member
    sampler_gpu_memory: float  # vLLM's fraction of its GPU; 0 on CPU and on learners
    threads: int | None = None  # torch's CPU threads on a machine without GPUs; None: torchrun's


def gpu_slot(rank, local_world_size, learners, num_gpus):
    """(node, index into that node's GPUs) of a rank. Learners are the first global
    ranks and each takes a GPU of its own; a node's samplers take its free GPUs
    round-robin, or share the learners' when none is free."""
    node, local = divmod(rank, local_world_size)
    learners_here = min(max(learners - node * local_world_size, 0), local_world_size)
    if local < learners_here:
        return node, local
    free = num_gpus - learners_here
    sampler = local - learners_here
    return node, (learners_here + sampler % free) if free > 0 else sampler % num_gpus


def placement(rank, local_rank, local_world_size, world_size, learners, gpus, sampler_gpu_memory=0.0, cores=1):
    """The device, backends and memory share of `rank`, from the layout alone (every
    node is taken to see as many GPUs as this one). Raises ValueError with a one-line
    fix for a layout NCCL cannot run: two learners on one GPU."""
    is_learner = rank < learners
    if not gpus:
        return Placement(
            is_learner, None, "gloo", "gloo", 0.0, cpu_threads(rank, local_rank, local_world_size, learners, cores)
        )
    busiest = min(learners, local_world_size)  # node 0 holds the most learners
    if busiest > len(gpus):
        raise ValueError(
            f"--learners {learners} puts {busiest} learners on node 0, which sees {len(gpus)} GPU(s) "
            f"({','.join(gpus)}): NCCL cannot run two learners on one GPU; use --learners {len(gpus)} or fewer"
        )
    slots = [gpu_slot(r, local_world_size, learners, len(gpus)) for r in range(world_size)]
    node, index = slots[rank]
    weight_members = [slots[0]] + slots[learners:]
    # NCCL refuses two ranks of one group on one GPU: then weights go through host memory.
    weight_backend = "nccl" if len(set(weight_members)) == len(weight_members) else "gloo"
    memory = 0.0
    if not is_learner:
        samplers_here = sum(1 for r in range(learners, world_size) if slots[r] == slots[rank])
        beside_learner = any(slots[r] == slots[rank] for r in range(learners))
        memory = sampler_gpu_memory or (0.3 if beside_learner else 0.8) / samplers_here
    return Placement(is_learner, gpus[index], "cpu:gloo,cuda:nccl", weight_backend, memory)


def cpu_threads(rank, local_rank, local_world_size, learners, cores):
    """Threads for one rank of a CPU-only job on a node with `cores` cores. torchrun gives
    every rank one, which leaves cores idle whenever the ranks are fewer. The learners
    share all the cores: a step is theirs, and the samplers, which draw the next batch
    while they train, are done well within it (docs/results.md, Speed). A sampler gets
    its even share of the node."""
    first = rank - local_rank  # the node's first global rank
    learners_here = max(0, min(learners, first + local_world_size) - first)
    if rank < learners:
        return max(1, cores // learners_here)
    return max(1, cores // local_world_size)


def default_layout(num_gpus, nnodes=1):
    """launch.sh's (ranks per node, learners) for this many GPUs per node. The default
    run's 64 prompts x 8 completions must divide over both roles, so each gets a power
    of two; a GPU left over stays idle (7 GPUs run as 2 learners + 4 samplers)."""
    if num_gpus == 0:
        return 3, 2  # CPU: 2 learners, so FSDP really shards, and 1 sampler
    if nnodes > 1:
        world = num_gpus * nnodes
        learners = 1 << (min(num_gpus, world // 2).bit_length() - 1)
        return num_gpus, learners
    if num_gpus == 1:
        return 2, 1  # a learner and a sampler share the GPU
    # The most GPUs in use, then the most even split, then more samplers: sampling long
    # completions is the slower side.
    best = max((n + s, -abs(n - s), s, n) for n in (1, 2, 4, 8) for s in (1, 2, 4, 8) if n + s <= num_gpus)
    return best[0], best[3]


def free_port():
    """A TCP port free on this host now, for a rendezvous that torchrun does not set up
    (the tests' and benchmarks' own jobs and single-process groups)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_group(store, name, rank, size, backend, timeout):
    """A process group built directly on the store, for ranks that share no default
    group, with the same timeout as every other group (NCCL's default is 10 minutes,
    shorter than a long train step with --max-staleness 0)."""
    prefix = dist.PrefixStore(name, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, size, options)
    return dist.ProcessGroupGloo(prefix, rank, size, timeout)


def exchange(pg, obj):
    """All-gather one picklable object per rank over a gloo group; returns them all."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(pg.size())]
    pg.allgather([sizes], [torch.tensor([data.numel()])]).wait()
    width = int(max(sizes))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.empty(width, dtype=torch.uint8) for _ in range(pg.size())]
    pg.allgather([out], [padded]).wait()
    return [pickle.loads(o[: int(s)].numpy().tobytes()) for o, s in zip(out, sizes)]


def from_samplers(pg):
    """A learner's side of an exchange: what each sampler sent."""
    return [r for r in exchange(pg, None) if r is not None]


def control(pg, stop, device):
    """Learner 0 tells the samplers, before each sync, whether to go on (0) or stop (1)."""
    flag = torch.tensor([int(stop)], dtype=torch.int64, device=device)
    pg.broadcast(flag, 0).wait()
    return bool(flag.item())


# ---------------------------------------------------------------- the weight sync


def param_key(name):
    """The last two parts of a parameter's name ('linear_attn.A_log'): the same in Hugging
    Face's names and vLLM's, whose fused parameters (qkv_proj, gate_up_proj) always take
    the engine's dtype, so only such unfused leaves can be kept in another dtype."""
    return ".".join(name.split(".")[-2:])


def wire_dtype(name, engine_dtype, kept_dtypes):
    """The dtype a parameter travels in: the one the engine keeps it in (kept_dtypes maps
    param_key -> dtype for the exceptions the samplers found in their engine)."""
    return kept_dtypes.get(param_key(name), engine_dtype)


def bucket_plan(plan, dtype_of, bucket_bytes):
    """The weight plan cut into consecutive buckets of about bucket_bytes, each of one
    dtype: [(dtype, [(name, shape), ...]), ...]. Learner 0 and the samplers both compute
    it, so only the flat data travels, with no names or headers."""
    buckets, size = [], 0
    for name, shape in plan:
        dtype = dtype_of(name)
        if not buckets or size >= bucket_bytes or buckets[-1][0] != dtype:
            buckets.append((dtype, []))
            size = 0
        buckets[-1][1].append((name, shape))
        size += shape.numel() * dtype.itemsize
    return buckets


def plan_bytes(buckets):
    return sum(shape.numel() * dtype.itemsize for dtype, bucket in buckets for _, shape in bucket)


def send_weights(pg, full_tensor, buckets, device):
    """Learner 0's side: broadcast each bucket, flattened, from rank 0 of the weight
    group. full_tensor(name, dtype) gathers one parameter; every learner calls this in
    the same order (pg is None on the others, which only join the all-gathers). The next
    bucket is gathered while the last is on the wire, and at most those two are alive."""
    flats = (
        torch.cat([full_tensor(name, dtype).flatten() for name, _ in bucket]).to(device) for dtype, bucket in buckets
    )
    in_flight = None
    for flat in flats:
        if pg is None:
            continue
        work = pg.broadcast(flat, 0)
        if in_flight is not None:
            in_flight[0].wait()
        in_flight = (work, flat)
    if in_flight is not None:
        in_flight[0].wait()


def receive_weights(pg, buckets, device):
    """A sampler's side: yield (name, tensor) as buckets arrive from rank 0 of the weight
    group. Each bucket's receive is posted before the previous one is loaded."""

    def post(dtype, bucket):
        flat = torch.empty(sum(shape.numel() for _, shape in bucket), dtype=dtype, device=device)
        return pg.broadcast(flat, 0), flat

    pending = post(*buckets[0]) if buckets else None
    for i, (_, bucket) in enumerate(buckets):
        work, flat = pending
        work.wait()
        pending = post(*buckets[i + 1]) if i + 1 < len(buckets) else None
        offset = 0
        for name, shape in bucket:
            yield name, flat[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()
