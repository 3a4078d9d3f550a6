"""MNIST for the ensemble benchmarks: IDX files from a data directory, a verified download, or a
labelled synthetic stand-in.

Where the IDX files are absent and cannot be fetched (machines that reach no dataset host), the
benchmarks still run on a synthetic MNIST-shaped set; every result then carries ``data=synthetic``
(`MNISTData.describe()`), and a warning says so. Files that are present but corrupt, truncated or
mismatched are refused with `MNISTDataError`: a benchmark never trains on half a dataset.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import tempfile
import urllib.error
import urllib.request
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

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


class MNISTDataError(ValueError):
    """An IDX file is corrupt, truncated or does not match its partner, or a download failed
    verification."""


@dataclass(frozen=True)
class MNISTData:
    """One split: ``images`` uint8 (N, 28, 28), ``labels`` uint8 (N,), and where they came from."""

    images: np.ndarray
    labels: np.ndarray
    source: str  # "mnist" or "synthetic"
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
        """The split as a list of ``(image_tensor, label)`` tuples, the way many training scripts
        hold a dataset: a long-lived heap of GC-tracked objects that every full collection walks."""
        import torch

        n = len(self) if count is None else count
        if not 0 <= n <= len(self):
            raise ValueError(f"count must be in 0..{len(self)}, got {count}")
        return [(torch.from_numpy(self.images[i]), int(self.labels[i])) for i in range(n)]


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


def load_mnist(
    data_dir: str | Path | None = None,
    split: str = "train",
    *,
    download: bool = True,
    allow_synthetic: bool = True,
    synthetic_n: int | None = None,
    seed: int = 0,
    mirrors: tuple[str, ...] = MNIST_MIRRORS,
    checksums: dict[str, str] | None = None,
    fetch: Callable[[str], bytes] = fetch_url,
) -> MNISTData:
    """The split from ``data_dir`` (default `default_data_dir()`), downloading it if absent and
    ``download``; if it is still absent and ``allow_synthetic``, a synthetic set with a warning.

    Present-but-broken files always raise `MNISTDataError`; they never fall back to synthetic.
    """
    if split not in MNIST_FILES:
        raise ValueError(f"split must be one of {sorted(MNIST_FILES)}, got {split!r}")
    data_dir = Path(data_dir).expanduser() if data_dir else default_data_dir()
    stems = MNIST_FILES[split]
    paths = [_find_file(data_dir, stem) for stem in stems]
    missing = [f"{stem}[.gz]" for stem, path in zip(stems, paths) if path is None]
    present = [path.name for path in paths if path is not None]
    reason = f"no {' and '.join(missing)} in {data_dir}" + (f" (found {', '.join(present)})" if present else "")
    if None in paths and download:
        try:
            download_mnist(data_dir, split, mirrors=mirrors, checksums=checksums, fetch=fetch)
            paths = [_find_file(data_dir, stem) for stem in stems]
        except OSError as exc:  # unreachable mirrors; a checksum mismatch raises MNISTDataError
            reason += f", and the download failed: {exc}"
    if None not in paths:
        images, labels = _read_split(*paths)
        return MNISTData(images, labels, "mnist", split, str(data_dir))
    if not allow_synthetic:
        raise FileNotFoundError(reason + f"; put the IDX files there or set {ENV_DATA_DIR}")
    n = synthetic_n if synthetic_n is not None else SYNTHETIC_SIZES[split]
    warnings.warn(
        f"MNIST not available ({reason}); using a SYNTHETIC MNIST-shaped dataset of {n} samples. "
        "Every result is labelled data=synthetic.",
        stacklevel=2,
    )
    return synthetic_mnist(n, seed=seed, split=split)
