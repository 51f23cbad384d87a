"""Downloads of the UCI sets with pooch, checked against pinned SHA-256 hashes, all or nothing per set."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path

from gpfast.datasets.catalog import (
    _EXTRA_PARTS,
    DATA_FILE,
    DEFAULT_BASE_URL,
    ENV_VAR,
    LARGE_UCI_NAMES,
    MASK_FILE,
    SHA256_FILE,
    SHIPPED,
    SHIPPED_DIR,
    UCI_NAMES,
    UCI_SIZES,
    resolve_data_dir,
)


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
            # disable=None: the bar is drawn only when stderr is a terminal, so that a log file gets no bars
            bar = tqdm(desc=label, total=1, unit="B", unit_scale=True, unit_divisor=1024, leave=False, disable=None)
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


def _old_dest(data_dir, dest):
    if data_dir is not None:
        raise TypeError("download() got both data_dir and dest (its deprecated old name); pass data_dir only")
    warnings.warn(
        "download(dest=...) is deprecated: the folder argument is now called data_dir, as everywhere else in gpfast",
        FutureWarning,
        stacklevel=3,
    )
    return dest


def _wanted(names: str | Iterable[str] | None) -> list[str]:
    """The set names asked for (default: every known set but the large ones); ValueError for an unknown one."""
    if names is None:
        return [n for n in UCI_NAMES if n not in LARGE_UCI_NAMES]
    wanted = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in wanted if n not in UCI_SIZES]
    if unknown:
        raise ValueError(f"unknown dataset name(s) {unknown}; known names: {', '.join(UCI_NAMES)}")
    return wanted


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
    file, no empty folder, and files already there untouched. The sets of :data:`SHIPPED` are copied from the
    package (checked the same way) unless ``base_url`` names another source.

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
        data_dir = _old_dest(data_dir, dest)
    wanted = _wanted(names)
    try:
        import pooch  # here only: import gpfast must work where pooch is not installed
    except ImportError as exc:
        raise ImportError("gpfast.datasets.download needs the pooch package: pip install pooch") from exc
    pins = _pinned_sha256()
    root = resolve_data_dir(data_dir)
    base = base_url.rstrip("/")
    for name in wanted:
        # the package holds the collection's own files of these sets (same pinned checksums): no network needed
        source = SHIPPED_DIR.as_uri() if name in SHIPPED and base_url == DEFAULT_BASE_URL else base
        _download_set(pooch, root, name, source, pins, progress, overwrite, timeout)
    return root
