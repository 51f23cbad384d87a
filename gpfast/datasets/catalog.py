"""The UCI sets gpfast knows (names, sizes, files, pinned checksums) and where their folders are looked for."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent  # gpfast/

DEFAULT_BASE_URL = "https://github.com/treforevans/uci_datasets/raw/master/uci_datasets"
"""Where :func:`download` fetches ``<base>/<name>/data.csv.gz`` and ``<base>/<name>/test_mask.csv.gz`` from."""

SHA256_FILE = _PACKAGE / "data" / "uci_datasets.sha256"
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

SHIPPED_DIR = _PACKAGE / "data"


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
    return [base / name for base in _bases(data_dir)]


def _bases(data_dir: str | os.PathLike | None) -> list[Path]:
    """The folders that may hold ``<name>/``, in search order."""
    root = resolve_data_dir(data_dir)
    # Also accept a folder one level up (e.g. ``datasets/`` holding ``uci/<name>``), unless the folder is itself
    # called uci (as the user cache is): ``uci/uci/<name>`` is no layout anyone makes.
    above = [root / "uci"] if root.name != "uci" else []
    return [root, *above, SHIPPED_DIR]


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
    root = resolve_data_dir(data_dir)
    option = f" --data-dir {root}" if data_dir is not None and str(data_dir) != "" else ""
    raise FileNotFoundError(
        f"dataset {name!r} not found: no {DATA_FILE} in any of\n{where}\n"
        f"Fetch it with `gpfast download {name}{option}` (it goes to {root}; from Python: "
        f"gpfast.datasets.download(names=[{name!r}])), or point --data-dir (data_dir=...) or the {ENV_VAR} "
        f"environment variable at a folder holding {name}/{DATA_FILE}."
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
    names = set()
    for base in _bases(data_dir):
        if base.is_dir():
            names.update(p.parent.name for p in base.glob(f"*/{DATA_FILE}"))
    return sorted(names)
