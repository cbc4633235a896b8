"""Hugging Face model folders: what a folder holds (its weight plan, stored names and
files, hybrid layers or not), where a composite checkpoint keeps the text model that is
trained, and saving a trained text model back as the composite it came from."""

import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf")


def weight_plan(path):
    """(name, shape) of every parameter in Hugging Face order: what the learner sends."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return [(name, p.shape) for name, p in model.named_parameters()]


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def is_hybrid(path):
    """Whether a model's (text) config mixes recurrent layers into its attention layers:
    any layer_types entry that is not attention (a gated delta net's 'linear_attention',
    a mamba or conv block). Such models need vLLM's mamba state cache."""
    from transformers import AutoConfig

    layer_types = getattr(AutoConfig.from_pretrained(path).get_text_config(), "layer_types", None) or []
    return any(t not in ATTENTION_LAYER_TYPES for t in layer_types)


def model_file(path, name):
    """A file of a local folder or a hub model (fetched into the cache), or None."""
    if os.path.isdir(path):
        file = os.path.join(path, name)
        return file if os.path.exists(file) else None
    from transformers.utils import cached_file

    return cached_file(path, name, _raise_exceptions_for_missing_entries=False)


def checkpoint_files(path):
    """{stored parameter name: safetensors file} of a model: from its index when it is
    sharded, else from the one file's header (no tensor is read)."""
    index = model_file(path, "model.safetensors.index.json")
    if index:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(os.path.dirname(index), file) for name, file in weight_map.items()}
    from safetensors import safe_open

    single = model_file(path, "model.safetensors")
    if single is None:
        raise ValueError(f"{path} has no safetensors weights")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def text_to_checkpoint(names, stored):
    """{name in the trained model: name in the checkpoint} for a text model loaded out of
    a checkpoint that may store it under other names: a composite's language model under
    'model.language_model.' where AutoModelForCausalLM says 'model.' (Qwen3.5), an older
    'language_model.lm_head.' for 'lm_head.'. Derived from the stored names alone: the
    names of each top-level module ('model', 'lm_head') move under the one prefix that
    holds all of their suffixes; the module's own name wins a tie, so a checkpoint that
    stores the names as they are maps each to itself. Names stored in no form (fused
    experts, which the engine splits itself) move with their module. Raises ValueError
    when a module's place is not decided."""
    stored = set(stored)
    groups = {}
    for name in names:
        groups.setdefault(name.split(".", 1)[0], []).append(name)
    mapping = {}
    for top, group in groups.items():
        prefixes = None
        for name in group:
            rest = name[len(top) + 1 :]
            found = {s[: len(s) - len(rest)] for s in stored if s.endswith("." + rest)}
            if found:
                prefixes = found if prefixes is None else prefixes & found
        prefixes = prefixes or set()
        if len(prefixes) > 1:
            prefixes = (
                {p for p in prefixes if p == f"{top}."} or {p for p in prefixes if p.endswith(f".{top}.")} or prefixes
            )
        if len(prefixes) != 1:
            raise ValueError(
                f"cannot place {top}.* in the checkpoint: {len(prefixes)} candidate prefixes {sorted(prefixes)[:3]}"
            )
        prefix = prefixes.pop()
        mapping.update({name: prefix + name[len(top) + 1 :] for name in group})
    return mapping


def restore_architecture(saved, source):
    """Make `saved`, a text model that save_pretrained wrote, the architecture of `source`,
    the checkpoint it was loaded from, when that is a composite whose text model alone was
    trained (Qwen3.5: AutoModelForCausalLM trains Qwen3_5ForCausalLM out of a
    Qwen3_5ForConditionalGeneration). save_pretrained already writes the text weights
    under the checkpoint's own names (it reverses the renaming it loaded them with); this
    adds the rest: source's config.json and every other non-weight file (processor,
    chat template, generation config) as they are, and source's weights that the text
    model did not write (a vision tower, MTP layers) in a shard of their own, untouched,
    with an index over both. A text checkpoint is left as it is. Returns the names
    carried over."""
    config = AutoConfig.from_pretrained(source)
    if config.get_text_config() is config:
        return []
    if os.path.isdir(source):
        folder = source
    else:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(source)  # already in the cache: the learners loaded it
    written, stored = checkpoint_files(saved), checkpoint_files(folder)
    foreign = sorted(set(written) - set(stored))
    if foreign:
        raise ValueError(
            f"the trained model wrote weights that {source} does not hold, e.g. {foreign[:3]}: not its text model"
        )
    for name in os.listdir(folder):
        file = os.path.join(folder, name)
        if os.path.isfile(file) and not name.startswith(".") and not name.endswith(WEIGHT_SUFFIXES + (".index.json",)):
            shutil.copyfile(file, os.path.join(saved, name))
    carried = sorted(set(stored) - set(written))
    tensors = {}
    for file in sorted({stored[n] for n in carried}):
        with safe_open(file, "pt") as f:
            tensors.update({n: f.get_tensor(n) for n in carried if stored[n] == file})
    single = os.path.join(saved, "model.safetensors")
    if os.path.exists(single):  # one file and no index: transformers would read that file alone
        os.rename(single, os.path.join(saved, "model-text.safetensors"))
        written = {n: os.path.join(saved, "model-text.safetensors") for n in written}
    if tensors:
        save_file(tensors, os.path.join(saved, "model-carried.safetensors"), metadata={"format": "pt"})
    weight_map = {n: os.path.basename(f) for n, f in written.items()} | {
        n: "model-carried.safetensors" for n in tensors
    }
    total = sum(os.path.getsize(os.path.join(saved, f)) for f in set(weight_map.values()))
    with open(os.path.join(saved, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return carried
