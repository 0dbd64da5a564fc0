"""Checks for the exercises of notebook 02 · The training loop on the GPU."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from utils.exercises import Miss, exercise, no_host_sync


def _tiny_classifier(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))


@exercise("1 · A sync-free evaluation")
def correct_on_device(answer, *, device: torch.device | str | None = None) -> str:
    """``answer(model, x, y)`` returns the number of correct predictions as a 0-d tensor on x's device, without
    making the host wait for the GPU."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    model = _tiny_classifier(0).to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(257, 12, generator=gen).to(device)
    with torch.no_grad():
        predicted = model(x).argmax(dim=1)
    y = predicted.clone()
    y[::3] = (y[::3] + 1) % 4  # every third prediction made wrong: 86 wrong, 171 right
    expected = int((predicted == y).sum())
    with no_host_sync(device, "keep every value a tensor on the device until the end"):
        result = answer(model, x, y)
    if result is None:
        raise NotImplementedError("correct_on_device returns None")
    if not isinstance(result, torch.Tensor):
        raise Miss(f"it returns a Python {type(result).__name__}: getting a Python number out of a GPU tensor "
                   "(.item(), int()) waits for the GPU; return the 0-d tensor itself")
    if result.dim() != 0:
        raise Miss(f"it returns a tensor of shape {list(result.shape)}: sum the hits into one number (0-d)")
    if result.device != x.device:
        raise Miss(f"the count is on {result.device}, the data on {x.device}: moving it is a synchronisation")
    if result.is_floating_point() and 0 < float(result) <= 1:
        raise Miss(f"it returns {float(result):.4g}, a fraction: return the number of correct predictions")
    if int(result) != expected:
        raise Miss(f"it counts {int(result)} correct predictions out of {len(y)}; there are {expected}")
    return f"a 0-d tensor on {device}, and no synchronisation" + (" (checked in sync-debug mode)."
                                                                   if device.type == "cuda" else ".")


@exercise("2 · Resume exactly")
def checkpoint_round_trip(save_answer, load_answer) -> str:
    """``save_answer(path, model, optimizer, epoch)`` writes a checkpoint; ``load_answer(path, model, optimizer)``
    restores model and optimizer in place and returns the epoch. Training resumed from it must continue exactly
    like training that never stopped."""
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(32, 12, generator=gen), torch.randint(0, 4, (32,), generator=gen)) for _ in range(6)]
    loss_fn = nn.CrossEntropyLoss()

    def train(model, optimizer, some):
        for x, y in some:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()

    straight = _tiny_classifier(3)
    straight_opt = torch.optim.Adam(straight.parameters(), lr=1e-2)
    train(straight, straight_opt, batches)

    first = _tiny_classifier(3)
    first_opt = torch.optim.Adam(first.parameters(), lr=1e-2)
    train(first, first_opt, batches[:3])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        if save_answer(path, first, first_opt, 3) is NotImplemented:
            raise NotImplementedError
        if not path.exists():
            raise Miss(f"save_checkpoint wrote nothing at the path it was given ({path.name})")
        resumed = _tiny_classifier(99)  # other initial weights: everything must come from the file
        resumed_opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
        epoch = load_answer(path, resumed, resumed_opt)
        optimizer_restored = bool(resumed_opt.state)
    if epoch is None:
        raise Miss("load_checkpoint returns None: return the epoch the checkpoint was saved at")
    if int(epoch) != 3:
        raise Miss(f"load_checkpoint returns epoch {epoch}; the checkpoint was saved after epoch 3")
    if any(not torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), first.state_dict().values(),
                                                 strict=True)):
        raise Miss("the loaded model's weights are not the saved ones (load them into the model you are given)")
    train(resumed, resumed_opt, batches[3:])
    if any(not torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), straight.state_dict().values(),
                                                 strict=True)):
        raise Miss("training resumed from your checkpoint drifts from training that never stopped"
                   + (": Adam's moment estimates and step count live in optimizer.state_dict() — save and load "
                      "it too" if not optimizer_restored else ""))
    return "the resumed run is bit-identical to the uninterrupted one."
