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


def _save_model_only(path, model, optimizer, epoch):
    torch.save({"model": model.state_dict(), "epoch": epoch}, path)


def _load_model_only(path, model, optimizer):
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    return checkpoint["epoch"]


CASES = {
    "correct_on_device": ([correct_on_device], [
        ("reads the count with .item()", [lambda m, x, y: (m(x).argmax(1) == y).sum().item()], "Python int"),
        ("returns the accuracy", [lambda m, x, y: (m(x).argmax(1) == y).float().mean()], "fraction"),
        ("forgets the argmax", [lambda m, x, y: (m(x)[:, 0] > 0).long().eq(y).sum()], "correct predictions"),
    ]),
    "checkpoint_round_trip": ([save_checkpoint, load_checkpoint], [
        ("saves the model only", [_save_model_only, _load_model_only], "optimizer.state_dict()"),
        ("forgets to return the epoch", [save_checkpoint, lambda path, m, o: load_checkpoint(path, m, o) and None],
         "returns None"),
    ]),
}
