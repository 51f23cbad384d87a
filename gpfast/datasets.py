"""Benchmark data: the UCI regression sets with their fixed splits, and synthetic data of any size.

The UCI sets are those of the large-scale exact-GP literature (Wang et al. 2019, "Exact Gaussian Processes on a
Million Data Points") as prepared by the public ``uci_datasets`` collection (MIT licence,
https://github.com/treforevans/uci_datasets). Each set is a folder ``<name>/`` holding

* ``data.csv.gz``: one row per observation, no header, the inputs first and the target in the last column;
* ``test_mask.csv.gz``: ten columns of 0/1, one per train/test split (1 = test row, about 10% of the rows).

Where the sets are looked for (see :func:`resolve_data_dir` and :func:`find_dataset`):

1. the ``data_dir`` argument (the ``--data-dir`` option of the command line), else
2. the ``GPFAST_DATA`` environment variable, else
3. the user cache folder ``$XDG_CACHE_HOME/gpfast/uci`` (``~/.cache/gpfast/uci`` by default), which is where
   :func:`download` puts them;

and, failing all of these, the small sets of :data:`SHIPPED`, which are copied inside the package so that it works
offline with no data folder at all.

Examples
--------
>>> from gpfast import datasets
>>> ds = datasets.load_uci("yacht", split=0)
>>> ds.X_train.shape, ds.y_train.shape
((278, 6), (278,))
>>> X, y = datasets.synthetic(100_000, 4, noise=0.1, seed=0)
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpfast.standardize import column_stats

__all__ = [
    "DEFAULT_BASE_URL",
    "LARGE_UCI_NAMES",
    "N_SPLITS",
    "SHA256_FILE",
    "SHIPPED",
    "UCI_NAMES",
    "UCI_SIZES",
    "Dataset",
    "available",
    "download",
    "find_dataset",
    "load_uci",
    "resolve_data_dir",
    "synthetic",
    "synthetic_split",
]

DEFAULT_BASE_URL = "https://github.com/treforevans/uci_datasets/raw/master/uci_datasets"
"""Where :func:`download` fetches ``<base>/<name>/data.csv.gz`` and ``<base>/<name>/test_mask.csv.gz`` from."""

SHA256_FILE = Path(__file__).resolve().parent / "data" / "uci_datasets.sha256"
"""SHA-256 of every file :func:`download` fetches, in ``sha256sum`` format (check a copy with ``sha256sum -c``)."""

UCI_SIZES: dict[str, tuple[int, int]] = {
    # name: (rows, inputs), smallest first, as listed by the uci_datasets collection.
    "challenger": (23, 4),
    "fertility": (100, 9),
    "concreteslump": (103, 7),
    "autos": (159, 25),
    "servo": (167, 4),
    "breastcancer": (194, 33),
    "machine": (209, 7),
    "yacht": (308, 6),
    "autompg": (392, 7),
    "housing": (506, 13),
    "forest": (517, 12),
    "stock": (536, 11),
    "pendulum": (630, 9),
    "energy": (768, 8),
    "concrete": (1030, 8),
    "solar": (1066, 10),
    "airfoil": (1503, 5),
    "wine": (1599, 11),
    "gas": (2565, 128),
    "skillcraft": (3338, 19),
    "sml": (4137, 26),
    "parkinsons": (5875, 20),
    "pumadyn32nm": (8192, 32),
    "pol": (15000, 26),
    "elevators": (16599, 18),
    "bike": (17379, 17),
    "kin40k": (40000, 8),
    "protein": (45730, 9),
    "tamielectric": (45781, 3),
    "keggdirected": (48827, 20),
    "slice": (53500, 385),
    "keggundirected": (63608, 27),
    "3droad": (434874, 3),
    "song": (515345, 90),
    "buzz": (583250, 77),
    "houseelectric": (2049280, 11),
}
"""``(rows, inputs)`` of every set of the ``uci_datasets`` collection."""

UCI_NAMES: tuple[str, ...] = tuple(UCI_SIZES)
"""Names of all known UCI sets, smallest first."""

LARGE_UCI_NAMES: tuple[str, ...] = ("slice", "3droad", "song", "buzz", "houseelectric")
"""Known sets that :func:`download` skips unless they are asked for by name (large, or wide, files)."""

SHIPPED: tuple[str, ...] = ("yacht", "energy", "concrete")
"""Small sets copied inside the package (``gpfast/data/<name>/``), usable with no data folder."""

N_SPLITS = 10
"""Number of fixed train/test splits of every UCI set (columns of ``test_mask.csv.gz``)."""

DATA_FILE = "data.csv.gz"
MASK_FILE = "test_mask.csv.gz"
ENV_VAR = "GPFAST_DATA"

# Sets whose data are split over several files in the collection (GitHub's file-size limit).
_EXTRA_PARTS: dict[str, tuple[str, ...]] = {"song": ("data1.csv.gz",)}

_SHIPPED_DIR = Path(__file__).resolve().parent / "data"

_CHUNK_ROWS = 1 << 16  # rows per block when generating or standardising large arrays


# ----------------------------------------------------------------------------------------------------------------
# Dataset container
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False, repr=False)
class Dataset:
    """One train/test split of a regression data set.

    Attributes
    ----------
    name : str
        Name of the set (``"yacht"``, ``"synthetic"``, ...).
    split : int
        Index of the train/test split, in ``0 .. N_SPLITS - 1``.
    X_train : numpy.ndarray, shape (n_train, d)
        Training inputs (standardised with the training statistics unless loaded with ``standardize=False``).
    y_train : numpy.ndarray, shape (n_train,)
        Training targets.
    X_test : numpy.ndarray, shape (n_test, d)
        Test inputs, transformed with the *training* statistics.
    y_test : numpy.ndarray, shape (n_test,)
        Test targets, transformed with the *training* statistics.
    x_mean, x_std : numpy.ndarray, shape (d,)
        Per-column statistics that were applied: ``X = (X_raw - x_mean) / x_std``. The std of a constant column is
        set to 1. Zeros and ones when the data were not standardised.
    y_mean, y_std : float
        Target statistics that were applied: ``y = (y_raw - y_mean) / y_std``. 0 and 1 when not standardised.
    """

    name: str
    split: int
    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    x_mean: np.ndarray
    x_std: np.ndarray
    y_mean: float
    y_std: float

    @property
    def n_train(self) -> int:
        """Number of training rows."""
        return int(self.X_train.shape[0])

    @property
    def n_test(self) -> int:
        """Number of test rows."""
        return int(self.X_test.shape[0])

    @property
    def d(self) -> int:
        """Number of input columns."""
        return int(self.X_train.shape[1])

    def standardize_x(self, X: np.ndarray) -> np.ndarray:
        """Transform raw inputs with the training statistics.

        Parameters
        ----------
        X : array_like, shape (m, d)
            Inputs on the original scale.

        Returns
        -------
        numpy.ndarray, shape (m, d)
            ``(X - x_mean) / x_std``, in the dtype of ``X_train``.
        """
        X = np.asarray(X)
        return ((X - self.x_mean) / self.x_std).astype(self.X_train.dtype, copy=False)

    def unstandardize_y(self, y: np.ndarray) -> np.ndarray:
        """Map targets (or predictive means) back to the original scale.

        Parameters
        ----------
        y : array_like, shape (m,) or any shape
            Values on the standardised scale.

        Returns
        -------
        numpy.ndarray, same shape as ``y``
            ``y * y_std + y_mean``.
        """
        return np.asarray(y) * self.y_std + self.y_mean

    def unstandardize_std(self, std: np.ndarray) -> np.ndarray:
        """Map predictive standard deviations (or RMSEs) back to the original scale.

        Parameters
        ----------
        std : array_like, any shape
            Standard deviations on the standardised scale.

        Returns
        -------
        numpy.ndarray, same shape as ``std``
            ``std * y_std`` (a variance scales by ``y_std ** 2``).
        """
        return np.asarray(std) * self.y_std

    def __repr__(self) -> str:
        return (
            f"Dataset(name={self.name!r}, split={self.split}, n_train={self.n_train}, n_test={self.n_test}, "
            f"d={self.d}, dtype={self.X_train.dtype})"
        )


# ----------------------------------------------------------------------------------------------------------------
# Where the data live
# ----------------------------------------------------------------------------------------------------------------


def _default_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "gpfast" / "uci"


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Folder that holds (or will hold) the UCI sets, one sub-folder per set.

    Parameters
    ----------
    data_dir : str or os.PathLike, optional
        Explicit folder; wins over everything else.

    Returns
    -------
    pathlib.Path
        ``data_dir`` if given, else ``$GPFAST_DATA`` if set and non-empty, else the user cache folder
        ``$XDG_CACHE_HOME/gpfast/uci`` (``~/.cache/gpfast/uci`` when ``XDG_CACHE_HOME`` is unset). The folder need
        not exist; ``~`` is expanded.
    """
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir).expanduser()
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return Path(env).expanduser()
    return _default_cache_dir()


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"dataset name must be a plain folder name such as 'yacht', got {name!r}")
    return name


def _candidates(name: str, data_dir: str | os.PathLike | None) -> list[Path]:
    root = resolve_data_dir(data_dir)
    # Also accept a folder one level up (e.g. ``datasets/`` holding ``uci/<name>``).
    return [root / name, root / "uci" / name, _SHIPPED_DIR / name]


def find_dataset(name: str, data_dir: str | os.PathLike | None = None) -> Path:
    """Locate the folder of one set.

    Looks for ``<dir>/<name>/data.csv.gz`` in the folder given by :func:`resolve_data_dir` (also in its ``uci/``
    sub-folder), then in the copy shipped with the package.

    Parameters
    ----------
    name : str
        Name of the set, e.g. ``"pol"``.
    data_dir : str or os.PathLike, optional
        Folder to look in first; defaults to ``$GPFAST_DATA``, then the user cache folder.

    Returns
    -------
    pathlib.Path
        The set's own folder, i.e. the one holding ``data.csv.gz`` and ``test_mask.csv.gz``.

    Raises
    ------
    ValueError
        If ``name`` is not found and is not one of :data:`UCI_NAMES` (the message lists the known names).
    FileNotFoundError
        If ``name`` is a known set but is found nowhere; the message lists every folder searched and how to fix it.
    """
    _check_name(name)
    searched = _candidates(name, data_dir)
    for folder in searched:
        if (folder / DATA_FILE).is_file():
            return folder
    if name not in UCI_SIZES:
        raise ValueError(f"unknown dataset {name!r} (not found on disk either); known names: {', '.join(UCI_NAMES)}")
    where = "\n".join(f"  {folder}" for folder in searched)
    raise FileNotFoundError(
        f"dataset {name!r} not found: no {DATA_FILE} in any of\n{where}\n"
        f"Fix: pass --data-dir (data_dir=...) pointing at a folder holding {name}/{DATA_FILE}, "
        f"set the {ENV_VAR} environment variable to such a folder, "
        f"or fetch it with gpfast.datasets.download(names=[{name!r}]) (puts it in {resolve_data_dir(data_dir)})."
    )


def available(data_dir: str | os.PathLike | None = None) -> list[str]:
    """Names of the sets that :func:`load_uci` can load right now.

    Parameters
    ----------
    data_dir : str or os.PathLike, optional
        As for :func:`find_dataset`.

    Returns
    -------
    list of str
        Sorted names of the sub-folders holding a ``data.csv.gz`` in the resolved folder, its ``uci/`` sub-folder or
        the shipped copy.
    """
    root = resolve_data_dir(data_dir)
    names = set()
    for base in (root, root / "uci", _SHIPPED_DIR):
        if base.is_dir():
            names.update(p.parent.name for p in base.glob(f"*/{DATA_FILE}"))
    return sorted(names)


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------


def _check_split(split: int) -> int:
    if isinstance(split, bool) or not isinstance(split, (int, np.integer)):
        raise TypeError(f"split must be an integer in 0..{N_SPLITS - 1}, got {split!r} of type {type(split).__name__}")
    if not 0 <= split < N_SPLITS:
        raise ValueError(f"split must be in 0..{N_SPLITS - 1} (there are {N_SPLITS} fixed splits), got {split}")
    return int(split)


def _read_csv(path: Path, dtype) -> np.ndarray:
    return np.loadtxt(path, delimiter=",", dtype=dtype, ndmin=2)


def _standardize_inplace(A: np.ndarray, mean: np.ndarray, std: np.ndarray) -> None:
    m = mean.astype(A.dtype)
    s = std.astype(A.dtype)
    for i in range(0, A.shape[0], _CHUNK_ROWS):
        block = A[i : i + _CHUNK_ROWS]
        block -= m
        block /= s


def _make_dataset(name: str, split: int, X_train, y_train, X_test, y_test, standardize: bool, dtype) -> Dataset:
    """Cast to ``dtype`` and (optionally) standardise with training statistics; inputs may be modified in place."""
    dtype = np.dtype(dtype)
    X_train = np.ascontiguousarray(X_train, dtype=dtype)
    X_test = np.ascontiguousarray(X_test, dtype=dtype)
    Y = np.ascontiguousarray(np.asarray(y_train).reshape(-1, 1), dtype=dtype)
    Yt = np.ascontiguousarray(np.asarray(y_test).reshape(-1, 1), dtype=dtype)
    d = X_train.shape[1]
    if standardize:
        x_mean, x_std = (t.numpy() for t in column_stats(X_train)[:2])
        y_mean, y_std = (t.numpy() for t in column_stats(Y)[:2])
        for A, (m, s) in (
            (X_train, (x_mean, x_std)),
            (X_test, (x_mean, x_std)),
            (Y, (y_mean, y_std)),
            (Yt, (y_mean, y_std)),
        ):
            _standardize_inplace(A, m, s)
    else:
        x_mean, x_std = np.zeros(d), np.ones(d)
        y_mean, y_std = np.zeros(1), np.ones(1)
    return Dataset(
        name=name,
        split=split,
        X_train=X_train,
        y_train=Y.reshape(-1),
        X_test=X_test,
        y_test=Yt.reshape(-1),
        x_mean=x_mean.astype(dtype),
        x_std=x_std.astype(dtype),
        y_mean=float(y_mean[0]),
        y_std=float(y_std[0]),
    )


def load_uci(
    name: str,
    split: int = 0,
    data_dir: str | os.PathLike | None = None,
    standardize: bool = True,
    dtype=np.float64,
) -> Dataset:
    """Load one fixed train/test split of a UCI regression set.

    Parameters
    ----------
    name : str
        Name of the set, one of :data:`UCI_NAMES` (or any folder name present in the data folder).
    split : int, default 0
        Which of the ten fixed splits, ``0 <= split <= 9``. Test rows are those with a 1 in column ``split`` of
        ``test_mask.csv.gz``.
    data_dir : str or os.PathLike, optional
        Folder holding ``<name>/data.csv.gz``; see :func:`find_dataset` for the search order.
    standardize : bool, default True
        Shift and scale every input column and the target to zero mean and unit std using the *training* rows'
        statistics only (the test rows use the same statistics). The std of a constant column is taken as 1.
    dtype : numpy dtype, default numpy.float64
        Dtype of the returned arrays (statistics are computed in float64).

    Returns
    -------
    Dataset
        ``X_train`` (n_train, d), ``y_train`` (n_train,), ``X_test`` (n_test, d), ``y_test`` (n_test,) and the
        statistics applied.

    Raises
    ------
    TypeError, ValueError
        Bad ``split``, unknown ``name``, or malformed files.
    FileNotFoundError
        The set is not found anywhere (see :func:`find_dataset`) or its ``test_mask.csv.gz`` is missing.
    """
    split = _check_split(split)
    folder = find_dataset(name, data_dir)
    data = _read_csv(folder / DATA_FILE, np.float64)
    for extra in _EXTRA_PARTS.get(name, ()):
        if (folder / extra).is_file():
            data = np.concatenate([data, _read_csv(folder / extra, np.float64)], axis=0)
    mask_path = folder / MASK_FILE
    if not mask_path.is_file():
        raise FileNotFoundError(f"dataset {name!r}: {mask_path} is missing (found {folder / DATA_FILE})")
    mask = _read_csv(mask_path, np.float64)
    if data.shape[1] < 2:
        raise ValueError(f"{folder / DATA_FILE}: expected at least 2 columns (inputs then target), got {data.shape[1]}")
    if mask.shape != (data.shape[0], N_SPLITS):
        raise ValueError(
            f"{mask_path}: expected shape ({data.shape[0]}, {N_SPLITS}) to match {DATA_FILE}, got {mask.shape}"
        )
    test = mask[:, split] == 1
    X, y = data[:, :-1], data[:, -1]
    return _make_dataset(name, split, X[~test], y[~test], X[test], y[test], standardize, dtype)


# ----------------------------------------------------------------------------------------------------------------
# Synthetic data
# ----------------------------------------------------------------------------------------------------------------


def _synthetic_function(d: int, lengthscale: float, seed_seq: np.random.SeedSequence):
    """Parameters of f(x) = (sum_k a_k sin(w_k . x + b_k) - mu) / sigma, with E f = 0 and Var f = 1 for x ~ N(0, I)."""
    rng = np.random.default_rng(seed_seq)
    K = max(d, 16)
    W = rng.standard_normal((K, d)) / lengthscale
    b = rng.uniform(0.0, 2.0 * np.pi, K)
    a = rng.standard_normal(K)
    # Exact moments under x ~ N(0, I): for g ~ N(m, s^2), E cos g = cos(m) exp(-s^2 / 2).
    sq = np.sum(W * W, axis=1)
    m = np.exp(-0.5 * sq) * np.sin(b)  # E sin(w_k . x + b_k)
    diff = np.sum((W[:, None, :] - W[None, :, :]) ** 2, axis=-1)
    summ = np.sum((W[:, None, :] + W[None, :, :]) ** 2, axis=-1)
    second = 0.5 * (
        np.exp(-0.5 * diff) * np.cos(b[:, None] - b[None, :]) - np.exp(-0.5 * summ) * np.cos(b[:, None] + b[None, :])
    )
    cov = second - np.outer(m, m)
    mu = float(a @ m)
    sigma = float(np.sqrt(max(a @ cov @ a, 1e-12)))
    return W, b, a / sigma, mu / sigma


def synthetic(
    n: int,
    d: int,
    noise: float = 0.1,
    seed: int = 0,
    dtype=np.float32,
    lengthscale: float = 1.5,
) -> tuple[np.ndarray, np.ndarray]:
    """Draw a synthetic regression set of any size.

    ``X ~ N(0, I)`` and ``y = f(X) + noise * eps`` with ``eps ~ N(0, 1)``, where ``f`` is a smooth random function,
    a sum of ``max(d, 16)`` random Fourier features ``a_k sin(w_k . x + b_k)`` with ``w_k ~ N(0, I / lengthscale^2)``,
    shifted and scaled so that ``E f = 0`` and ``Var f = 1`` exactly (over ``x ~ N(0, I)``). The same ``seed`` gives
    the same ``f`` for every ``n``, and the first ``m`` rows for ``n`` are the rows for ``m < n`` (nested sizes).

    Generated in blocks of rows: memory is the output (``n * (d + 1)`` values of ``dtype``) plus a small block.

    Parameters
    ----------
    n : int
        Number of rows.
    d : int
        Number of input columns.
    noise : float, default 0.1
        Std of the Gaussian observation noise (the signal has std 1).
    seed : int, default 0
        Seed; the result is deterministic given ``(n, d, noise, seed, lengthscale)``.
    dtype : numpy dtype, default numpy.float32
        Dtype of the returned arrays (the draws are made in float64 and rounded).
    lengthscale : float, default 1.5
        Lengthscale of the random function; smaller is wigglier.

    Returns
    -------
    X : numpy.ndarray, shape (n, d)
    y : numpy.ndarray, shape (n,)
    """
    n, d = int(n), int(d)
    if n < 0 or d < 1:
        raise ValueError(f"synthetic needs n >= 0 and d >= 1, got n={n}, d={d}")
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    if lengthscale <= 0:
        raise ValueError(f"lengthscale must be > 0, got {lengthscale}")
    ss_f, ss_x, ss_eps = np.random.SeedSequence(seed).spawn(3)
    W, b, a, c = _synthetic_function(d, lengthscale, ss_f)
    rng_x, rng_eps = np.random.default_rng(ss_x), np.random.default_rng(ss_eps)
    X = np.empty((n, d), dtype=dtype)
    y = np.empty(n, dtype=dtype)
    for i in range(0, n, _CHUNK_ROWS):
        rows = min(_CHUNK_ROWS, n - i)
        Xc = rng_x.standard_normal((rows, d))
        fc = np.sin(Xc @ W.T + b) @ a - c
        X[i : i + rows] = Xc
        y[i : i + rows] = fc + noise * rng_eps.standard_normal(rows)
    return X, y


def synthetic_split(
    n_train: int,
    n_test: int,
    d: int,
    noise: float = 0.1,
    seed: int = 0,
    dtype=np.float32,
    standardize: bool = True,
    lengthscale: float = 1.5,
) -> Dataset:
    """Synthetic train and test sets drawn from the same random function (see :func:`synthetic`).

    Parameters
    ----------
    n_train, n_test : int
        Numbers of training and test rows: the first ``n_train`` rows of ``synthetic(n_train + n_test, ...)`` train,
        the rest test.
    d : int
        Number of input columns.
    noise : float, default 0.1
        Std of the observation noise on both train and test targets.
    seed : int, default 0
        Seed.
    dtype : numpy dtype, default numpy.float32
        Dtype of the returned arrays.
    standardize : bool, default True
        Standardise with the training statistics, as :func:`load_uci` does.
    lengthscale : float, default 1.5
        Lengthscale of the random function.

    Returns
    -------
    Dataset
        With ``name="synthetic"`` and ``split=0``.
    """
    X, y = synthetic(n_train + n_test, d, noise=noise, seed=seed, dtype=dtype, lengthscale=lengthscale)
    return _make_dataset("synthetic", 0, X[:n_train], y[:n_train], X[n_train:], y[n_train:], standardize, dtype)


# ----------------------------------------------------------------------------------------------------------------
# Download
# ----------------------------------------------------------------------------------------------------------------


def _pinned_sha256() -> dict[str, str]:
    """``{"<name>/<file>": sha256}`` from :data:`SHA256_FILE` (``sha256sum`` format: hash, two spaces, path)."""
    pins = {}
    for line in SHA256_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            digest, rel = line.split(maxsplit=1)
            pins[rel.strip()] = digest
    return pins


def _copy_file_url(url: str, output_file: str, _pooch) -> None:
    """A pooch downloader for ``file://`` URLs (a mirror on a shared disk); pooch itself speaks http(s)/ftp/doi."""
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    source = Path(url2pathname(urlparse(url).path))
    if not source.is_file():
        raise FileNotFoundError(f"{url} does not exist; is base_url right?")
    shutil.copyfile(source, output_file)


def _retrieve(pooch, url: str, sha256: str | None, folder: Path, label: str, progress: bool, timeout: float) -> None:
    """Fetch ``url`` into ``folder`` with pooch, checking ``sha256``; raise our errors, not requests'."""
    import requests

    bar = None
    if url.startswith("file:"):
        fetch = _copy_file_url
    else:
        if progress:
            from tqdm.auto import tqdm

            # total=1: pooch tests the bar's truth, which tqdm takes from total, before setting the real total
            bar = tqdm(desc=label, total=1, unit="B", unit_scale=True, unit_divisor=1024, leave=False)
        fetch = pooch.HTTPDownloader(progressbar=bar if bar is not None else False, timeout=timeout)
    seen = []

    def fetch_and_hash(url, output_file, pooch_obj):  # pooch deletes a mismatching file before saying so
        fetch(url, output_file, pooch_obj)
        seen.append(pooch.file_hash(output_file))

    logger = pooch.get_logger()
    level = logger.level
    logger.setLevel("WARNING")  # no "Downloading data from ..." lines naming the staging folder
    try:
        pooch.retrieve(url, known_hash=sha256, fname=Path(label).name, path=folder, downloader=fetch_and_hash)
    except ValueError:
        if sha256 is None or not seen or seen[-1] == sha256:
            raise
        raise ValueError(
            f"{label} from {url} does not have the expected SHA-256 checksum: expected {sha256}, got {seen[-1]}. "
            "The file was not saved. A wrong base_url or a page of HTML (or a Git LFS pointer) in place of the file "
            "gives this; so does a file changed upstream."
        ) from None
    except requests.exceptions.HTTPError as exc:
        code = exc.response.status_code if exc.response is not None else None
        if code == 404:
            raise FileNotFoundError(f"{url} does not exist (HTTP 404); is base_url right?") from exc
        raise ConnectionError(f"downloading {url} failed: {exc}") from exc
    except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
        raise ConnectionError(
            f"cannot download {url}: {exc}. Are you offline? Either retry when online, or copy the "
            f"uci_datasets folders by hand and point {ENV_VAR} (or --data-dir) at them."
        ) from exc
    except requests.exceptions.RequestException as exc:
        raise ConnectionError(f"downloading {url} failed: {exc}") from exc
    finally:
        logger.setLevel(level)
        if bar is not None:
            bar.close()


def _download_set(pooch, root: Path, name: str, base: str, pins: dict, progress: bool, overwrite: bool, timeout):
    """Fetch one set's missing (or changed, or all when ``overwrite``) files into ``root/name``, all or nothing."""
    folder = root / name
    # The mask first: a present data.csv.gz then implies a complete set (find_dataset looks for data.csv.gz).
    files = (MASK_FILE, *_EXTRA_PARTS.get(name, ()), DATA_FILE)
    todo = []
    for fname in files:
        target, sha256 = folder / fname, pins.get(f"{name}/{fname}")
        if overwrite or not target.is_file() or (sha256 is not None and pooch.file_hash(str(target)) != sha256):
            todo.append(fname)
            if sha256 is None:
                warnings.warn(
                    f"{name}/{fname} has no pinned SHA-256 (it was too large to fetch when the checksums were "
                    "taken): it is downloaded unchecked",
                    UserWarning,
                    stacklevel=3,
                )
    if not todo:
        return
    created = [d for d in (*reversed(root.parents), root) if not d.exists()]
    root.mkdir(parents=True, exist_ok=True)
    # Everything lands in a private folder first and moves into place only once every file of the set has arrived
    # and passed its checksum: a failure leaves no partial file, no empty folder, and the old files untouched.
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.download-", dir=root))
    done = False
    try:
        for rel in (f"{name}/{fname}" for fname in todo):
            _retrieve(pooch, f"{base}/{rel}", pins.get(rel), staging, rel, progress, timeout)
        (staging / ".mode").touch()  # pooch's temporary files are 0600; give ours the usual mode (umask applied)
        mode = (staging / ".mode").stat().st_mode & 0o777
        folder.mkdir(exist_ok=True)
        for fname in todo:
            os.chmod(staging / fname, mode)
            os.replace(staging / fname, folder / fname)
        done = True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not done:
            for d in reversed(created):
                try:
                    d.rmdir()
                except OSError:  # not empty: something else lives there now
                    break


def download(
    data_dir: str | os.PathLike | None = None,
    names: str | Iterable[str] | None = None,
    base_url: str = DEFAULT_BASE_URL,
    progress: bool = True,
    overwrite: bool = False,
    timeout: float = 60.0,
    *,
    dest: str | os.PathLike | None = None,
) -> Path:
    """Download UCI sets from the public ``uci_datasets`` collection, checking each file's SHA-256.

    For every set, fetches ``<base_url>/<name>/test_mask.csv.gz`` then ``<base_url>/<name>/data.csv.gz`` into
    ``<data_dir>/<name>/`` with :mod:`pooch`, checking each file against the SHA-256 pinned in
    :data:`SHA256_FILE` (every file of every set; only the data files of the large sets :data:`LARGE_UCI_NAMES` are
    unpinned and fetched unchecked, with a warning). A set's files are gathered in a temporary folder and moved into
    place only when all have arrived and passed their check, so a failed download leaves nothing behind: no partial
    file, no empty folder, and files already there untouched.

    Needs the ``pooch`` package (a dependency of gpfast; imported here only, so ``import gpfast`` works without it).

    Parameters
    ----------
    data_dir : str or os.PathLike, optional
        Destination folder; defaults to :func:`resolve_data_dir` (``$GPFAST_DATA``, else the user cache folder).
    names : str or iterable of str, optional
        Set(s) to fetch, from :data:`UCI_NAMES`. Default: every known set except :data:`LARGE_UCI_NAMES` (which
        must be named explicitly).
    base_url : str, default DEFAULT_BASE_URL
        Root URL of the collection (or of a mirror holding the same files): ``https://``, ``http://`` or ``file://``.
    progress : bool, default True
        Show a tqdm progress bar per file.
    overwrite : bool, default False
        Fetch every file again. Without it, a file already present is kept if it matches its pinned checksum and
        fetched again if it does not.
    timeout : float, default 60.0
        Socket timeout in seconds.
    dest : str or os.PathLike, optional
        Deprecated old name of ``data_dir`` (a FutureWarning); will be removed.

    Returns
    -------
    pathlib.Path
        The destination folder (usable as ``data_dir``).

    Raises
    ------
    ValueError
        An unknown set name, or a file whose SHA-256 is not the pinned one (the message names the file, the
        expected and the seen checksum).
    ConnectionError
        The network is unreachable (offline) or the transfer broke.
    FileNotFoundError
        A file is missing at ``base_url``.
    ImportError
        pooch is not installed.
    """
    if dest is not None:
        if data_dir is not None:
            raise TypeError("download() got both data_dir and dest (its deprecated old name); pass data_dir only")
        warnings.warn(
            "download(dest=...) is deprecated: the folder argument is now called data_dir, as everywhere else in gpfast",
            FutureWarning,
            stacklevel=2,
        )
        data_dir = dest
    if names is None:
        wanted = [n for n in UCI_NAMES if n not in LARGE_UCI_NAMES]
    elif isinstance(names, str):
        wanted = [names]
    else:
        wanted = list(names)
    unknown = [n for n in wanted if n not in UCI_SIZES]
    if unknown:
        raise ValueError(f"unknown dataset name(s) {unknown}; known names: {', '.join(UCI_NAMES)}")
    try:
        import pooch  # here only: import gpfast must work where pooch is not installed
    except ImportError as exc:
        raise ImportError("gpfast.datasets.download needs the pooch package: pip install pooch") from exc
    pins = _pinned_sha256()
    root = resolve_data_dir(data_dir)
    base = base_url.rstrip("/")
    for name in wanted:
        _download_set(pooch, root, name, base, pins, progress, overwrite, timeout)
    return root
