"""Solutions to notebook 02's exercises."""

import torch


@torch.no_grad()
def correct_on_device(model, x, y):
    return (model(x).argmax(dim=1) == y).sum()


def save_checkpoint(path, model, optimizer, epoch):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)


def load_checkpoint(path, model, optimizer):
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return checkpoint["epoch"]
