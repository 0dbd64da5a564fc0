"""utils.input_pipeline: synthetic JPEGs, CPU and GPU decode + augment, workers needed, normalisation."""

from __future__ import annotations

import math
import multiprocessing

import pytest
import torch

from utils import input_pipeline as ip

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def jpegs():
    return ip.synthetic_jpegs(6, height=120, width=160, seed=1)


def test_synthetic_jpegs_decode_to_the_size_and_compress_like_photos():
    encoded = ip.synthetic_jpegs(3)
    images = ip.decode_batch(encoded, "cpu")
    assert images.shape == (3, 3, ip.DEFAULT_HEIGHT, ip.DEFAULT_WIDTH) and images.dtype == torch.uint8
    raw = 3 * ip.DEFAULT_HEIGHT * ip.DEFAULT_WIDTH
    sizes = [e.numel() for e in encoded]
    assert all(raw / 40 < s < raw / 3 for s in sizes), f"not photo-like compression: {sizes} bytes of {raw}"
    assert images.float().std() > 20, "the images should have colour variation, not be flat"


def test_synthetic_jpegs_are_deterministic_per_seed(jpegs):
    again = ip.synthetic_jpegs(6, height=120, width=160, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(jpegs, again, strict=True))
    assert not torch.equal(ip.synthetic_jpegs(1, height=120, width=160, seed=2)[0], jpegs[0])


@pytest.mark.parametrize("kwargs", [{"count": 0}, {"count": 2, "height": 8}, {"count": 2, "quality": 0},
                                    {"count": 2, "quality": 101}])
def test_synthetic_jpegs_bad_input(kwargs):
    with pytest.raises(ValueError, match="synthetic_jpegs"):
        ip.synthetic_jpegs(**kwargs)


def test_jpeg_files_dataset_reads_decodes_and_augments(tmp_path, jpegs):
    paths = ip.write_jpegs(jpegs, tmp_path / "jpegs")
    assert [p.name for p in paths][:2] == ["000000.jpg", "000001.jpg"] and all(p.is_file() for p in paths)
    assert all(torch.equal(a, b) for a, b in zip(ip.read_jpegs(paths), jpegs, strict=True))
    data = ip.JpegFiles(paths, size=64, length=10)
    assert len(data) == 10
    image, label = data[9]  # past the number of files: cycles
    assert image.shape == (3, 64, 64) and image.dtype == torch.uint8 and 0 <= label < 1000
    loader = torch.utils.data.DataLoader(data, batch_size=5, num_workers=0)
    x, y = next(iter(loader))
    assert x.shape == (5, 3, 64, 64) and y.shape == (5,)


def test_jpeg_files_bad_input(tmp_path):
    with pytest.raises(ValueError, match="at least one file"):
        ip.JpegFiles([])
    with pytest.raises(ValueError, match="size"):
        ip.JpegFiles([tmp_path / "a.jpg"], size=2)


def test_one_worker_timing_counts_items(tmp_path, jpegs):
    data = ip.JpegFiles(ip.write_jpegs(jpegs, tmp_path), size=32)
    timing = ip.one_worker_timing(data, items=4, min_run_time=0.05)
    assert timing.median_s > 0 and timing.device == "cpu"
    assert torch.get_num_threads() >= 1
    with pytest.raises(ValueError, match="items"):
        ip.one_worker_timing(data, items=0)


def test_workers_needed():
    assert ip.workers_needed(1000, 300) == 4  # 3 workers give 900/s: one more is needed
    assert ip.workers_needed(900, 300) == 3
    assert ip.workers_needed(10, 300) == 1
    with pytest.raises(ValueError, match="positive"):
        ip.workers_needed(0, 100)
    with pytest.raises(ValueError, match="positive"):
        ip.workers_needed(100, math.nan)


def test_loader_timing_streams_whole_rounds_and_ends_its_workers():
    data = torch.utils.data.TensorDataset(torch.arange(7))  # fewer items than a round: the sampler wraps around
    seen = []
    timing = ip.loader_timing(data, workers=2, batch_size=3, consume=lambda batch: seen.append(batch[0].tolist()),
                              min_run_time=0.05, device="cpu")
    assert timing.median_s > 0 and timing.device == "cpu" and timing.label == "2 workers"
    # warm-up, three probes and at least three timed blocks, each call a round of one batch per worker
    assert len(seen) % 2 == 0 and len(seen) >= 2 * 7
    assert all(len(b) == 3 for b in seen)
    flat = [i for b in seen for i in b]
    assert flat[:10] == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2], "batches follow the endless sampler in order"
    assert timing.calls * 2 * 3 <= len(flat)  # the Timing is per item: rounds × workers × batch items were timed
    assert not multiprocessing.active_children(), "the worker processes should have ended"


@pytest.mark.parametrize("kwargs", [{"workers": 0, "batch_size": 2}, {"workers": 1, "batch_size": 0},
                                    {"workers": 1, "batch_size": 2, "prefetch_factor": 0}])
def test_loader_timing_bad_input(kwargs):
    with pytest.raises(ValueError, match="loader_timing"):
        ip.loader_timing(torch.utils.data.TensorDataset(torch.arange(4)), **kwargs)
    with pytest.raises(ValueError, match="empty"):
        ip.loader_timing(torch.utils.data.TensorDataset(torch.arange(0)), workers=1, batch_size=1)


def _fake_topology(root, cores):
    """A sysfs CPU folder: logical CPU i on (package, core) cores[i]."""
    for cpu, (package, core) in enumerate(cores):
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "physical_package_id").write_text(f"{package}\n")
        (folder / "core_id").write_text(f"{core}\n")


def test_cpu_cores_counts_hyperthreads_once(tmp_path):
    _fake_topology(tmp_path, [(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 0)])  # two packages, hyper-threads
    assert ip.cpu_cores(cpus=range(6), sysfs=tmp_path) == (6, 3)
    assert ip.cpu_cores(cpus=[0, 1], sysfs=tmp_path) == (2, 2)  # an affinity mask of one thread per core
    assert ip.cpu_cores(cpus=[0, 9], sysfs=tmp_path) == (2, None)  # unreadable topology: unknown, not a guess
    logical, physical = ip.cpu_cores()  # this machine
    assert logical >= 1 and (physical is None or 1 <= physical <= logical)


def test_random_crop_boxes_lie_inside_and_follow_the_scale_and_ratio():
    gen = torch.Generator().manual_seed(0)
    boxes = ip.random_crop_boxes(4000, 300, 400, generator=gen)
    x1, y1, x2, y2 = boxes.unbind(1)
    assert (x1 >= 0).all() and (y1 >= 0).all() and (x2 <= 400 + 1e-3).all() and (y2 <= 300 + 1e-3).all()
    area = (x2 - x1) * (y2 - y1) / (300 * 400)
    assert area.min() > 0.08 * 0.74 and area.max() <= 1 + 1e-5  # clamping can only shrink a box
    aspect = (x2 - x1) / (y2 - y1)
    unclamped = (x2 - x1 < 399) & (y2 - y1 < 299)
    assert ((aspect[unclamped] > 0.75 - 1e-4) & (aspect[unclamped] < 4 / 3 + 1e-4)).all()
    assert 0.4 < area.mean() < 0.65  # uniform area fraction in [0.08, 1]: mean 0.54, less where clamped
    again = ip.random_crop_boxes(4000, 300, 400, generator=torch.Generator().manual_seed(0))
    assert torch.equal(boxes, again)


def test_crop_resize_flip_whole_image_is_identity_and_flip_mirrors():
    images = torch.rand(3, 3, 20, 30) * 255
    whole = torch.tensor([[0.0, 0.0, 30.0, 20.0]] * 3)
    same = ip.crop_resize_flip(images[:, :, :, :20], torch.tensor([[0.0, 0.0, 20.0, 20.0]] * 3), 20,
                               torch.zeros(3, dtype=torch.bool))
    torch.testing.assert_close(same, images[:, :, :, :20], atol=1e-3, rtol=1e-5)
    flipped = ip.crop_resize_flip(images[:, :, :, :20], torch.tensor([[0.0, 0.0, 20.0, 20.0]] * 3), 20,
                                  torch.tensor([True, False, True]))
    torch.testing.assert_close(flipped[0], images[0, :, :, :20].flip(-1), atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(flipped[1], images[1, :, :, :20], atol=1e-3, rtol=1e-5)
    shrunk = ip.crop_resize_flip(images, whole, 10, torch.zeros(3, dtype=torch.bool))
    assert shrunk.shape == (3, 3, 10, 10)
    torch.testing.assert_close(shrunk.mean(dim=(2, 3)), images.mean(dim=(2, 3)), atol=3.0, rtol=0.05)
    with pytest.raises(ValueError, match="boxes"):
        ip.crop_resize_flip(images, whole[:2], 10, torch.zeros(3, dtype=torch.bool))


def test_gpu_decode_augment_on_cpu(jpegs):
    gen = torch.Generator().manual_seed(0)
    out = ip.gpu_decode_augment(jpegs[:4], size=48, device="cpu", generator=gen)
    assert out.shape == (4, 3, 48, 48) and out.dtype == torch.float32
    assert out.min() >= 0 and out.max() <= 255.0 + 1e-3


def test_decode_batch_bad_input(jpegs):
    with pytest.raises(ValueError, match="at least one"):
        ip.decode_batch([], "cpu")
    other = ip.synthetic_jpegs(1, height=64, width=64)[0]
    with pytest.raises(ValueError, match="different sizes"):
        ip.decode_batch([jpegs[0], other], "cpu")


def test_normalize():
    mean = torch.tensor(ip.IMAGENET_MEAN).view(1, 3, 1, 1) * 255
    out = ip.normalize(mean.expand(2, 3, 4, 4).to(torch.uint8), dtype=torch.bfloat16,
                       memory_format=torch.channels_last)
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last)
    assert out.float().abs().max() < 0.02  # the mean maps to 0 (uint8 rounding aside)
    with pytest.raises(ValueError, match="RGB"):
        ip.normalize(torch.zeros(2, 1, 4, 4))


@needs_cuda
def test_gpu_decode_matches_cpu_decode(jpegs):
    device = torch.device("cuda")
    on_gpu = ip.decode_batch(jpegs, device)
    on_cpu = ip.decode_batch(jpegs, "cpu")
    assert on_gpu.device.type == "cuda" and on_gpu.shape == on_cpu.shape
    # nvJPEG and libjpeg-turbo round the inverse DCT and upsample the chroma differently (libjpeg-turbo interpolates):
    # on an H200 (CUDA 13) the mean difference was 4.8 of 255 levels on these high-detail synthetic images. Another
    # image differs by far more, which the second assertion shows, so the bound still tells a wrong decode apart.
    difference = (on_gpu.cpu().float() - on_cpu.float()).abs().mean()
    assert difference < 8.0
    assert (on_gpu.cpu().float() - on_cpu.roll(1, dims=0).float()).abs().mean() > 4 * difference


@needs_cuda
def test_gpu_decode_augment_on_cuda_is_reproducible(jpegs):
    device = torch.device("cuda")
    first = ip.gpu_decode_augment(jpegs, size=64, device=device,
                                  generator=torch.Generator(device=device).manual_seed(3))
    second = ip.gpu_decode_augment(jpegs, size=64, device=device,
                                   generator=torch.Generator(device=device).manual_seed(3))
    assert first.device.type == "cuda" and first.shape == (6, 3, 64, 64)
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(ip.normalize(first).float().mean(), ip.normalize(first.cpu()).float().mean().to(device))


@needs_cuda
def test_loader_timing_feeds_pinned_batches_to_the_gpu(tmp_path, jpegs):
    data = ip.JpegFiles(ip.write_jpegs(jpegs, tmp_path), size=32)
    moved = []

    def to_gpu(batch):
        x, y = batch
        assert x.is_pinned()
        moved.append(ip.normalize(x.cuda(non_blocking=True)).shape)

    timing = ip.loader_timing(data, workers=2, batch_size=4, consume=to_gpu, pin_memory=True, min_run_time=0.05,
                              device="cuda")
    assert timing.median_s > 0 and moved and all(s == (4, 3, 32, 32) for s in moved)
    assert not multiprocessing.active_children(), "the worker processes should have ended"


# ── CPU use, workers that fit, the loader sweep's reading ─────────────────────────────────────────────────────


def test_cpu_use_reads_busy_cores_and_the_main_process(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 1 1 1 1 1 1 1\ncpu0 100 0 0 100 0 0 0 0\ncpu1 100 0 0 100 0 0 0 0\n")

    def work():  # between the two reads cpu0 is busy all the time, cpu1 half of it
        stat.write_text("cpu0 200 0 0 100 0 0 0 0\ncpu1 150 0 0 150 0 0 0 0\n")
        return 7

    result, use = ip.cpu_use(work, cpus=[0, 1], stat_path=stat)
    assert result == 7 and use.cores == 2 and use.busy_cores == pytest.approx(1.5)
    assert use.main_cores >= 0 and "1.5 of 2 busy" in str(use)
    _, unknown = ip.cpu_use(lambda: None, cpus=[0], stat_path=tmp_path / "missing")
    assert unknown.busy_cores is None and "not measurable" in str(unknown)
    zeros = tmp_path / "zeros"  # gVisor's /proc/stat: every CPU's line reads zeros
    zeros.write_text("cpu  0 0 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0\n")
    assert ip.cpu_use(lambda: None, cpus=[0], stat_path=zeros)[1].busy_cores is None


def test_cpu_use_counts_the_cpu_time_of_children_that_ended():
    import subprocess
    import sys

    def child():  # a child that spins for about 0.3 s of CPU, waited for
        subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                        "while time.process_time() - t < 0.3: pass"], check=True)

    _, use = ip.cpu_use(child, cpus=[0])
    assert use.children_cores is not None and use.children_cores > 0.1 and "the workers" in str(use)


def test_workers_that_fit_in_shared_memory():
    batch_bytes = 2 * 64 * 3 * 224 * 224  # two batches in flight per worker
    assert ip.workers_that_fit(16, 64, 224, shm_free=None) == 16
    assert ip.workers_that_fit(16, 64, 224, shm_free=2 * 3 * batch_bytes) == 3
    assert ip.workers_that_fit(16, 64, 224, shm_free=0) == 1  # never fewer than one


def _sweep(rates, use, physical_cores=None):
    from utils.bench import Timing

    timings = {n: Timing(f"{n}", 1 / r, 0.01 / r, (1.02 / r, 1 / r, 0.98 / r), 1, "cpu") for n, r in rates.items()}
    return ip.LoaderSweep(timings, use, batch_size=64, physical_cores=physical_cores)


def test_loader_sweep_names_the_measured_reason():
    rates = {1: 500.0, 2: 990.0, 4: 1200.0}
    busy = _sweep(rates, {n: ip.CpuUse(4, 3.9, 0.5) for n in rates})
    assert busy.per_worker == 500 and busy.best == 4 and busy.efficiency(2) == pytest.approx(0.99)
    assert busy.why_short(2).endswith("they scale")
    assert "the CPUs were busy (3.9 of 4 cores" in busy.why_short(4)
    main = _sweep(rates, {n: ip.CpuUse(16, 5.0, 0.97) for n in rates})
    assert "the main process was busy 97%" in main.why_short(4)
    neither = _sweep(rates, {n: ip.CpuUse(16, 5.0, 0.4) for n in rates})
    assert "is not measured here" in neither.why_short(4)
    assert [r["CPUs busy"] for r in neither.rows()] == ["5.0 of 16"] * 3
    assert [r["each worker busy"] for r in neither.rows()] == ["—"] * 3


def test_loader_sweep_reads_the_workers_cpu_time():
    rates = {1: 500.0, 2: 990.0, 4: 1200.0}
    # 4 workers busy all the time for 1,200 images/s: 3.3 ms of CPU per image against 2 ms for one worker
    dearer = _sweep(rates, {1: ip.CpuUse(16, None, 0.3, 1.0), 2: ip.CpuUse(16, None, 0.3, 2.0),
                            4: ip.CpuUse(16, None, 0.3, 4.0)})
    assert "each image took 1.67× the workers' CPU time it took at 1 worker" in dearer.why_short(4)
    assert "hyper-threads" in dearer.why_short(4), "the cores behind the CPUs unknown: hyper-threads may be a cause"
    assert "not rising with the count" not in dearer.why_short(4), "2 workers cost what 1 did: nothing to say"
    # 09's run on 16 cores without hyper-threads, the host shared: cheaper per image at 4 workers than at 1, dearer
    # at 8 — not a steady rise, and hyper-threads cannot be the cause
    bumpy = _sweep({1: 500.0, 4: 2100.0, 8: 2900.0}, {1: ip.CpuUse(16, None, 0.3, 1.0),
                                                      4: ip.CpuUse(16, None, 0.3, 3.4),
                                                      8: ip.CpuUse(16, None, 0.3, 7.2)}, physical_cores=16)
    text = bumpy.why_short(8)
    assert "each image took 1.24× the workers' CPU time it took at 1 worker, though at 4 workers it took 0.81×: " \
           "not rising with the count" in text, text
    assert "other processes on this host" in text and "hyper-threads" not in text
    assert [r["each worker busy"] for r in dearer.rows()] == ["100%"] * 3
    # 4 workers busy 60% of the time at 1.7 ms per image: they waited
    waited = _sweep(rates, {1: ip.CpuUse(16, None, 0.3, 1.0), 2: ip.CpuUse(16, None, 0.3, 2.0),
                            4: ip.CpuUse(16, None, 0.3, 2.4)})
    assert "each worker was busy only 60% of the time, so they waited" in waited.why_short(4)
    # neither the CPUs' use nor the workers' readable: no claim about the CPUs
    blind = _sweep(rates, {n: ip.CpuUse(16, None, 0.3) for n in rates})
    text = blind.why_short(4)
    assert "not measurable here" in text and "neither were the CPUs saturated" not in text


def test_loader_sweep_says_whether_it_keeps_up():
    rates = {1: 500.0, 2: 990.0, 4: 1200.0}
    sweep = _sweep(rates, {n: ip.CpuUse(16, 5.0, 0.4) for n in rates})
    assert "2 workers keep up with it, beyond the loader's noise" in sweep.summary(900)
    assert sweep.enough(900) == 2 and sweep.enough(5000) == 4
    assert "it trains 4.17× what the loader supplies" in sweep.summary(5000)
    with pytest.raises(ValueError):
        ip.loader_sweep(torch.utils.data.TensorDataset(torch.arange(4)), [], batch_size=1)


def test_loader_sweep_times_every_count_with_its_cpu_use():
    sweep = ip.loader_sweep(torch.utils.data.TensorDataset(torch.arange(8)), [1], batch_size=2, min_run_time=0.05,
                            device="cpu")
    assert sweep.counts == [1] and sweep.rate(1) > 0 and sweep.use[1].cores >= 1
    assert sweep.use[1].children_cores is not None and sweep.use[1].children_cores > 0  # its worker, waited for
