"""Solutions to notebook 05's exercises."""

import torch

_STATE = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}


def static_training_bytes(n_params, optimizer):
    return 4 * n_params * (2 + _STATE[optimizer])  # fp32 weights, gradients, and the state's values


def largest_fitting_batch(run, limit):
    def fits(b):
        try:
            run(b)
        except torch.OutOfMemoryError:
            return False
        return True

    good, bad = 0, limit + 1  # good fits (0: trivially), bad does not
    b = 1
    while b <= limit and fits(b):  # double until a batch fails
        good, b = b, 2 * b
    bad = min(b, limit + 1)
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def _one_at_a_time(run, limit):
    """A linear search: right, but one training step per batch size."""
    best = 0
    for b in range(1, limit + 1):
        try:
            run(b)
        except torch.OutOfMemoryError:
            break
        best = b
    return best


def _first_failure(run, limit):
    return min(largest_fitting_batch(run, limit) + 1, limit)


def _powers_of_two(run, limit):
    best, b = 0, 1
    while b <= limit:
        try:
            run(b)
        except torch.OutOfMemoryError:
            break
        best, b = b, 2 * b
    return best


def _uncaught(run, limit):
    b = 1
    while b <= limit:
        run(b)  # lets the error escape
        b *= 2
    return limit


# What tests/test_exercises.py feeds each check: (the solution's arguments, [(what a plausible wrong answer does,
# its arguments, a phrase the feedback must contain)]).
CASES = {
    "static_memory": ([static_training_bytes], [
        ("forgets the gradients", [lambda n, opt: 4 * n * (1 + _STATE[opt])], "gradients"),
        ("gives Adam one moment", [lambda n, opt: 4 * n * (2 + min(_STATE[opt], 1))], "two moments"),
        ("forgets the optimizer's state", [lambda n, opt: 8 * n], "optimizer's state"),
        ("counts values, not bytes", [lambda n, opt: n * (2 + _STATE[opt])], "bytes"),
    ]),
    "largest_batch": ([largest_fitting_batch], [
        ("lets the error escape", [_uncaught], "catch it"),
        ("returns the first batch that failed", [_first_failure], "first batch that failed"),
        ("stops at a power of two", [_powers_of_two], "power of two"),
        ("searches one batch at a time", [_one_at_a_time], "calls"),
    ]),
}
