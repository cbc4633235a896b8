"""A user reward (plugged in as tests.nan_reward:nan) that poisons every advantage."""


def nan(completion, gold):
    return float("nan")
