"""The input pipeline of image training: JPEG files in, normalised training batches out — on the CPU in
``DataLoader`` workers, or decoded and augmented on the GPU — and how many workers a training rate needs.

- :func:`synthetic_jpegs` — JPEG files' bytes that compress like photographs (ImageNet is not downloadable here):
  smooth random colour fields with fine grain, about ImageNet's average size and file size.
- :class:`JpegFiles` — a ``Dataset`` of JPEG files: read, decode (libjpeg-turbo, one CPU thread) and augment
  (``RandomResizedCrop`` + horizontal flip, torchvision's ImageNet recipe) per item, as a ``DataLoader`` worker does.
- :func:`gpu_decode_augment` — the same work for a whole batch on the device: ``torchvision.io.decode_jpeg`` with
  ``device="cuda"`` (nvJPEG), then one random crop per image resized in one ``roi_align`` call, and flips.
- :func:`one_worker_timing` — what one worker (one CPU thread) sustains; :func:`workers_needed` — how many such
  workers keep up with a training rate.
- :func:`loader_timing` — what a ``DataLoader`` with N workers supplies in steady state (one live iterator, rounds
  of N batches), optionally feeding each batch to a training step; :func:`cpu_cores` — the logical CPUs this process
  may use and the physical cores behind them (the workers' budget).
- :func:`normalize` — uint8 images on the device → the float batch a model trains on (ImageNet mean and std).

torchvision 0.29 deprecates its image codecs in favour of TorchCodec and warns on every call; the functions here
silence that one warning (the codecs still work, and the course pins no TorchCodec).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torchvision import io as tv_io
from torchvision.ops import roi_align
from torchvision.transforms import v2

from utils.bench import Timing, bench

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: ImageNet's training images average about 400×350 pixels and 110 KB; the default synthetic size is close.
DEFAULT_HEIGHT, DEFAULT_WIDTH = 375, 500


@contextlib.contextmanager
def _codec_quiet() -> Iterator[None]:
    """Silence torchvision 0.29's deprecation warning of its image codecs (only that warning)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*image decoding and encoding capabilities", category=Warning)
        yield


def synthetic_jpegs(count: int, *, height: int = DEFAULT_HEIGHT, width: int = DEFAULT_WIDTH, quality: int = 90,
                    seed: int = 0) -> list[torch.Tensor]:
    """``count`` JPEG files' bytes (1-D uint8 tensors, on the CPU) of ``height``×``width`` RGB images.

    Each image is a smooth random colour field (12×16 random colours upsampled bicubically) with a little fine
    grain: it compresses like a photograph (tens of KB at the default size) — pure noise would compress ten times
    worse and decode slower than real data. Deterministic for a ``seed``.

    Raises:
        ValueError: for a count below 1, a side below 16 pixels or a quality outside 1..100.
    """
    if count < 1 or height < 16 or width < 16 or not 1 <= quality <= 100:
        raise ValueError(f"synthetic_jpegs(): need count >= 1, height and width >= 16 and quality in 1..100, got "
                         f"count={count}, {height}×{width}, quality={quality}")
    gen = torch.Generator().manual_seed(seed)
    encoded: list[torch.Tensor] = []
    for start in range(0, count, 32):  # chunks: a few MB of float pixels at a time
        n = min(32, count - start)
        fields = F.interpolate(torch.rand(n, 3, 12, 16, generator=gen), size=(height, width), mode="bicubic",
                               align_corners=False)
        grain = 0.03 * torch.randn(n, 3, height, width, generator=gen)
        pixels = (fields + grain).clamp(0, 1).mul(255).round().to(torch.uint8)
        with _codec_quiet():
            encoded += tv_io.encode_jpeg(list(pixels), quality=quality)
    return encoded


def write_jpegs(encoded: Sequence[torch.Tensor], folder: str | Path) -> list[Path]:
    """Write JPEG bytes to ``folder/000000.jpg``, ... (the folder is created); returns the paths in order."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, data in enumerate(encoded):
        path = folder / f"{i:06d}.jpg"
        path.write_bytes(data.numpy().tobytes())
        paths.append(path)
    return paths


def read_jpegs(paths: Sequence[str | Path]) -> list[torch.Tensor]:
    """The bytes of JPEG files as 1-D uint8 tensors (what :func:`decode_batch` takes)."""
    with _codec_quiet():
        return [tv_io.read_file(str(p)) for p in paths]


def cpu_augment(size: int) -> v2.Compose:
    """torchvision's ImageNet training augmentation on a uint8 image: ``RandomResizedCrop(size)`` (antialiased)
    and a random horizontal flip."""
    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])


class JpegFiles(torch.utils.data.Dataset):
    """JPEG files as a training set: item ``i`` is ``(uint8 [3, size, size], label)``, read from disk, decoded on the
    CPU and augmented — the work each ``DataLoader`` worker does per image.

    ``length`` (default: the number of files) may exceed the number of files: items then cycle through them, so
    a few hundred generated files can stand for an epoch of any length. Labels are random (fixed by ``seed``).

    Raises:
        ValueError: for an empty list of paths or a size below 8.
    """

    def __init__(self, paths: Sequence[str | Path], *, size: int = 224, length: int | None = None,
                 classes: int = 1000, seed: int = 0) -> None:
        if not paths:
            raise ValueError("JpegFiles needs at least one file")
        if size < 8:
            raise ValueError(f"JpegFiles: size must be at least 8 pixels, got {size}")
        self.paths = [str(p) for p in paths]
        self.length = length or len(self.paths)
        self.labels = torch.randint(0, classes, (self.length,), generator=torch.Generator().manual_seed(seed))
        self.augment = cpu_augment(size)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with _codec_quiet():
            data = tv_io.read_file(self.paths[index % len(self.paths)])
            image = tv_io.decode_jpeg(data, mode=tv_io.ImageReadMode.RGB)
        return self.augment(image), int(self.labels[index])


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def one_worker_timing(dataset: torch.utils.data.Dataset, *, items: int = 32, min_run_time: float = 1.0) -> Timing:
    """The time to fetch ``items`` items of ``dataset`` (read + decode + augment) in this process on one CPU thread —
    what one ``DataLoader`` worker does (PyTorch gives each worker one thread). Items per second per worker:
    ``items / timing.median_s``."""
    if items < 1:
        raise ValueError(f"one_worker_timing(): items must be at least 1, got {items}")
    n = len(dataset)
    with _threads(1):
        return bench(lambda: [dataset[i % n] for i in range(items)], label="one worker", device="cpu", warmup=1,
                     min_blocks=3, min_run_time=min_run_time)


def workers_needed(train_items_per_s: float, per_worker_items_per_s: float) -> int:
    """The fewest workers whose combined rate reaches the training rate (each worker runs on a core of its own).

    Raises:
        ValueError: for a rate that is not positive.
    """
    if not (train_items_per_s > 0 and per_worker_items_per_s > 0):
        raise ValueError(f"workers_needed(): rates must be positive, got {train_items_per_s} and "
                         f"{per_worker_items_per_s}")
    return max(1, math.ceil(train_items_per_s / per_worker_items_per_s))


class _Endless(torch.utils.data.Sampler):
    """Indices 0 … n−1, over and over: a ``DataLoader`` on it streams batches until its iterator is dropped."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return itertools.cycle(range(self.n))


def loader_timing(dataset: torch.utils.data.Dataset, *, workers: int, batch_size: int,
                  consume: Callable[[object], object] | None = None, pin_memory: bool = False,
                  prefetch_factor: int = 2, min_run_time: float = 1.0, device: torch.device | str | None = None,
                  label: str | None = None) -> Timing:
    """What a ``DataLoader`` with ``workers`` worker processes supplies in steady state: a :class:`Timing` *per
    item* (``1 / timing.median_s`` is items per second).

    A ``DataLoader`` parallelises over batches, not items: each worker builds whole batches, one at a time. Timed
    epoch by epoch, it shows its start-up (workers begin together, the queue fills) and, in an epoch of fewer
    batches than workers, leaves workers idle. Here one iterator streams batches from an endless sampler; each timed
    call takes one round of ``workers`` batches (each worker delivers about one) and hands each batch to
    ``consume`` (e.g. copy it to the GPU and train on it; default: nothing); the first round, the workers' start,
    is warm-up. The workers end before this returns.

    ``device`` is where ``consume`` works, for the timer (:func:`utils.bench.bench`'s default: the GPU when there
    is one): pass ``"cpu"`` when it does no GPU work.

    Raises:
        ValueError: for fewer than 1 worker, a batch size or prefetch factor below 1, or an empty dataset.
    """
    if workers < 1 or batch_size < 1 or prefetch_factor < 1:
        raise ValueError(f"loader_timing(): need workers, batch_size and prefetch_factor >= 1, got {workers}, "
                         f"{batch_size} and {prefetch_factor}")
    if len(dataset) < 1:
        raise ValueError("loader_timing(): the dataset is empty")
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=_Endless(len(dataset)),
                                         num_workers=workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor)
    batches = iter(loader)

    def one_round() -> None:
        for _ in range(workers):
            batch = next(batches)
            if consume is not None:
                consume(batch)

    try:
        timing = bench(one_round, label=label or f"{workers} workers", device=device, warmup=1, min_blocks=3,
                       min_run_time=min_run_time)
    finally:
        batches = None  # the iterator's last reference: its worker processes end here
    items = workers * batch_size
    return Timing(timing.label, timing.median_s / items, timing.iqr_s / items,
                  tuple(t / items for t in timing.block_times_s), timing.calls_per_block, timing.device)


def cpu_cores(*, cpus: Sequence[int] | None = None,
              sysfs: str | Path = "/sys/devices/system/cpu") -> tuple[int, int | None]:
    """``(logical, physical)``: the logical CPUs this process may run on (its affinity, which a container or a job
    scheduler may restrict) and the physical cores behind them, read from Linux's CPU topology — two logical CPUs of
    one core (hyper-threads) share its execution units. ``physical`` is None where the topology cannot be read
    (another OS). ``cpus`` and ``sysfs`` are for tests."""
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cpus = list(cpus)
    cores = set()
    for cpu in cpus:
        topology = Path(sysfs) / f"cpu{cpu}" / "topology"
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus), None
    return len(cpus), len(cores)


def random_crop_boxes(n: int, height: int, width: int, *, scale: tuple[float, float] = (0.08, 1.0),
                      ratio: tuple[float, float] = (3 / 4, 4 / 3), generator: torch.Generator | None = None,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """``n`` crop boxes ``[x1, y1, x2, y2]`` (float, pixels) as ``RandomResizedCrop`` draws them: an area fraction
    uniform in ``scale``, an aspect ratio log-uniform in ``ratio``, a uniform position. One draw per box, sides
    clamped to the image (torchvision re-draws up to ten times instead, then falls back to a centre crop)."""
    gen_device = generator.device if generator is not None else device
    u = torch.rand(n, 4, generator=generator, device=gen_device).to(device)
    area = height * width * (scale[0] + (scale[1] - scale[0]) * u[:, 0])
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u[:, 1])
    w = torch.sqrt(area * aspect).clamp(1, width)
    h = torch.sqrt(area / aspect).clamp(1, height)
    x1, y1 = (width - w) * u[:, 2], (height - h) * u[:, 3]
    return torch.stack([x1, y1, x1 + w, y1 + h], dim=1)


def crop_resize_flip(images: torch.Tensor, boxes: torch.Tensor, size: int, flip: torch.Tensor) -> torch.Tensor:
    """Crop box ``i`` out of image ``i`` and resize it to ``size``×``size`` (bilinear, averaging several samples per
    output pixel when shrinking), all images in one ``torchvision.ops.roi_align`` call; then mirror the images where
    ``flip`` [N] is True. ``images`` is float [N, C, H, W]; returns float [N, C, size, size].

    Raises:
        ValueError: when images, boxes and flip disagree on N.
    """
    n = images.shape[0]
    if boxes.shape != (n, 4) or flip.shape != (n,):
        raise ValueError(f"crop_resize_flip(): {n} images need boxes [{n}, 4] and flip [{n}], got "
                         f"{list(boxes.shape)} and {list(flip.shape)}")
    rois = torch.cat([torch.arange(n, device=images.device, dtype=images.dtype)[:, None],
                      boxes.to(images.device, images.dtype)], dim=1)
    out = roi_align(images, rois, output_size=size, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    return torch.where(flip.to(images.device)[:, None, None, None], out.flip(-1), out)


def decode_batch(encoded: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """JPEG bytes (on the CPU) → uint8 [N, 3, H, W] on ``device``: one batched ``decode_jpeg`` call (nvJPEG on a
    GPU). The images must share one size.

    Raises:
        ValueError: for an empty batch or images of different sizes.
    """
    if not encoded:
        raise ValueError("decode_batch() needs at least one image")
    with _codec_quiet():
        images = tv_io.decode_jpeg(list(encoded), mode=tv_io.ImageReadMode.RGB, device=torch.device(device))
    shapes = {tuple(im.shape) for im in images}
    if len(shapes) > 1:
        raise ValueError(f"decode_batch(): the images have different sizes {sorted(shapes)[:3]}; decode them apart")
    return torch.stack(images)


def gpu_decode_augment(encoded: Sequence[torch.Tensor], *, size: int, device: torch.device | str,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """A batch of JPEG files → float [N, 3, size, size] in 0..255 on ``device``, augmented like :func:`cpu_augment`
    (a random resized crop and a random flip per image): decode with :func:`decode_batch`, then
    :func:`crop_resize_flip`. ``generator`` (on ``device``) makes the crops reproducible."""
    images = decode_batch(encoded, device).float()
    n, _, height, width = images.shape
    boxes = random_crop_boxes(n, height, width, generator=generator, device=images.device)
    flip = torch.rand(n, generator=generator, device=generator.device if generator else images.device) < 0.5
    return crop_resize_flip(images, boxes, size, flip.to(images.device))


def normalize(images: torch.Tensor, *, dtype: torch.dtype = torch.float32,
              memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """Images in 0..255 (uint8 or float, [N, 3, H, W]) → (x / 255 − ImageNet mean) / std in ``dtype`` and
    ``memory_format``: the batch a model trains on. Run it on the device, after the copy (a quarter of the bytes
    cross the bus as uint8)."""
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"normalize() takes RGB images [N, 3, H, W], got {list(images.shape)}")
    mean = torch.tensor(IMAGENET_MEAN, device=images.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=images.device).view(1, 3, 1, 1) * 255
    return ((images.float() - mean) / std).to(dtype).contiguous(memory_format=memory_format)
