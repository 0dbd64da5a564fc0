"""Tests of utils.data: IDX parsing, the local → download → bundled-sample order, and the batching helpers."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import re
import socket
import threading
import time
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torchvision import transforms

from utils import data
from utils.data import DataError

STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file for a uint8 array: 0, 0, type 0x08, ndim, big-endian dims, data."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx(path: Path, array: np.ndarray, *, gz: bool = False) -> Path:
    raw = idx_bytes(array)
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def fake_mnist(n_train: int = 5, n_test: int = 3, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        split: (rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n, dtype=np.uint8))
        for split, n in (("train", n_train), ("test", n_test))
    }


def write_raw_dir(raw_dir: Path, arrays: dict, *, gz: bool) -> None:
    raw_dir.mkdir(parents=True, exist_ok=True)
    for split, (images_name, labels_name) in STEMS.items():
        images, labels = arrays[split]
        suffix = ".gz" if gz else ""
        write_idx(raw_dir / f"{images_name}{suffix}", images, gz=gz)
        write_idx(raw_dir / f"{labels_name}{suffix}", labels, gz=gz)


def assert_splits_equal(splits: data.MNISTSplits, arrays: dict) -> None:
    torch.testing.assert_close(splits.train_images, torch.from_numpy(arrays["train"][0]))
    torch.testing.assert_close(splits.train_labels, torch.from_numpy(arrays["train"][1]).long())
    torch.testing.assert_close(splits.test_images, torch.from_numpy(arrays["test"][0]))
    torch.testing.assert_close(splits.test_labels, torch.from_numpy(arrays["test"][1]).long())


@pytest.fixture
def online(monkeypatch):
    """Downloads allowed, whatever the environment running the tests says."""
    monkeypatch.delenv("COURSE_OFFLINE", raising=False)


@pytest.fixture
def http_dir(tmp_path):
    """A local HTTP server over a fresh folder: yields (folder, base URL)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    folder = tmp_path / "server"
    folder.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=folder))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


# ------------------------------------------------------------------------------------------------ parse_idx


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
def test_parse_idx_round_trip(tmp_path, gz):
    arrays = fake_mnist(n_train=3)
    images, labels = arrays["train"]
    parsed_images = data.parse_idx(write_idx(tmp_path / "images", images, gz=gz))
    parsed_labels = data.parse_idx(write_idx(tmp_path / "labels", labels, gz=gz))
    assert parsed_images.dtype == torch.uint8 and parsed_images.shape == (3, 28, 28)
    assert parsed_labels.dtype == torch.uint8 and parsed_labels.shape == (3,)
    assert torch.equal(parsed_images, torch.from_numpy(images))
    assert torch.equal(parsed_labels, torch.from_numpy(labels))


def test_parse_idx_agrees_with_torchvision_reader(tmp_path):
    from torchvision.datasets.mnist import read_image_file

    images = fake_mnist(n_train=4)["train"][0]
    path = write_idx(tmp_path / "images", images)
    assert torch.equal(data.parse_idx(path), read_image_file(str(path)))


def test_parse_idx_empty_dimension(tmp_path):
    parsed = data.parse_idx(write_idx(tmp_path / "none", np.zeros((0, 28, 28), np.uint8)))
    assert parsed.shape == (0, 28, 28) and parsed.dtype == torch.uint8


def _corruptions() -> dict[str, tuple[bytes, str]]:
    good = idx_bytes(np.arange(3 * 28 * 28, dtype=np.uint8).reshape(3, 28, 28) % 251)
    return {
        "truncated": (good[:-1], "holds"),
        "too long": (good + b"\x00", "holds"),
        "truncated header": (good[:9], "truncated IDX header"),
        "bad magic": (b"\x01" + good[1:], "bad magic"),
        "float32 type": (good[:2] + b"\x0d" + good[3:], "type code 0x0d"),
        "empty": (b"", "bad magic"),
        "truncated gzip": (gzip.compress(good)[:-20], "cannot read"),
    }


@pytest.mark.parametrize("kind", list(_corruptions()))
def test_parse_idx_rejects_corrupt_files(tmp_path, kind):
    content, what = _corruptions()[kind]
    path = tmp_path / "broken-idx3-ubyte"
    path.write_bytes(content)
    with pytest.raises(DataError, match=re.escape(str(path))) as info:
        data.parse_idx(path)
    assert what in str(info.value)
    assert "delete it" in str(info.value)


def test_parse_idx_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope-idx1-ubyte"):
        data.parse_idx(tmp_path / "nope-idx1-ubyte")


# ------------------------------------------------------------------------------------------ local copy


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
def test_load_mnist_uses_local_copy(tmp_path, capsys, gz):
    arrays = fake_mnist()
    write_raw_dir(tmp_path / "MNIST" / "raw", arrays, gz=gz)
    splits = data.load_mnist(tmp_path, download=False)
    assert splits.source == "local"
    assert splits.train_labels.dtype == torch.int64 and splits.train_images.dtype == torch.uint8
    assert_splits_equal(splits, arrays)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "local copy" in out and str(tmp_path) in out


def test_load_mnist_quiet(tmp_path, capsys):
    write_raw_dir(tmp_path / "MNIST" / "raw", fake_mnist(), gz=False)
    data.load_mnist(tmp_path, download=False, verbose=False)
    assert capsys.readouterr().out == ""


def test_corrupt_local_file_raises_instead_of_falling_back(tmp_path, online):
    raw = tmp_path / "MNIST" / "raw"
    write_raw_dir(raw, fake_mnist(), gz=False)
    bad = raw / "t10k-images-idx3-ubyte"
    bad.write_bytes(bad.read_bytes()[:-100])
    for download in (False, True):
        with pytest.raises(DataError, match=re.escape(str(bad))):
            data.load_mnist(tmp_path, download=download, timeout_s=1)


def test_local_labels_must_match_images(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    arrays = fake_mnist()
    arrays["train"] = (arrays["train"][0], arrays["train"][1][:-1])  # one label short
    write_raw_dir(raw, arrays, gz=False)
    with pytest.raises(DataError, match="train-labels-idx1-ubyte"):
        data.load_mnist(tmp_path, download=False)


# ---------------------------------------------------------------------------------------------- fallback


def test_offline_falls_back_to_bundled_sample(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COURSE_OFFLINE", "1")
    splits = data.load_mnist(tmp_path)
    assert splits.source == "bundled-sample"
    assert not (tmp_path / "MNIST").exists(), "COURSE_OFFLINE=1 must not start a download"
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert "COURSE_OFFLINE=1" in out and "bundled" in out and "4,000 train / 1,000 test" in out
    assert out.strip() == splits.note


def test_partial_local_copy_without_download_falls_back(tmp_path, capsys):
    raw = tmp_path / "MNIST" / "raw"
    write_raw_dir(raw, fake_mnist(), gz=False)
    (raw / "t10k-labels-idx1-ubyte").unlink()
    assert data.load_mnist(tmp_path, download=False).source == "bundled-sample"
    assert "download=False" in capsys.readouterr().out


def test_unreachable_mirror_falls_back_within_timeout(tmp_path, capsys, monkeypatch, online):
    monkeypatch.setattr(torchvision.datasets.MNIST, "mirrors", ["http://127.0.0.1:9/"])
    timeout_s = 3.0
    start = time.perf_counter()
    splits = data.load_mnist(tmp_path, timeout_s=timeout_s)
    elapsed = time.perf_counter() - start
    assert splits.source == "bundled-sample"
    assert elapsed < timeout_s + 1.0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "download failed" in out and "127.0.0.1:9" in out
    assert "urlopen error" in splits.note


@pytest.fixture
def slow_mirror():
    """Yield a factory: slow_mirror(kind) -> base URL of a local server that never finishes a response.

    "silent" accepts connections but never answers. "trickle" sends headers promising 1 MB, then one
    byte every 0.1 s for 5 s: every socket read succeeds in time, so only the overall deadline can stop it.
    """
    stop = threading.Event()
    servers = []

    def trickle(server: socket.socket) -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 1000000\r\n\r\n")
                give_up = (
                    time.monotonic() + 5
                )  # so that a broken deadline fails the test rather than hangs it
                while not stop.wait(0.1) and time.monotonic() < give_up:
                    conn.sendall(b"x")

    def make(kind: str) -> str:
        server = socket.create_server(("127.0.0.1", 0))
        servers.append(server)
        if kind == "trickle":
            threading.Thread(target=trickle, args=(server,), daemon=True).start()
        return f"http://127.0.0.1:{server.getsockname()[1]}/"

    yield make
    stop.set()
    time.sleep(0.15)
    for server in servers:
        server.close()


@pytest.mark.parametrize("kind", ["silent", "trickle"])
def test_slow_mirror_gives_up_at_the_deadline(tmp_path, capsys, monkeypatch, online, slow_mirror, kind):
    monkeypatch.setattr(torchvision.datasets.MNIST, "mirrors", [slow_mirror(kind)])
    timeout_s = 1.0
    start = time.perf_counter()
    splits = data.load_mnist(tmp_path, timeout_s=timeout_s)
    elapsed = time.perf_counter() - start
    assert splits.source == "bundled-sample"
    assert timeout_s - 0.1 < elapsed < timeout_s + 1.0
    # Either the deadline or the socket timeout (set to the time left) fires first; both say so.
    assert "download failed" in (out := capsys.readouterr().out) and "timed out" in out
    assert not list((tmp_path / "MNIST" / "raw").glob("*.gz")), "a timed-out download must not leave files"


def _serve_fake_mnist(folder: Path, arrays: dict) -> list[tuple[str, str]]:
    """Put gzipped IDX files into folder; return a torchvision-style (filename, md5) resource list."""
    resources = []
    for split, stems in STEMS.items():
        for stem, array in zip(stems, arrays[split], strict=True):
            blob = gzip.compress(idx_bytes(array))
            (folder / f"{stem}.gz").write_bytes(blob)
            resources.append((f"{stem}.gz", hashlib.md5(blob).hexdigest()))
    return resources


def test_download_from_second_mirror_torchvision_can_read_it(tmp_path, capsys, monkeypatch, http_dir, online):
    folder, url = http_dir
    arrays = fake_mnist()
    resources = _serve_fake_mnist(folder, arrays)
    monkeypatch.setattr(torchvision.datasets.MNIST, "resources", resources)
    monkeypatch.setattr(torchvision.datasets.MNIST, "mirrors", ["http://127.0.0.1:9/", url])
    root = tmp_path / "root"
    splits = data.load_mnist(root, timeout_s=5)
    assert splits.source == "download"
    assert "downloaded" in capsys.readouterr().out
    assert_splits_equal(splits, arrays)
    raw = root / "MNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(
        [name for name, _ in resources] + [name.removesuffix(".gz") for name, _ in resources]
    )
    tv = torchvision.datasets.MNIST(root, train=True, download=False)
    assert torch.equal(tv.data, splits.train_images) and torch.equal(tv.targets, splits.train_labels)
    # The second call finds the local copy.
    assert data.load_mnist(root, verbose=False).source == "local"


def test_download_with_wrong_md5_falls_back(tmp_path, capsys, monkeypatch, http_dir, online):
    folder, url = http_dir
    resources = _serve_fake_mnist(folder, fake_mnist())
    resources[0] = (resources[0][0], "0" * 32)
    monkeypatch.setattr(torchvision.datasets.MNIST, "resources", resources)
    monkeypatch.setattr(torchvision.datasets.MNIST, "mirrors", [url])
    assert data.load_mnist(tmp_path, timeout_s=5).source == "bundled-sample"
    assert "md5" in capsys.readouterr().out
    assert not (tmp_path / "MNIST" / "raw" / resources[0][0]).exists()
    assert not list((tmp_path / "MNIST" / "raw").glob("*.part"))


# ------------------------------------------------------------------------------------------ bundled sample


def test_bundled_sample():
    splits = data.load_bundled_sample()
    assert splits.source == "bundled-sample"
    for images, labels, per_class in (
        (splits.train_images, splits.train_labels, 400),
        (splits.test_images, splits.test_labels, 100),
    ):
        assert images.dtype == torch.uint8 and images.shape == (10 * per_class, 28, 28)
        assert labels.dtype == torch.int64 and labels.shape == (10 * per_class,)
        assert labels.bincount(minlength=10).tolist() == [per_class] * 10
        assert int(images.min()) == 0 and int(images.max()) == 255
        assert (images.flatten(1).amax(1) > 0).all(), "every digit has some ink"
        assert 0.08 < images.float().mean().item() / 255 < 0.2  # MNIST's mean is about 0.13
    assert "4,000 train / 1,000 test" in splits.note and "real MNIST" in splits.note
    assert str(splits) == "MNIST (bundled-sample): 4,000 train / 1,000 test images of 28x28 uint8"
    assert "tensor" not in repr(splits)


def test_bundled_sample_split_rule():
    """For each class, the first 400 digits of the file are train and the last 100 test."""
    with np.load(data.BUNDLED_SAMPLE) as npz:
        images, labels = npz["images"], npz["labels"]
    splits = data.load_bundled_sample()
    for digit in (0, 7):
        of_class = torch.from_numpy(images[labels == digit])
        assert torch.equal(splits.train_images[splits.train_labels == digit], of_class[:400])
        assert torch.equal(splits.test_images[splits.test_labels == digit], of_class[400:])


def test_corrupt_npz_raises(tmp_path):
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"PK\x03\x04 this is not a zip file")
    wrong_shape = tmp_path / "wrong_shape.npz"
    np.savez(wrong_shape, images=np.zeros((10, 28, 28), np.uint8), labels=np.zeros(10, np.uint8))
    no_labels = tmp_path / "no_labels.npz"
    np.savez(no_labels, images=np.zeros((5000, 28, 28), np.uint8))
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, images=np.array([object()], dtype=object), labels=np.zeros(1, np.uint8))
    bad_labels = tmp_path / "bad_labels.npz"
    np.savez(bad_labels, images=np.zeros((5000, 28, 28), np.uint8), labels=np.full(5000, 12, np.uint8))
    for path in (garbage, wrong_shape, no_labels, pickled, bad_labels, tmp_path / "missing.npz"):
        with pytest.raises(DataError, match=re.escape(str(path))):
            data.load_bundled_sample(path)


# -------------------------------------------------------------------------------- two ways to feed a model


@pytest.fixture(scope="module")
def sample_images() -> tuple[torch.Tensor, torch.Tensor]:
    splits = data.load_bundled_sample()
    return splits.train_images[::397], splits.train_labels[::397]  # a few digits of every class


def test_dataset_matches_torchvision_transforms(sample_images):
    images, labels = sample_images
    reference = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    dataset = data.MNISTDataset(images, labels)
    assert len(dataset) == len(images)
    for i in range(len(dataset)):
        x, y = dataset[i]
        expected = reference(Image.fromarray(images[i].numpy(), mode="L"))
        assert x.dtype == torch.float32 and x.shape == (1, 28, 28)
        torch.testing.assert_close(x, expected)
        assert y == int(labels[i])


def test_normalize_images_matches_dataset(sample_images):
    images, labels = sample_images
    dataset = data.MNISTDataset(images, labels)
    expected = torch.stack([dataset[i][0] for i in range(len(dataset))])
    for device in (None, "cpu"):
        x = data.normalize_images(images, device=device)
        assert x.dtype == torch.float32 and x.shape == (len(images), 1, 28, 28)
        torch.testing.assert_close(x, expected)
    assert abs(data.normalize_images(data.load_bundled_sample().train_images).mean().item()) < 0.1
    with pytest.raises(ValueError):
        data.normalize_images(images.float())


def test_dataset_works_with_dataloader(sample_images):
    loader = torch.utils.data.DataLoader(data.MNISTDataset(*sample_images), batch_size=4)
    xb, yb = next(iter(loader))
    assert xb.shape == (4, 1, 28, 28) and yb.dtype == torch.int64


def _epoch(n: int, batch_size: int, **kwargs) -> tuple[list[int], torch.Tensor]:
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)  # row i holds i, so batches reveal indices
    y = torch.arange(n) * 10
    sizes, seen = [], []
    for xb, yb in data.device_batches(x, y, batch_size, **kwargs):
        assert torch.equal(yb, xb.squeeze(1).long() * 10), "x and y must stay paired"
        sizes.append(len(xb))
        seen.append(yb // 10)
    return sizes, torch.cat(seen)


def test_device_batches_cover_every_index_once():
    sizes, seen = _epoch(10, 3)
    assert sizes == [3, 3, 3, 1]
    assert sorted(seen.tolist()) == list(range(10))
    _, seen = _epoch(100, 7)
    assert sorted(seen.tolist()) == list(range(100)) and seen.tolist() != list(range(100))


def test_device_batches_drop_last_and_order():
    sizes, seen = _epoch(10, 3, drop_last=True)
    assert sizes == [3, 3, 3] and len(set(seen.tolist())) == 9
    sizes, seen = _epoch(10, 3, shuffle=False)
    assert sizes == [3, 3, 3, 1] and seen.tolist() == list(range(10))
    assert _epoch(9, 3, drop_last=True)[0] == [3, 3, 3]


def test_device_batches_generator_is_reproducible():
    first = _epoch(50, 8, generator=torch.Generator().manual_seed(1))[1]
    again = _epoch(50, 8, generator=torch.Generator().manual_seed(1))[1]
    other = _epoch(50, 8, generator=torch.Generator().manual_seed(2))[1]
    assert torch.equal(first, again) and not torch.equal(first, other)


@pytest.mark.parametrize(
    "x, y, batch_size",
    [
        (torch.zeros(4), torch.zeros(4), 0),
        (torch.zeros(4), torch.zeros(4), -2),
        (torch.zeros(4), torch.zeros(4), 2.5),
        (torch.zeros(4), torch.zeros(3), 2),
        (torch.zeros(4), torch.zeros(4, device="meta"), 2),
    ],
    ids=["zero", "negative", "float", "length mismatch", "device mismatch"],
)
def test_device_batches_bad_args_raise_at_call(x, y, batch_size):
    with pytest.raises(ValueError):
        data.device_batches(x, y, batch_size)  # not iterated: the check must be eager


# ------------------------------------------------------------------------------------------ synthetic data


def test_synthetic_tokens():
    inputs, targets = data.synthetic_tokens(4, 16, 50, generator=torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (4, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert not torch.equal(targets, inputs)
    assert int(inputs.min()) >= 0 and int(inputs.max()) < 50 and inputs.count_nonzero() > 0
    assert targets.is_contiguous() and targets.view(-1).shape == (64,)
    again, _ = data.synthetic_tokens(4, 16, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(inputs, again)
    with pytest.raises(ValueError):
        data.synthetic_tokens(4, 16, 1)


def test_synthetic_images():
    x, y = data.synthetic_images(8, channels=3, size=32, num_classes=5)
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32
    assert y.shape == (8,) and y.dtype == torch.int64
    assert int(y.min()) >= 0 and int(y.max()) < 5
    assert x.std().item() > 0.5


def test_seeded_loader_order_depends_on_the_seed_alone(sample_images):
    images, labels = sample_images
    dataset = data.MNISTDataset(images, labels)
    a = [y.tolist() for _, y in data.seeded_loader(dataset, 16)]
    b = [y.tolist() for _, y in data.seeded_loader(dataset, 16, num_workers=2)]  # workers: the same order
    other = [y.tolist() for _, y in data.seeded_loader(dataset, 16, seed=1)]
    assert a == b and a != other
    loader = data.seeded_loader(dataset, 16)
    first, second = [y.tolist() for _, y in loader], [y.tolist() for _, y in loader]
    assert first == a and second != first  # every epoch draws the next permutation


def test_drain_produces_and_copies_every_batch(sample_images):
    images, labels = sample_images
    loader = data.seeded_loader(data.MNISTDataset(images, labels), 16)
    assert data.drain(loader, "cpu") == len(loader)


def test_offline_download_says_no_network_in_a_few_words(tmp_path, capsys, monkeypatch):
    """Every mirror's name failing to resolve is one short reason, not one DNS error per mirror and file."""
    monkeypatch.setattr(torchvision.datasets.MNIST, "mirrors", ["http://mirror-a.invalid/", "http://mirror-b.invalid/"])

    def unresolved(url, *args, **kwargs):
        raise urllib.error.URLError(socket.gaierror(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(data, "_fetch", unresolved)
    assert data.load_mnist(tmp_path, timeout_s=5).source == "bundled-sample"
    out = capsys.readouterr().out
    assert "no network (no mirror's name resolved: mirror-a.invalid, mirror-b.invalid)" in out
    assert "urlopen" not in out
