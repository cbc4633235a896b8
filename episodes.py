"""Episodes of several turns with an environment, token-exact. An environment is one
function, loaded by --env module:function:

    fn(record, turns) -> None | str | {"role": ..., "content": ...}

`record` is the dataset row as rewards see it; `turns` the conversation so far as chat
messages (the prompt's, then each assistant message and each environment message). It
returns the next message (a string is a message in the role `fn.role`, default "user"),
or None to end the episode. It runs in killable worker processes, as user rewards do: a
raising or hanging environment ends that episode, counted, never the run.

The ids are never re-tokenized. Turn k+1's prompt is turn k's prompt, plus the ids the
sampler drew in turn k as drawn (its end-of-turn token included), plus the environment
message's ids: that one message rendered by the chat template as it delimits that role
(with the assistant's header after it), tokenized once (message_ids). Decoding the
model's output and rendering the conversation again can give other ids (another split
of the same text), and a learner trained on those would train on tokens never drawn,
with log-probs that belong to other tokens. Only the model's tokens learn
(`model_mask`); the environment's carry no loss, ratio, KL or entropy, and the losses'
token counts leave them out.

An episode ends when the environment says None, at --max-turns, when its tokens (model
and environment, after the prompt) reach --max-new-tokens, or when a turn is cut there
(truncated, as a single-turn completion is). Each turn is one engine call for all live
episodes of a sampler, and the environment's calls of a turn run in parallel workers."""

import atexit
import functools
import time

from console import warn_once
from grpo import Rollout
from plugins import load_function
from rewards import TIMEOUT, RewardPool

STAND_IN = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]  # for message_ids


def load_env(name):
    """The environment function 'module:function'. Raises ValueError."""
    return load_function(name, "environment")


def start_env(cfg):
    """The run's environment and the workers its calls run in, killed at --reward-timeout
    as user rewards are, and closed at exit; (None, None) for one turn."""
    if not cfg.env:
        return None, None
    pool = RewardPool([cfg.env], cfg.reward_workers, raw=True)
    atexit.register(pool.close)
    return load_env(cfg.env), pool


def _ids(tokenizer, messages, generation_prompt):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@functools.lru_cache(maxsize=4)
def _stand_in_ids(tokenizer):
    """The stand-in conversation rendered, once per tokenizer: every environment message
    of every episode needs it."""
    return tuple(_ids(tokenizer, STAND_IN, False))


def message_ids(tokenizer, message, end_id):
    """The ids that follow an assistant turn's end-of-turn token `end_id` when `message`
    comes next and the assistant answers it: the template's rendering of that message
    and of the assistant's header, and whatever the template puts between turns. Taken
    from two renderings of a stand-in conversation, as the longer one's ids past the
    shorter one's last `end_id`; only the new message's text is new to the tokenizer."""
    short = list(_stand_in_ids(tokenizer))
    longer = _ids(tokenizer, STAND_IN + [message], True)
    if end_id not in short:
        raise ValueError(f"the chat template does not end an assistant turn with token {end_id}")
    cut = len(short) - short[::-1].index(end_id)
    if longer[:cut] != short[:cut]:
        raise ValueError("the chat template renders earlier turns differently once a message follows")
    return longer[cut:]


def env_message(fn, reply):
    """The environment's reply as a chat message, None to end, or ValueError."""
    if reply is None:
        return None
    if isinstance(reply, str):
        return {"role": getattr(fn, "role", "user"), "content": reply}
    if isinstance(reply, dict) and isinstance(reply.get("role"), str) and isinstance(reply.get("content"), str):
        return {"role": reply["role"], "content": reply["content"]}
    raise ValueError(f"an environment returns None, a string or {{'role', 'content'}}, got {type(reply).__name__}")


def run_episodes(engine, prompts, n, temperature, key, cfg, tokenizer=None, env=None, env_pool=None):
    """n episodes per prompt, in prompt order (each prompt's n contiguous), as Rollouts
    with their "turns" (the conversation) and "model_mask" (1 on the ids the model drew);
    and counts: episodes, env errors, timeouts, programs a tool ran that ended in an
    error in the sandbox, seconds. With --max-turns 1 (no env) it is one engine.sample,
    as a single-turn run has always been."""
    first = engine.sample([p["prompt_ids"] for p in prompts], n, cfg.max_new_tokens, temperature, key)
    counts = {"episodes": len(first), "env_errors": 0, "env_timeouts": 0, "sandbox_errors": 0, "env_s": 0.0}
    episodes = []
    for i, c in enumerate(first):
        record = prompts[i // n]
        turns = [*record["prompt_messages"], {"role": "assistant", "content": c["text"]}]
        episodes.append({**c, "model_mask": [1] * len(c["token_ids"]), "turns": turns, "record": record})
    live = [e for e in episodes if not e["truncated"]] if env else []
    for turn in range(1, cfg.max_turns):
        if not live:
            break
        t0 = time.time()
        replies = env_pool.run([(0, e["record"], e["turns"]) for e in live], cfg.reward_timeout)
        counts["env_s"] += time.time() - t0
        asked = []
        counts["sandbox_errors"] += sum(n for _, _, n in replies)
        for e, (reply, error, _) in zip(live, replies):
            try:
                if error:  # the episode ends here, counted
                    raise ValueError(error)
                message = env_message(env, reply)
            except ValueError as problem:
                kind = "env_timeouts" if error == TIMEOUT else "env_errors"
                counts[kind] += 1
                what = (
                    f"ran past --reward-timeout {cfg.reward_timeout:g} s" if error == TIMEOUT else f"failed:\n{problem}"
                )
                warn_once(kind, f"environment {cfg.env} {what} (the episode ends; counted as {kind})")
                continue
            if message is None:
                continue
            bridge = message_ids(tokenizer, message, e["token_ids"][-1])
            if len(e["token_ids"]) + len(bridge) >= cfg.max_new_tokens:
                e["truncated"] = True  # no room left to answer
                continue
            e["token_ids"] = e["token_ids"] + bridge
            e["sampler_logprobs"] = e["sampler_logprobs"] + [0.0] * len(bridge)
            e["model_mask"] = e["model_mask"] + [0] * len(bridge)
            e["turns"].append(message)
            asked.append(e)
        if not asked:
            break
        budgets = [cfg.max_new_tokens - len(e["token_ids"]) for e in asked]
        answers = engine.sample(
            [e["prompt_ids"] + e["token_ids"] for e in asked], 1, budgets, temperature, (*key, "turn", turn)
        )
        for e, a in zip(asked, answers):
            e["token_ids"] = e["token_ids"] + a["token_ids"]
            e["sampler_logprobs"] = e["sampler_logprobs"] + a["sampler_logprobs"]
            e["model_mask"] = e["model_mask"] + [1] * len(a["token_ids"])
            e["turns"].append({"role": "assistant", "content": a["text"]})
            e["text"], e["truncated"] = a["text"], a["truncated"]
        live = [e for e in asked if not e["truncated"]]
    return [Rollout(**{k: v for k, v in e.items() if k != "record"}) for e in episodes], counts
