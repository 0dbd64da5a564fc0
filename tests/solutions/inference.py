"""Solutions to the exercises of notebooks 08 and 08b."""

import torch


def max_tokens_per_s(params, bytes_per_param, bandwidth_gbps):
    return bandwidth_gbps * 1e9 / (params * bytes_per_param)


def sample_top_k(logits, k, generator=None):
    top = torch.topk(logits, k, dim=-1)
    choice = torch.multinomial(top.values.softmax(dim=-1), 1, generator=generator)
    return top.indices.gather(-1, choice)


def _argmax(logits, k, generator=None):
    return logits.argmax(dim=-1, keepdim=True)


def _all_vocabulary(logits, k, generator=None):
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


def _position_in_top_k(logits, k, generator=None):
    top = torch.topk(logits, k, dim=-1)
    return torch.multinomial(top.values.softmax(dim=-1), 1, generator=generator)  # forgot to map back to token ids


CASES = {
    "max_tokens_per_s": ([max_tokens_per_s], [
        ("ignores the parameter size", [lambda p, b, bw: bw * 1e9 / p], "bytes per parameter"),
        ("inverts it", [lambda p, b, bw: p * b / (bw * 1e9)], "seconds per token"),
        ("forgets the 10⁹", [lambda p, b, bw: bw / (p * b)], "units"),
    ]),
    "sample_top_k": ([sample_top_k], [
        ("takes the argmax", [_argmax], "argmax"),
        ("samples the whole vocabulary", [_all_vocabulary], "outside the 3 largest"),
        ("returns positions within the top k", [_position_in_top_k], "outside the 3 largest"),
    ]),
}
