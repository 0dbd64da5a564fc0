"""Solutions to notebook 10's exercises."""

from contextlib import nullcontext


def bus_bandwidth(alg_gbps, world_size):
    return alg_gbps * 2 * (world_size - 1) / world_size


def accumulate(ddp_model, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    for i, (inputs, targets) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with nullcontext() if last else ddp_model.no_sync():
            (loss_fn(ddp_model, inputs, targets) / len(micro_batches)).backward()
    optimizer.step()


def _sync_every_micro_batch(ddp_model, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    for inputs, targets in micro_batches:
        (loss_fn(ddp_model, inputs, targets) / len(micro_batches)).backward()
    optimizer.step()


def _all_under_no_sync(ddp_model, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    with ddp_model.no_sync():
        for inputs, targets in micro_batches:
            (loss_fn(ddp_model, inputs, targets) / len(micro_batches)).backward()
    optimizer.step()


def _sum_of_losses(ddp_model, optimizer, micro_batches, loss_fn):
    optimizer.zero_grad()
    for i, (inputs, targets) in enumerate(micro_batches):
        with nullcontext() if i == len(micro_batches) - 1 else ddp_model.no_sync():
            loss_fn(ddp_model, inputs, targets).backward()
    optimizer.step()


def _step_every_micro_batch(ddp_model, optimizer, micro_batches, loss_fn):
    for i, (inputs, targets) in enumerate(micro_batches):
        optimizer.zero_grad()
        with nullcontext() if i == len(micro_batches) - 1 else ddp_model.no_sync():
            (loss_fn(ddp_model, inputs, targets) / len(micro_batches)).backward()
        optimizer.step()


def _no_zero_grad(ddp_model, optimizer, micro_batches, loss_fn):
    for i, (inputs, targets) in enumerate(micro_batches):
        with nullcontext() if i == len(micro_batches) - 1 else ddp_model.no_sync():
            (loss_fn(ddp_model, inputs, targets) / len(micro_batches)).backward()
    optimizer.step()


CASES = {
    "bus_bandwidth": ([bus_bandwidth], [
        ("returns the algorithm bandwidth", [lambda a, n: a], "ignores the number of ranks"),
        ("counts one trip around the ring", [lambda a, n: a * (n - 1) / n], "one trip"),
        ("doubles it whatever the ranks", [lambda a, n: 2 * a], "very many ranks"),
        ("inverts the ratio", [lambda a, n: a * n / (2 * (n - 1))], "upside down"),
    ]),
    "accumulate": ([accumulate], [
        ("all-reduces every micro-batch", [_sync_every_micro_batch], "after every micro-batch"),
        ("never leaves no_sync", [_all_under_no_sync], "never all-reduced"),
        ("sums the losses", [_sum_of_losses], "too large"),
        ("steps every micro-batch", [_step_every_micro_batch], "stepped 4 times"),
        ("keeps old gradients", [_no_zero_grad], "zero_grad"),
    ]),
}
