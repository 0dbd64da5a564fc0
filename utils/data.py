"""MNIST loading, GPU-resident batching, and synthetic data for throughput work.

`load_mnist()` finds the data in this order and prints one line saying which it used:

1. a local copy in torchvision's layout, ``root/MNIST/raw/*-ubyte`` (raw or ``.gz``);
2. a download from torchvision's own mirrors, with one short deadline for the whole attempt;
3. the sample bundled in ``data/mnist_sample_5k.npz``: 4,000 train / 1,000 test digits of the real MNIST.

Two ways to feed a model follow. `MNISTDataset` is the classic path: a `DataLoader` normalises one
image at a time on the CPU. `normalize_images` + `device_batches` is the GPU-resident path: move the
whole uint8 dataset to the device once, normalise it in one vectorised op, and slice mini-batches there.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import math
import os
import socket
import threading
import time
import urllib.parse
import urllib.request
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

MNIST_MEAN = 0.1307
"""Mean pixel value of the MNIST training set, after scaling to [0, 1]."""
MNIST_STD = 0.3081
"""Standard deviation of the MNIST training set pixels, after scaling to [0, 1]."""
DATA_DIR = Path(__file__).parents[1] / "data"
"""The repository's data/ folder: downloads land here, and the bundled sample lives here."""
BUNDLED_SAMPLE = DATA_DIR / "mnist_sample_5k.npz"
"""The bundled offline sample (see data/README.md for where every byte came from)."""

_SPLITS = {"train": "train", "test": "t10k"}  # split -> torchvision's file-name prefix
_SAMPLE_PER_CLASS = 500  # digits per class in the bundled sample ...
_SAMPLE_TRAIN_PER_CLASS = 400  # ... of which the first 400 are train and the last 100 test
_USER_AGENT = "pytorch/vision"  # what torchvision sends, so the mirrors treat us the same


class DataError(RuntimeError):
    """A data file is missing, corrupt or not what it should be; the message names the file and the fix."""


@dataclass(repr=False)
class MNISTSplits:
    """MNIST train and test splits as CPU tensors, plus where they came from.

    Attributes:
        train_images: uint8 [N, 28, 28], pixel values 0..255.
        train_labels: int64 [N], digits 0..9.
        test_images: uint8 [M, 28, 28].
        test_labels: int64 [M].
        source: "local", "download" or "bundled-sample".
        note: one sentence for humans saying where the data came from (and, for the sample, why).
    """

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    source: Literal["local", "download", "bundled-sample"]
    note: str

    def __str__(self) -> str:
        """Short summary, e.g. ``MNIST (local): 60,000 train / 10,000 test images of 28x28 uint8``."""
        h, w = self.train_images.shape[1:]
        return (
            f"MNIST ({self.source}): {len(self.train_images):,} train / {len(self.test_images):,} test "
            f"images of {h}x{w} uint8"
        )

    __repr__ = __str__  # never dump 47 MB of pixels into a notebook output


# --------------------------------------------------------------------------------------------- IDX files


def parse_idx(path: str | Path) -> torch.Tensor:
    """Read an IDX file (the format MNIST ships in), raw or gzip-compressed, into a uint8 tensor.

    The header is two zero bytes, a type code (only 0x08 = uint8 is supported, which is what MNIST
    uses), the number of dimensions, then each dimension as a big-endian uint32; the pixels follow.

    Args:
        path: the file; gzip is recognised from its first bytes, not from its name.

    Returns:
        A uint8 CPU tensor of the shape the header gives.

    Raises:
        DataError: the file cannot be read, is not IDX, is not uint8, or is truncated or too long.
    """
    path = Path(path)
    fix = "The file is corrupt or not an MNIST IDX file: delete it (load_mnist() downloads a fresh copy)."
    try:
        data = path.read_bytes()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read it ({e}). {fix}") from e
    if len(data) < 4 or data[:2] != b"\x00\x00":
        raise DataError(
            f"{path}: bad magic number {data[:4].hex() or '(empty file)'}, not an IDX file. {fix}"
        )
    type_code, ndim = data[2], data[3]
    if type_code != 0x08:
        raise DataError(f"{path}: IDX type code 0x{type_code:02x}; only 0x08 (uint8) is supported. {fix}")
    header_len = 4 + 4 * ndim
    if ndim == 0 or len(data) < header_len:
        raise DataError(f"{path}: truncated IDX header ({len(data)} bytes, {ndim} dimensions). {fix}")
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    count = math.prod(dims)
    if len(data) != header_len + count:
        raise DataError(
            f"{path}: header says shape {tuple(dims)} = {count:,} bytes of data, "
            f"but the file holds {len(data) - header_len:,}. {fix}"
        )
    if count == 0:
        return torch.empty(dims, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header_len, count=count).reshape(dims)


def _idx_path(raw_dir: Path, stem: str) -> Path | None:
    """The raw file if present (what torchvision reads), else the .gz, else None."""
    for path in (raw_dir / stem, raw_dir / f"{stem}.gz"):
        if path.is_file():
            return path
    return None


def _stems(split: str) -> tuple[str, str]:
    prefix = _SPLITS[split]
    return f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"


def _load_idx_pair(images_path: Path, labels_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Parse one split's image and label files and check that they belong together."""
    images, labels = parse_idx(images_path), parse_idx(labels_path)
    if images.ndim != 3 or tuple(images.shape[1:]) != (28, 28):
        raise DataError(f"{images_path}: expected images of shape [N, 28, 28], got {list(images.shape)}.")
    if labels.ndim != 1 or len(labels) != len(images):
        raise DataError(
            f"{labels_path}: expected {len(images):,} labels to match {images_path.name}, "
            f"got shape {list(labels.shape)}. Delete both files and load again."
        )
    if len(labels) and int(labels.max()) > 9:
        raise DataError(f"{labels_path}: labels must be digits 0..9, found {int(labels.max())}.")
    return images, labels.long()


def _load_local(raw_dir: Path, source: Literal["local", "download"]) -> MNISTSplits:
    """Parse the four files in raw_dir into splits; the note says where they came from."""
    tensors = []
    for split in _SPLITS:
        tensors += _load_idx_pair(*(_idx_path(raw_dir, stem) for stem in _stems(split)))
    how = "from the local copy in" if source == "local" else "downloaded just now into"
    note = f"{len(tensors[0]):,} train / {len(tensors[2]):,} test MNIST digits {how} {raw_dir}."
    return MNISTSplits(*tensors, source=source, note=note)


# ------------------------------------------------------------------------------------------------ download


def _fetch(url: str, dest: Path, md5: str, deadline: float, cancel: threading.Event) -> None:
    """Download url to dest (via dest.part, then rename) and check its md5."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("no time left")
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.md5(usedforsecurity=False)
    try:
        request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT})
        with urllib.request.urlopen(request, timeout=remaining) as response, open(part, "wb") as out:
            while chunk := response.read(1 << 16):
                if cancel.is_set() or time.monotonic() > deadline:
                    raise TimeoutError("ran out of time mid-download")
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != md5:
            raise DataError(f"md5 {digest.hexdigest()} instead of the expected {md5}")
        if cancel.is_set():
            raise TimeoutError("ran out of time")
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


def _extract(gz: Path, cancel: threading.Event) -> None:
    """Decompress raw/x.gz next to itself as raw/x, keeping the .gz, as torchvision does."""
    dest = gz.with_suffix("")
    part = dest.with_name(dest.name + ".part")
    try:
        with gzip.open(gz, "rb") as src, open(part, "wb") as out:
            out.write(src.read())
        if cancel.is_set():
            raise TimeoutError("ran out of time")
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


def _download_all(
    raw_dir: Path,
    mirrors: list[str],
    resources: list[tuple[str, str]],
    deadline: float,
    cancel: threading.Event,
) -> None:
    """Fetch every (filename, md5) in resources, trying the mirrors in order, and extract each."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    for filename, md5 in resources:
        gz = raw_dir / filename
        if not (gz.is_file() and hashlib.md5(gz.read_bytes(), usedforsecurity=False).hexdigest() == md5):
            errors, unresolved = [], []
            for mirror in mirrors:
                host = urllib.parse.urlsplit(mirror).netloc or mirror
                try:
                    _fetch(f"{mirror}{filename}", gz, md5, deadline, cancel)
                    break
                except (OSError, http.client.HTTPException, DataError) as e:  # OSError: URLError, timeouts
                    errors.append(f"{filename} from {host}: {e}")
                    if isinstance(getattr(e, "reason", None), socket.gaierror):
                        unresolved.append(host)
            else:
                if len(unresolved) == len(mirrors):  # offline: say so in a few words, not one error per mirror
                    raise OSError(f"no network (no mirror's name resolved: {', '.join(unresolved)})")
                raise OSError("; ".join(errors))
        if not gz.with_suffix("").is_file():
            _extract(gz, cancel)


def _download(raw_dir: Path, timeout_s: float) -> None:
    """Download the four MNIST files into raw_dir under one deadline of timeout_s seconds.

    The mirror and (filename, md5) lists are torchvision's own (``torchvision.datasets.MNIST``). The
    network work runs in a daemon thread so that nothing (not even a DNS lookup, which socket timeouts
    do not cover) holds the caller past the deadline; a late thread is told to stop and renames nothing.
    """
    from torchvision.datasets import MNIST  # imported before the clock starts: it takes a second or two

    mirrors, resources = list(MNIST.mirrors), list(MNIST.resources)
    deadline = time.monotonic() + timeout_s
    cancel = threading.Event()
    outcome: list[BaseException | None] = []

    def work() -> None:
        try:
            _download_all(raw_dir, mirrors, resources, deadline, cancel)
            outcome.append(None)
        except BaseException as e:  # handed to the caller below
            outcome.append(e)

    worker = threading.Thread(target=work, name="mnist-download", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        cancel.set()
        raise TimeoutError(f"timed out: no complete download within timeout_s={timeout_s:g} s")
    if outcome[0] is not None:
        raise outcome[0]


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


# ---------------------------------------------------------------------------------------------- loaders


def load_mnist(
    root: str | Path = DATA_DIR, *, download: bool = True, timeout_s: float = 10.0, verbose: bool = True
) -> MNISTSplits:
    """Load MNIST from a local copy, else a download, else the bundled sample.

    1. A local copy in torchvision's layout, ``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``
       (raw or ``.gz``). A corrupt local file raises `DataError` rather than being skipped silently.
    2. If ``download`` is true and the environment variable ``COURSE_OFFLINE`` is not "1": the four files
       from torchvision's mirrors, md5-checked, written atomically and extracted into root/MNIST/raw, so
       ``torchvision.datasets.MNIST(root)`` reads them too. The whole attempt gives up after ``timeout_s``.
    3. Otherwise, or if the download fails: the bundled sample, 4,000 train / 1,000 test digits.

    Args:
        root: folder holding (or to receive) ``MNIST/raw``; the repository's data/ by default.
        download: whether step 2 may run.
        timeout_s: deadline in seconds for the whole download attempt.
        verbose: print one line saying which source was used, and why for the sample.

    Returns:
        The splits as CPU tensors; ``.source`` and ``.note`` say where they came from.

    Raises:
        DataError: a local file or the bundled sample is corrupt (the message names the file).
    """
    raw_dir = Path(root) / "MNIST" / "raw"
    stems = [stem for split in _SPLITS for stem in _stems(split)]
    missing = [stem for stem in stems if _idx_path(raw_dir, stem) is None]
    if not missing:
        splits = _load_local(raw_dir, "local")
    else:
        if not download:
            reason = f"download=False and there is no complete local copy in {raw_dir}"
        elif os.environ.get("COURSE_OFFLINE") == "1":
            reason = f"COURSE_OFFLINE=1 and there is no complete local copy in {raw_dir}"
        else:
            try:
                _download(raw_dir, timeout_s)
                reason = None
            except Exception as e:  # any failure: fall back, and say why
                reason = f"the download failed: {_one_line(e)}"
        if reason is None:
            splits = _load_local(raw_dir, "download")
        else:
            splits = load_bundled_sample()
            splits.note = f"{splits.note.removesuffix('.')}, used because {reason}."
    if verbose:
        print(splits.note)
    return splits


def load_bundled_sample(path: str | Path = BUNDLED_SAMPLE) -> MNISTSplits:
    """Load the bundled 5,000-digit sample of the real MNIST, split 4,000 train / 1,000 test.

    The file holds 500 digits per class, ordered by class; for each class the first 400 go to train
    and the last 100 to test (deterministic and stratified). data/README.md says where it came from.

    Args:
        path: the .npz file, with arrays ``images`` uint8 [5000, 28, 28] and ``labels`` uint8 [5000].

    Returns:
        The splits as CPU tensors, with ``source="bundled-sample"``.

    Raises:
        DataError: the file is missing, unreadable, or its arrays are not what they should be.
    """
    path = Path(path)
    fix = "Restore it from the repository (git checkout -- data/mnist_sample_5k.npz)."
    try:
        with np.load(path, allow_pickle=False) as npz:
            images, labels = npz["images"], npz["labels"]
    except Exception as e:  # missing file, bad zip, missing key, pickled objects, ...
        raise DataError(f"{path}: cannot read the bundled MNIST sample ({_one_line(e)}). {fix}") from e
    n = 10 * _SAMPLE_PER_CLASS
    if images.dtype != np.uint8 or images.shape != (n, 28, 28):
        raise DataError(
            f"{path}: expected images uint8 [{n}, 28, 28], got {images.dtype} {list(images.shape)}. {fix}"
        )
    if labels.dtype != np.uint8 or labels.shape != (n,):
        raise DataError(
            f"{path}: expected labels uint8 [{n}], got {labels.dtype} {list(labels.shape)}. {fix}"
        )
    counts = np.bincount(labels, minlength=10)
    if len(counts) != 10 or (counts != _SAMPLE_PER_CLASS).any():
        raise DataError(
            f"{path}: expected {_SAMPLE_PER_CLASS} digits of each class 0..9, got {counts.tolist()}. {fix}"
        )

    by_class = [np.flatnonzero(labels == digit) for digit in range(10)]
    train = np.concatenate([idx[:_SAMPLE_TRAIN_PER_CLASS] for idx in by_class])
    test = np.concatenate([idx[_SAMPLE_TRAIN_PER_CLASS:] for idx in by_class])
    images_t, labels_t = torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))
    note = (
        f"{len(train):,} train / {len(test):,} test digits of the real MNIST "
        f"({_SAMPLE_TRAIN_PER_CLASS}/{_SAMPLE_PER_CLASS - _SAMPLE_TRAIN_PER_CLASS} per class) "
        f"from the bundled offline sample {path.name}."
    )
    return MNISTSplits(
        images_t[train], labels_t[train], images_t[test], labels_t[test], "bundled-sample", note
    )


# --------------------------------------------------------------------------- feeding a model: two paths


class MNISTDataset(torch.utils.data.Dataset):
    """uint8 MNIST images and labels, normalised one item at a time: the classic DataLoader path.

    ``dataset[i]`` returns ``(image, label)``: a float32 [1, 28, 28] tensor computed exactly as
    torchvision's ``ToTensor()`` followed by ``Normalize((0.1307,), (0.3081,))``, and the label as an int.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """Wrap images (uint8 [N, H, W]) and labels ([N]); nothing is copied."""
        if images.dtype != torch.uint8 or images.ndim != 3:
            raise ValueError(f"images must be uint8 [N, H, W], got {images.dtype} {list(images.shape)}")
        if labels.ndim != 1 or len(labels) != len(images):
            raise ValueError(f"labels must be [N] with N={len(images)}, got {list(labels.shape)}")
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        """Number of images."""
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """The normalised image float32 [1, H, W] and its label."""
        image = self.images[index].unsqueeze(0).float().div(255)  # ToTensor
        return image.sub(MNIST_MEAN).div(MNIST_STD), int(self.labels[index])  # Normalize


def seeded_loader(dataset: torch.utils.data.Dataset, batch_size: int, *, seed: int = 0,
                  **options) -> torch.utils.data.DataLoader:
    """A shuffling ``DataLoader`` whose order depends on ``seed`` alone, whatever its ``options``.

    The sampler gets a generator of its own. With ``shuffle=True`` the order would come from the loader's
    generator, which starting worker processes also draws from, so adding workers would reshuffle. Every epoch
    draws the next permutation from that generator, so two loaders made alike yield the same batches, epoch by
    epoch. ``options`` go to ``DataLoader`` (``num_workers``, ``pin_memory``, ``persistent_workers``, ...).
    """
    order = torch.Generator().manual_seed(seed)
    sampler = torch.utils.data.RandomSampler(dataset, generator=order)
    return torch.utils.data.DataLoader(dataset, batch_size, sampler=sampler, **options)


def drain(loader: Iterable, device: torch.device | str) -> int:
    """Produce one epoch of ``loader``'s batches and copy each tensor of a batch to ``device`` (non-blocking):
    the input pipeline without the model. Returns the number of batches; the copies are queued, so time it with
    a synchronising clock (``utils.bench``)."""
    batches = 0
    for batch in loader:
        for tensor in batch if isinstance(batch, (tuple, list)) else (batch,):
            if isinstance(tensor, torch.Tensor):
                tensor.to(device, non_blocking=True)
        batches += 1
    return batches


def normalize_images(images_uint8: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Normalise a whole uint8 [N, H, W] image tensor to float32 [N, 1, H, W] in one vectorised op.

    The same arithmetic as `MNISTDataset` (ToTensor + Normalize), for all images at once. With a device,
    the uint8 bytes are moved first and converted there: a quarter of the bytes that float32 would need.
    """
    if images_uint8.dtype != torch.uint8 or images_uint8.ndim != 3:
        raise ValueError(f"expected uint8 [N, H, W], got {images_uint8.dtype} {list(images_uint8.shape)}")
    x = images_uint8.to(device) if device is not None else images_uint8
    return x.unsqueeze(1).float().div(255).sub(MNIST_MEAN).div(MNIST_STD)


def device_batches(
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    *,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(xb, yb)`` mini-batches of tensors that already live on a device: one epoch.

    The shuffle permutation is drawn on x's device (``torch.randperm(..., device=x.device)``), so a
    GPU-resident epoch never goes back to the CPU. The arguments are checked when called, not when
    first iterated.

    Args:
        x, y: inputs and targets with the same first dimension, on the same device.
        batch_size: examples per batch (> 0).
        shuffle: draw a fresh permutation for this epoch; otherwise batches are in order (views).
        generator: random generator for the permutation; must be on x's device.
        drop_last: skip the final batch if it is smaller than batch_size.

    Raises:
        ValueError: bad batch_size, mismatched lengths, or tensors/generator on different devices.
    """
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if len(x) != len(y):
        raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
    if x.device != y.device:
        raise ValueError(f"x and y must be on the same device, got {x.device} and {y.device}")
    if generator is not None and shuffle and generator.device != x.device:
        raise ValueError(
            f"generator is on {generator.device} but x is on {x.device}; create it on {x.device}"
        )

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(x)
        stop = n - n % batch_size if drop_last else n
        order = torch.randperm(n, device=x.device, generator=generator) if shuffle else None
        for start in range(0, stop, batch_size):
            if order is None:
                yield x[start : start + batch_size], y[start : start + batch_size]
            else:
                idx = order[start : start + batch_size]
                yield x[idx], y[idx]

    return batches()


# ------------------------------------------------------------------------------------------ synthetic data


def synthetic_tokens(
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    *,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids for language-model throughput work: ``(inputs, targets)``, int64 [B, T] each.

    ``targets`` is ``inputs`` shifted left by one (``targets[:, t] == inputs[:, t + 1]``), as in
    next-token prediction. Both are contiguous, so ``targets.view(-1)`` works. Uniform over the
    vocabulary, never all zeros.
    """
    if batch_size <= 0 or seq_len <= 0 or vocab_size < 2:
        raise ValueError(
            f"need batch_size > 0, seq_len > 0, vocab_size >= 2; got {batch_size}, {seq_len}, {vocab_size}"
        )
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), device=device, generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def patterned_tokens(
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    *,
    noise: float = 0.1,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids a language model can *learn*, for loss curves: ``(inputs, targets)``, int64 [B, T] each.

    Each next token is a fixed function of the previous one, ``(31 * prev + 7) % vocab_size``, except that with
    probability ``noise`` it is drawn uniformly instead. Random tokens (:func:`synthetic_tokens`) are fine for
    timing but nothing can be learned from them; here the loss falls from ln(vocab_size) towards
    :func:`patterned_tokens_min_loss`, so runs in different precisions can be compared on how they train.
    """
    if batch_size <= 0 or seq_len <= 0 or vocab_size < 2 or not 0.0 < noise < 1.0:
        raise ValueError(f"need batch_size > 0, seq_len > 0, vocab_size >= 2, 0 < noise < 1; got "
                         f"{batch_size}, {seq_len}, {vocab_size}, {noise}")
    tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.int64, device=device)
    tokens[:, 0] = torch.randint(0, vocab_size, (batch_size,), device=device, generator=generator)
    for t in range(1, seq_len + 1):
        follow = (31 * tokens[:, t - 1] + 7) % vocab_size
        random = torch.randint(0, vocab_size, (batch_size,), device=device, generator=generator)
        coin = torch.rand(batch_size, device=device, generator=generator)
        tokens[:, t] = torch.where(coin < noise, random, follow)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def patterned_tokens_min_loss(vocab_size: int, noise: float = 0.1) -> float:
    """The lowest mean cross-entropy (nats) any model can reach on :func:`patterned_tokens`: the entropy of
    the next token given the previous one."""
    p_follow = 1.0 - noise + noise / vocab_size
    p_other = noise / vocab_size
    return -(p_follow * math.log(p_follow) + (vocab_size - 1) * p_other * math.log(p_other))


def synthetic_images(
    batch_size: int,
    *,
    channels: int = 1,
    size: int = 28,
    num_classes: int = 10,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images for throughput work: ``(x, y)``.

    x is float32 [B, channels, size, size] drawn from N(0, 1); y is int64 [B] in [0, num_classes).
    """
    x = torch.randn(batch_size, channels, size, size, device=device, generator=generator)
    y = torch.randint(0, num_classes, (batch_size,), device=device, generator=generator)
    return x, y


__all__ = [
    "BUNDLED_SAMPLE",
    "DATA_DIR",
    "MNIST_MEAN",
    "MNIST_STD",
    "DataError",
    "MNISTDataset",
    "MNISTSplits",
    "device_batches",
    "load_bundled_sample",
    "load_mnist",
    "normalize_images",
    "parse_idx",
    "synthetic_images",
    "synthetic_tokens",
]
