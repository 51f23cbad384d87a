"""The bytes of gpfast's files (saved models and checkpoints): a header with a checksum, and a payload of plain types.

File format 2 (written by this gpfast) is a fixed 52-byte header followed by a payload:

======  =====  ================================================================================================
offset  bytes  content
======  =====  ================================================================================================
0       8      signature ``b"\\x89GPFAST\\n"`` (a high byte and a newline, as PNG's, so that text-mode transfers
               show up as damage)
8       4      format version, unsigned little-endian (2)
12      8      payload length in bytes, unsigned little-endian
20      32     SHA-256 of bytes 0-19 (signature, version, length) followed by the payload
52      ...    payload: a ``torch.save`` dict of plain types and CPU tensors, no pickled classes
======  =====  ================================================================================================

The checksum covers every byte but its own, and any change to it breaks the match, so a flipped bit anywhere is
caught before the payload is read. The payload is read with ``torch.load(..., weights_only=True)``, which
rebuilds tensors and plain containers only and never runs code from the file. Formats 0 (gpfast 0.1.0, a bare
``torch.save`` dict with a string ``version`` entry) and 1 (gpfast 0.2.0 before the header, an integer
``format_version`` entry) still load; they have no checksum, but their zip members' CRC-32s are checked.

Every problem with a file raises one ``ValueError`` whose message starts ``cannot load '<path>':`` and says what is
wrong (empty, truncated, corrupt, not a gpfast file, written in format N).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import secrets
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch

from gpfast._version import __version__

__all__ = ["FORMAT", "FORMAT_VERSION", "HEADER_SIZE", "SIGNATURE", "file_error", "read_state", "write_state"]

#: The ``format`` entry of a saved model's payload.
FORMAT = "gpfast.ExactGP"
#: The file layout this gpfast writes; it reads every version up to this one.
FORMAT_VERSION = 2
#: The first bytes of every file of format 2 or later.
SIGNATURE = b"\x89GPFAST\n"
_HEADER = struct.Struct("<8sIQ32s")  # signature, format version, payload length, SHA-256
_CHECKED = struct.Struct("<8sIQ")  # the header fields the checksum covers
HEADER_SIZE = _HEADER.size
_LEGACY_VERSIONS = {"0.1.0": 0}  # gpfast versions that wrote files before format_version existed


def file_error(path, what: str) -> ValueError:
    """The one error of a bad file: ``cannot load '<path>': <what>``."""
    return ValueError(f"cannot load {str(path)!r}: {what}")


def write_state(state: dict, path, format_version: int = FORMAT_VERSION) -> None:
    """Write ``state`` (a dict of plain types and CPU tensors) as a headed, checksummed file (see the module
    docstring). ``format_version`` goes into the header; other values are for tests of newer files only."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    head = _CHECKED.pack(SIGNATURE, format_version, len(payload))
    digest = hashlib.sha256(head)
    digest.update(payload)
    if hasattr(path, "write"):
        path.write(head + digest.digest())
        path.write(payload)
        return
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)  # as `gpfast fit --save` does: a new folder is no error
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.part"
    # os.open with 0o666 leaves the mode to the umask, as for any file the user writes (mkstemp would give 0600)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head + digest.digest())
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------------------------------------
# reading: the bytes, then the state they hold
# ------------------------------------------------------------------------------------------------------------


def read_state(path, format: str = FORMAT) -> tuple[int, dict]:
    """The format version and the state dict of a gpfast file (checked for damage and type, not yet for
    consistency); ``path`` is a file name or a binary file object; ``format``: the payload's expected ``format``
    entry (a checkpoint's is :data:`gpfast.estimator.checkpoint.CHECKPOINT_FORMAT`, and only model files have
    the legacy formats 0 and 1). Raises ``ValueError`` for any bad file (``FileNotFoundError`` and other
    ``OSError`` when it cannot be read at all)."""
    data = path.read() if hasattr(path, "read") else Path(path).read_bytes()
    if not data:
        raise file_error(path, "the file is empty (0 bytes); a gpfast model file is never empty.")
    if data.startswith(SIGNATURE) or _near_signature(data):
        return _read_headed(path, data, format)
    if len(data) < len(SIGNATURE) and SIGNATURE.startswith(data):
        raise file_error(
            path,
            f"the file is truncated: {len(data)} bytes, shorter than the {HEADER_SIZE}-byte header of "
            f"a gpfast model file.",
        )
    if data.startswith(b"PK\x03\x04") and format == FORMAT:
        return _read_legacy(path, data)
    raise file_error(
        path,
        f"not a gpfast model file: it is {_describe_foreign(data)}. gpfast model files are written by "
        f"ExactGP.save and `gpfast fit --save`.",
    )


def _near_signature(data: bytes) -> bool:
    """The first 8 bytes are gpfast's signature with one or two bits flipped: damage, not a foreign file."""
    if len(data) < len(SIGNATURE):
        return False
    flipped = sum(bin(a ^ b).count("1") for a, b in zip(data[: len(SIGNATURE)], SIGNATURE))
    return flipped <= 2


def _read_headed(path, data: bytes, format: str = FORMAT) -> tuple[int, dict]:
    if len(data) < HEADER_SIZE:
        raise file_error(
            path,
            f"the file is truncated: {len(data)} bytes, shorter than the {HEADER_SIZE}-byte header of "
            f"a gpfast model file.",
        )
    signature, version, length, recorded = _HEADER.unpack_from(data)
    if signature != SIGNATURE:
        raise file_error(
            path,
            f"the file is corrupt: its first bytes {signature!r} are a damaged gpfast signature "
            f"(expected {SIGNATURE!r}).",
        )
    payload = memoryview(data)[HEADER_SIZE:]
    digest = hashlib.sha256(data[: _CHECKED.size])
    digest.update(payload)
    checksum_ok = digest.digest() == recorded
    if version > FORMAT_VERSION:
        if checksum_ok:
            raise file_error(
                path,
                f"it was written in gpfast file format {version}, by a newer gpfast; this gpfast "
                f"({__version__}) reads formats 0 to {FORMAT_VERSION}: upgrade gpfast to load it.",
            )
        raise file_error(
            path,
            f"the file is corrupt, or was written in a newer gpfast file format: its header says "
            f"format {version} and its SHA-256 checksum does not match; this gpfast ({__version__}) "
            f"reads formats 0 to {FORMAT_VERSION}.",
        )
    if len(payload) < length:
        raise file_error(
            path,
            f"the file is truncated: its header announces {length} bytes of data after the "
            f"{HEADER_SIZE}-byte header, but only {len(payload)} follow.",
        )
    if len(payload) > length:
        raise file_error(
            path, f"the file is corrupt: {len(payload)} bytes of data follow its header, which announces {length}."
        )
    if not checksum_ok:
        raise file_error(
            path,
            f"the file is corrupt: the SHA-256 of its contents is {digest.hexdigest()}, but its header "
            f"records {recorded.hex()} (damaged on disk or in transfer, or edited).",
        )
    if version < 2:
        raise file_error(
            path, f"the file is corrupt: its header says format {version}, but formats before 2 have no header."
        )
    state = _torch_load(path, payload)
    if not isinstance(state, dict) or state.get("format") != format:
        found = state.get("format") if isinstance(state, dict) else None
        raise file_error(path, f"its checksum matches but its data are not a {format} state (format {found!r}).")
    if state.get("format_version") != version:
        raise file_error(
            path,
            f"the file is corrupt: its header says format {version}, its data say {state.get('format_version')!r}.",
        )
    return version, state


def _read_legacy(path, data: bytes) -> tuple[int, dict]:
    """Formats 0 and 1: a bare ``torch.save`` zip archive."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            names = zf.namelist()
            if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
                raise file_error(
                    path,
                    f"not a gpfast model file: it is a zip archive (such as an .npz file) without a "
                    f"torch data.pkl member; its members: {_short_list(names)}.",
                )
            damaged = zf.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError) as exc:
        if isinstance(exc, ValueError) and str(exc).startswith("cannot load"):
            raise
        raise file_error(
            path,
            f"the file is truncated or corrupt: it starts as a zip archive (a gpfast file of format 0 "
            f"or 1) but cannot be read as one ({exc}).",
        ) from None
    if damaged is not None:
        raise file_error(path, f"the file is corrupt: member {damaged!r} of the zip archive fails its CRC-32 check.")
    state = _torch_load(path, data)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        kind = "a dict without" if isinstance(state, dict) else f"a {type(state).__name__}, not a dict with"
        raise file_error(path, f"not a gpfast model file: it is a torch file holding {kind} a format={FORMAT!r} entry.")
    return _legacy_version(path, state), state


def _torch_load(path, payload) -> Any:
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only refused a global: the file holds Python objects
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        raise file_error(
            path,
            f"not a gpfast model file: it is a torch file holding Python objects, which gpfast files "
            f"never contain (and which loading refuses to unpickle, as that could run code). {first}",
        ) from None
    except Exception as exc:  # torch reports a damaged archive in many ways (RuntimeError, EOFError, ...)
        raise file_error(
            path, f"the file is corrupt: its data cannot be read ({type(exc).__name__}: {str(exc).strip()[:200]})."
        ) from None


def _legacy_version(path, state: dict) -> int:
    if "format_version" in state:
        v = state["format_version"]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise file_error(path, f"its format_version must be an int >= 0, got {v!r}.")
        if v > FORMAT_VERSION:
            raise file_error(
                path,
                f"it was written in gpfast file format {v} (by gpfast {state.get('gpfast_version', '?')}"
                f"); this gpfast ({__version__}) reads formats 0 to {FORMAT_VERSION}: upgrade gpfast "
                f"to load it.",
            )
        if v >= 2:
            raise file_error(
                path,
                f"the file is corrupt: its data say format {v}, but files of format 2 and later start "
                f"with a gpfast header, and this one does not.",
            )
        return v
    version = state.get("version")
    if version is None:
        raise file_error(path, "it has no 'format_version' (or legacy 'version') entry; cannot tell how to read it.")
    if version not in _LEGACY_VERSIONS:
        raise file_error(
            path,
            f"it was saved by gpfast version {version!r}, which this gpfast ({__version__}) cannot "
            f"read; readable versions: {sorted(_LEGACY_VERSIONS)} and files with a format_version up "
            f"to {FORMAT_VERSION}.",
        )
    return _LEGACY_VERSIONS[version]


def _short_list(names, limit: int = 5) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _describe_foreign(data: bytes) -> str:
    """What a file that is not gpfast's looks like, from its first bytes."""
    head = data[:4096]
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy .npy file"
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        if b"joblib" in head or b"NumpyArrayWrapper" in head:
            return "a joblib file (a Python pickle), which loading refuses to unpickle, as that could run code"
        return "a Python pickle file, which loading refuses to unpickle, as that could run code"
    if head.startswith(b"\x1f\x8b"):
        return "a gzip-compressed file"
    if head[:1] == b"\x78" and len(head) > 1 and (head[0] * 256 + head[1]) % 31 == 0:
        return "zlib-compressed data (such as a compressed joblib file)"
    if head.startswith(b"\x89HDF"):
        return "an HDF5 file"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in "\r\n\t" for c in text):
        first = text.splitlines()[0][:40] if text.strip() else ""
        return f"a text file (starting {first!r})"
    return f"an unrecognised binary file (first bytes {data[:8]!r})"
