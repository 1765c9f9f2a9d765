"""This example's own reward, as a user writes one: a plain function of the completion and the answer.

``configs/chat-task.toml`` adds a built-in format reward beside it (``regex``: four digits and nothing
else, so the policy learns to end with EOS instead of running on to ``max_new_tokens``).
"""


def reversed_digits(prompt, completion, answer, row):
    """Each answer digit in its place (the first ``len(answer)`` characters of the completion), and
    whether the whole completion is the answer, reported beside it as ``digits/exact``."""
    right = sum(a == b for a, b in zip(completion, answer))
    return {"score": right / len(answer), "exact": float(completion == answer)}
