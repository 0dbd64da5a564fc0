"""Solutions to notebook 09's exercises."""

import math


def workers_needed(train_images_per_s, images_per_s_per_worker):
    return max(1, math.ceil(train_images_per_s / images_per_s_per_worker))


def linear_training_flops(rows, in_features, out_features):
    return 6 * rows * in_features * out_features


def decode_limit(parameters, bytes_per_parameter, gb_per_s):
    return gb_per_s * 1e9 / (parameters * bytes_per_parameter)


CASES = {
    "workers_needed": ([workers_needed], [
        ("rounds to nearest", [lambda t, w: max(1, round(t / w))], "round up"),
        ("rounds down", [lambda t, w: max(1, int(t / w))], "round up"),
        ("adds one always", [lambda t, w: int(t / w) + 1], "one too many"),
        ("returns the fraction", [lambda t, w: t / w], "whole"),
    ]),
    "linear_training_flops": ([linear_training_flops], [
        ("counts the forward only", [lambda r, i, o: 2 * r * i * o], "forward pass only"),
        ("forgets the input's gradient", [lambda r, i, o: 4 * r * i * o], "gradient is missing"),
        ("counts a multiply-add as one", [lambda r, i, o: 3 * r * i * o], "multiply-add is 2"),
    ]),
    "decode_limit": ([decode_limit], [
        ("forgets the bytes per parameter", [lambda n, b, g: g * 1e9 / n], "bytes per parameter"),
        ("counts bits", [lambda n, b, g: g * 1e9 / (n * b * 8)], "not bits"),
        ("uses GiB", [lambda n, b, g: g * 2**30 / (n * b)], "10⁹ bytes"),
        ("returns seconds per token", [lambda n, b, g: n * b / (g * 1e9)], "seconds per token"),
    ]),
}
