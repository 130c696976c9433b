"""What the runtime keeps on disk about model files: the GGUF conversion cache and the verdicts of
checksum verification. Both live under `cflow.fsutil.cache_dir()`.

Conversion cache. A GGUF is converted once into `gguf/<stem>-<key>.cflow`, where key is the XXH3-128
of the GGUF's bytes (plus the cflow version, since the format may change): a touched, renamed or
copied GGUF finds its conversion again, and a changed one gets a new one. Hashing reads the file
once; after that `(path, size, mtime, inode)` maps to the key without reading it (memo in
`gguf/keys.json`). The cache is bounded (CFLOW_CACHE_MAX, default 20G): adding a conversion evicts
the least recently used ones until it fits. `cflow cache` lists and clears it.

Verification. A `.cflow` file is checked against its per-tensor checksums the first time it is
used and the verdict is kept by `(path, size, mtime, inode)` in `verified.json`: XXH3 streams at
memory speed (SmolLM2's 98 MB: 4 ms from the page cache, 29 ms cold, measured), so damage is
caught at a cost nobody notices and later loads pay nothing. (Verifying lazily per tensor on first
touch would need a hook on the C side's first read; at these costs a whole-file check is simpler.) A file changed in place gets a new mtime and is verified again.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import xxhash

from cflow.errors import CflowError
from cflow.fsutil import atomic_write_text, cache_dir, read_json_dict

DEFAULT_CACHE_MAX = 20 * 1000**3
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


class CacheError(CflowError, ValueError):
    """The cache cannot be used as asked (a bad size limit, an unwritable cache directory)."""


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB', '300000' -> bytes (K/M/G/T are powers of 1000; KiB.. of 1024)."""
    m = _SIZE.match(str(text))
    if not m:
        raise CacheError(f"cannot read {text!r} as a size; write e.g. 512M, 2G or 1.5GiB")
    unit = m.group(2).lower()
    base = 1024 if "i" in str(text).lower() else 1000
    return int(float(m.group(1)) * base ** " kmgt".index(unit or " "))


def format_size(n: float) -> str:
    """Bytes as people read them, in decimal units (MB = 10^6 B), the convention of every command."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    # Best effort: a read-only cache only means the work is redone next time.
    try:
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True), mkdir=True)
    except OSError:
        pass


# ---- verification verdicts -----------------------------------------------------------------------
def _verdicts_path() -> Path:
    return cache_dir() / "verified.json"


def is_verified(path: Path) -> bool:
    try:
        return stat_key(path) in read_json_dict(_verdicts_path())
    except OSError:
        return False


def mark_verified(path: Path) -> None:
    vpath = _verdicts_path()
    data = read_json_dict(vpath)
    data = {k: v for k, v in data.items() if _still_exists(k)}  # forget deleted files
    data[stat_key(path)] = time.time()
    _write_json(vpath, data)


def _still_exists(key: str) -> bool:
    return os.path.exists(key.split("|", 1)[0])


# ---- the GGUF conversion cache -------------------------------------------------------------------
@dataclass(frozen=True)
class CacheEntry:
    path: Path  # the converted .cflow
    source: str  # the GGUF it was converted from (as last seen)
    nbytes: int
    last_used: float  # seconds since the epoch


def gguf_dir() -> Path:
    return cache_dir() / "gguf"


def cache_limit() -> int:
    env = os.environ.get("CFLOW_CACHE_MAX")
    return parse_size(env) if env else DEFAULT_CACHE_MAX


def content_key(src: Path, progress: Callable[[int, int], None] | None = None) -> str:
    """XXH3-128 of the GGUF's bytes and the cflow version (memoised by path, size, mtime, inode)."""
    from cflow import __version__

    memo_path = gguf_dir() / "keys.json"
    memo = read_json_dict(memo_path)
    skey = stat_key(src)
    if skey in memo.get("keys", {}):
        return memo["keys"][skey]
    h = xxhash.xxh3_128()
    h.update(f"cflow {__version__}\0".encode())
    total, done = src.stat().st_size, 0
    with open(src, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress(done, total)
    key = h.hexdigest()[:20]
    memo.setdefault("keys", {})[skey] = key
    memo["keys"] = {k: v for k, v in memo["keys"].items() if _still_exists(k)}
    _write_json(memo_path, memo)
    return key


def cached_path(src: Path, key: str) -> Path:
    """Where the conversion of content `key` lives: an existing one under any name (the GGUF may
    have been copied or renamed since), else a new name after this GGUF."""
    d = gguf_dir()
    found = sorted(d.glob(f"*-{key}.cflow")) if d.is_dir() else []
    if found:
        return found[0]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", src.stem)[:80]
    return d / f"{stem}-{key}.cflow"


def touch(entry_path: Path, source: Path) -> None:
    """Record a use of a cached conversion (its recency orders eviction)."""
    memo_path = gguf_dir() / "keys.json"
    memo = read_json_dict(memo_path)
    memo.setdefault("used", {})[entry_path.name] = {"t": time.time(), "source": str(source)}
    _write_json(memo_path, memo)


def entries() -> list[CacheEntry]:
    """The cached conversions, most recently used first."""
    d = gguf_dir()
    used = read_json_dict(d / "keys.json").get("used", {})
    out = []
    # cflow 0.1 kept conversions in the cache root: list them too, so they can be cleared
    found = [p for root in (d, cache_dir()) if root.is_dir() for p in root.glob("*.cflow")]
    for p in found:
        info = used.get(p.name, {})
        st = p.stat()
        out.append(CacheEntry(p, info.get("source", "?"), st.st_size, float(info.get("t", st.st_mtime))))
    return sorted(out, key=lambda e: -e.last_used)


def make_room(incoming: int, keep: Path | None = None, log: Callable[[str], None] | None = None) -> None:
    """Evict least recently used conversions until `incoming` more bytes fit the cache limit."""
    limit = cache_limit()
    items = [e for e in entries() if e.path != keep]
    total = sum(e.nbytes for e in items)
    for e in reversed(items):  # least recently used first
        if total + incoming <= limit:
            break
        e.path.unlink(missing_ok=True)
        total -= e.nbytes
        if log:
            log(f"cache full ({format_size(limit)}, CFLOW_CACHE_MAX): removed {e.path.name} ({format_size(e.nbytes)})")


def clear(match: str | None = None) -> list[CacheEntry]:
    """Delete cached conversions (all, or those whose file or source name contains `match`)."""
    gone = [e for e in entries() if match is None or match in e.path.name or match in e.source]
    for e in gone:
        e.path.unlink(missing_ok=True)
    return gone
