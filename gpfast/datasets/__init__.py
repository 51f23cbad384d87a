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

from gpfast.datasets.catalog import (
    DATA_FILE,
    DEFAULT_BASE_URL,
    ENV_VAR,
    LARGE_UCI_NAMES,
    MASK_FILE,
    N_SPLITS,
    SHA256_FILE,
    SHIPPED,
    SHIPPED_DIR,
    UCI_NAMES,
    UCI_SIZES,
    available,
    find_dataset,
    resolve_data_dir,
)
from gpfast.datasets.downloads import download
from gpfast.datasets.synthetic_data import synthetic, synthetic_split
from gpfast.datasets.uci import Dataset, load_uci

__all__ = [
    "DATA_FILE",
    "ENV_VAR",
    "MASK_FILE",
    "SHIPPED_DIR",
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
