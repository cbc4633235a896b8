"""A user reward (plugged in as tests.plugins.nan_reward:nan) that poisons every advantage."""


def nan(completion, gold):
    return float("nan")
