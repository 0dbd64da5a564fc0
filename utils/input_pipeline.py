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
- :func:`cpu_use` — how busy the CPUs, the main process and the workers were while something ran;
  :func:`loader_sweep` — :func:`loader_timing` over worker counts with the CPUs' use at each, and
  :class:`LoaderSweep`'s measured reason why N workers deliver less than N lone workers (cores all busy, the main
  process busy, each image dearer in the workers' CPU time, workers idle; else: not measured);
  :func:`workers_that_fit` — the workers whose batches fit in ``/dev/shm``.
- :func:`normalize` — uint8 images on the device → the float batch a model trains on (ImageNet mean and std).

torchvision 0.29 deprecates its image codecs in favour of TorchCodec and warns on every call; the functions here
silence that one warning (the codecs still work, and the course pins no TorchCodec).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from torchvision import io as tv_io
from torchvision.ops import roi_align
from torchvision.transforms import v2

from utils.bench import Timing, bench

T = TypeVar("T")
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


# ── What the CPUs did while a loader ran, and the loader's scaling with its workers ──────────────────────────


def _proc_stat(cpus: Sequence[int], path: str | Path = "/proc/stat") -> tuple[float, float] | None:
    """(busy, total) jiffies summed over ``cpus`` from Linux's ``/proc/stat`` (idle and iowait are not busy);
    None where it cannot be read."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    wanted, busy, total = {f"cpu{c}" for c in cpus}, 0.0, 0.0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            values = [float(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            total += sum(values)
            busy += sum(values) - values[3] - values[4]
    return (busy, total) if total > 0 else None


def _children_cpu_s() -> float | None:
    """CPU seconds (user + system) of this process's children that have ended and been waited for — a
    ``DataLoader``'s workers, once its iterator is gone; None where ``resource`` is missing (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class CpuUse:
    """How busy the CPUs were while something ran: ``busy_cores`` of the ``cores`` this process may use were
    busy on average (every process on them: workers, the main process, anything else; None where Linux's
    ``/proc/stat`` cannot be read, or reads zeros as in gVisor), ``main_cores`` of them were this process (all its
    threads), and ``children_cores`` its children that ended meanwhile (a ``DataLoader``'s workers; None where
    that cannot be read)."""

    cores: int
    busy_cores: float | None
    main_cores: float
    children_cores: float | None = None

    def __str__(self) -> str:
        busy = "not measurable here" if self.busy_cores is None else f"{self.busy_cores:.1f} of {self.cores} busy"
        workers = "" if self.children_cores is None else f"; the workers {self.children_cores:.1f} cores"
        return f"CPUs: {busy}; the main process {self.main_cores:.0%} of a core{workers}"


def cpu_use(fn: Callable[[], T], *, cpus: Sequence[int] | None = None,
            stat_path: str | Path = "/proc/stat") -> tuple[T, CpuUse]:
    """Run ``fn()`` and return its result with the :class:`CpuUse` meanwhile, over the CPUs this process may run
    on (``cpus``, ``stat_path``: for tests). The children's share counts only children that ``fn`` also waited
    for (as a ``DataLoader`` does when its iterator goes), over the whole call, their start included."""
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cpus = list(cpus)
    before, children0 = _proc_stat(cpus, stat_path), _children_cpu_s()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = fn()
    cpu1, wall1 = time.process_time(), time.perf_counter()
    after, children1 = _proc_stat(cpus, stat_path), _children_cpu_s()
    wall = max(wall1 - wall0, 1e-9)
    busy = None
    if before is not None and after is not None and after[1] > before[1]:
        busy = len(cpus) * (after[0] - before[0]) / (after[1] - before[1])
    children = None if children0 is None or children1 is None else (children1 - children0) / wall
    return result, CpuUse(len(cpus), busy, (cpu1 - cpu0) / wall, children)


def workers_that_fit(workers: int, batch_size: int, size: int, *, shm_free: int | None = -1) -> int:
    """At most ``workers``, and no more than whose batches (uint8 ``3×size×size`` images, two batches each in
    flight) fit in half of ``/dev/shm``'s free space: workers hand batches over in shared memory, and a container's
    small ``/dev/shm`` makes them crash ("bus error"). ``shm_free``: bytes free (default: read it; None: no limit)."""
    if shm_free == -1:
        shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
    if shm_free is None:
        return max(1, workers)
    return max(1, min(workers, int(shm_free / 2 / (2 * batch_size * 3 * size * size))))


@dataclass
class LoaderSweep:
    """A ``DataLoader``'s steady-state rate at several worker counts (:func:`loader_sweep`), with the CPUs' use at
    each. ``per_worker``: one worker's rate in a ``DataLoader`` (the first count, 1), the baseline of scaling."""

    timings: dict[int, Timing]
    use: dict[int, CpuUse]
    batch_size: int
    physical_cores: int | None = None  # behind the CPUs this process may use (:func:`cpu_cores`); None: not known

    @property
    def counts(self) -> list[int]:
        return list(self.timings)

    def rate(self, workers: int) -> float:
        return 1 / self.timings[workers].median_s

    @property
    def per_worker(self) -> float:
        return self.rate(self.counts[0]) / self.counts[0]

    @property
    def best(self) -> int:
        return max(self.counts, key=self.rate)

    def efficiency(self, workers: int) -> float:
        """Images/s at ``workers`` over ``workers`` × one worker's: 1 where every worker adds a whole worker."""
        return self.rate(workers) / (workers * self.per_worker)

    def rows(self) -> list[dict[str, object]]:
        return [{"workers": n, "images/s": f"{self.rate(n):,.0f}", "band": f"{self.timings[n].spread:.0%}",
                 "per worker": f"{self.rate(n) / n:,.0f}", "of n × one worker": f"{self.efficiency(n):.0%}",
                 "CPUs busy": "—" if self.use[n].busy_cores is None else
                 f"{self.use[n].busy_cores:.1f} of {self.use[n].cores}",
                 "main process": f"{self.use[n].main_cores:.0%}",
                 "each worker busy": "—" if self.use[n].children_cores is None else
                 f"{self.use[n].children_cores / n:.0%}"} for n in self.counts]

    def why_short(self, workers: int) -> str:
        """The measured reason why ``workers`` workers deliver less than that many lone workers: the CPUs all busy
        (they share cores), the main process busy (it collects, pins and copies every batch), each image costing the
        workers more CPU time than at the first count (they slow each other down), or the workers idle part of the
        time (they waited). Otherwise the cause is not measured here, and the sentence says so. Where the CPUs' use
        cannot be read (``busy_cores`` None: gVisor's ``/proc/stat`` reads zeros), it claims nothing about them."""
        use, eff = self.use[workers], self.efficiency(workers)
        head = f"at {workers} workers each delivers {eff:.0%} of a lone worker's rate"
        if eff >= 0.8:
            return f"{head}: they scale"
        if use.busy_cores is not None and use.busy_cores >= 0.9 * use.cores:
            return (f"{head}: the CPUs were busy ({use.busy_cores:.1f} of {use.cores} cores on average), so the "
                    "workers and the main process shared cores")
        if use.main_cores >= 0.9:
            return (f"{head}: the main process was busy {use.main_cores:.0%} of the time (it collects, pins and "
                    "copies every batch): it sets the pace, not the workers")
        smt = self.physical_cores is None or self.physical_cores < use.cores  # hyper-threads share a core
        cause = ("other processes on this host, shared caches, memory bandwidth, "
                 + ("hyper-threads, " if smt else "") + "lower clocks with many cores busy")
        first, one = self.counts[0], self.use[self.counts[0]]
        if use.children_cores and one.children_cores:  # the workers' CPU seconds per image, against the first count
            def cost(n: int) -> float | None:  # CPU seconds per image at n workers, over the first count's
                u = self.use[n]
                return None if not u.children_cores else (u.children_cores / self.rate(n)) / (
                    one.children_cores / self.rate(first))

            dearer = cost(workers)
            busy_each = use.children_cores / workers
            if dearer >= 1.2:
                between = {n: cost(n) for n in self.counts if first < n < workers and cost(n) is not None}
                cheapest = min(between, key=between.get, default=None)
                steady = "" if cheapest is None or between[cheapest] >= 1.0 else (
                    f", though at {cheapest} workers it took {between[cheapest]:.2f}×: not rising with the count")
                return (f"{head}: each image took {dearer:.2f}× the workers' CPU time it took at {first} worker"
                        f"{'s' * (first != 1)}{steady}, so each worker did less per CPU second ({cause}: not "
                        "measured which)")
            if busy_each < 0.8:
                return (f"{head}: each worker was busy only {busy_each:.0%} of the time, so they waited (for a free "
                        "CPU, for the main process to take their batches, or for their files: not measured which)")
        if use.busy_cores is None:  # e.g. a sandbox whose /proc/stat reads zeros: no claim about the cores
            return (f"{head}; the main process was busy {use.main_cores:.0%} of a core, and how busy the CPUs were "
                    f"is not measurable here (Linux's /proc/stat): what held the workers back — CPUs shared, "
                    f"{cause} — is not measured here")
        return (f"{head}; neither were the CPUs saturated ({use.busy_cores:.1f} of {use.cores} busy) nor the main "
                f"process ({use.main_cores:.0%} of a core): what held them back — {cause} — is not measured here")

    def summary(self, train_rate: float) -> str:
        """Whether the loader keeps up with a step training ``train_rate`` images/s, beyond its noise, and how it
        scaled (:meth:`why_short` at the best count)."""
        best = self.best
        slow = {n: 1 / self.timings[n].quartiles_s[1] for n in self.counts}  # the slower quartile's rate
        enough = [n for n in self.counts if slow[n] >= train_rate]
        if enough:
            keeps = (f"{enough[0]} worker{'s' * (enough[0] != 1)} keep{'s' * (enough[0] == 1)} up with it, beyond "
                     "the loader's noise")
        elif self.rate(best) >= train_rate:
            keeps = f"{best} workers supply about as much, within the loader's noise: no margin to spare"
        else:
            keeps = f"it trains {train_rate / self.rate(best):.2f}× what the loader supplies at best"
        text = (f"the DataLoader supplies at most {self.rate(best):,.0f} images/s in batches of {self.batch_size}, "
                f"with {best} worker{'s' * (best != 1)}; the step trains {train_rate:,.0f}: {keeps}")
        return text + ("" if best == self.counts[0] else f"\n{self.why_short(best)}")

    def enough(self, train_rate: float) -> int:
        """The fewest workers whose slower-quartile rate keeps up with ``train_rate``, else the fastest count."""
        return next((n for n in self.counts if 1 / self.timings[n].quartiles_s[1] >= train_rate), self.best)


def loader_sweep(dataset: torch.utils.data.Dataset, counts: Sequence[int], *, batch_size: int,
                 **options) -> LoaderSweep:
    """:func:`loader_timing` at every worker count in ``counts`` (the first should be 1: the baseline of scaling),
    each with the CPUs' use while it ran (:func:`cpu_use`); ``options`` go to :func:`loader_timing`.

    Raises:
        ValueError: for no counts.
    """
    if not counts:
        raise ValueError("loader_sweep() needs at least one worker count")
    timings, use = {}, {}
    for n in counts:
        timings[n], use[n] = cpu_use(lambda n=n: loader_timing(dataset, workers=n, batch_size=batch_size,
                                                               label=f"{n} workers", **options))
    return LoaderSweep(timings, use, batch_size, cpu_cores()[1])
