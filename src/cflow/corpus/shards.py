"""A story directory: a teacher's raw answers as JSONL shards, and the manifest that says what they hold.

    DIR/manifest.json          what made the directory (teacher file and hash, sampling settings),
                               the sealed shards (stories, tokens, sha256 each) and every run's figures
    DIR/shard-00000.jsonl.xz   sealed shards: xz-compressed, never written again
    DIR/shard-00007.jsonl      the open shard (at most one), appended a whole line at a time

One line is one answer: `seed`, `verb`, `noun`, `adjective`, `feature`, `text` (raw, as the teacher
wrote it), `finish` ("stop" or "length"), `tokens` (generated tokens). Every answer is kept, short
ones included; cflow.corpus.build decides what becomes a document.

Safety: a line is one write() of a complete line to a file opened for appending, so an interrupt
between stories never leaves half a line; a process killed mid-write leaves at most a torn last
line, which opening the directory again cuts off (and counts). Sealing compresses the open shard
into its `.jsonl.xz` (written beside it and renamed into place), records it in the manifest
(likewise atomic), and only then removes the plain file, so every crash point leaves either the
plain shard or the sealed one, never both counted and never neither.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from cflow import fsutil
from cflow.errors import CflowError

FORMAT = "cflow-stories/1"
MANIFEST = "manifest.json"
_SHARD = re.compile(r"^shard-(\d{5})\.jsonl(\.xz)?$")


class CorpusError(CflowError):
    """A story directory cannot be used as asked (not one, made by another teacher, damaged)."""


@dataclass
class Shard:
    file: str
    stories: int
    tokens: int
    sha256: str


def shard_name(index: int, sealed: bool) -> str:
    return f"shard-{index:05d}.jsonl" + (".xz" if sealed else "")


def read_lines(path: Path) -> Iterator[dict[str, Any]]:
    """The answers of one shard file (sealed or open), in file order."""
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith("\n"):
                return  # a torn last line (see the module docstring): not an answer
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                raise CorpusError(f"{path}:{lineno}: not a JSON line; the shard is damaged "
                                  "(remove it and its manifest entry, or start a new directory)") from None


class StoryStore:
    """An open story directory. `open()` creates or resumes one; `append()` adds an answer to the
    open shard, `seal()` closes it; `settle()` seals it when it holds `shard_stories` answers."""

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        self.root = root
        self.manifest = manifest
        self.torn_lines = 0  # cut off when the directory was opened
        self._fd: int | None = None
        self._open_stories = 0
        self._open_tokens = 0
        self._recover()

    # ---- opening --------------------------------------------------------------------------
    @classmethod
    def open(cls, root: str | os.PathLike, identity: dict[str, Any]) -> "StoryStore":
        """Create DIR (its parent must exist) or resume it. `identity` (teacher and settings) must
        equal what the directory was made with: continuing with another teacher or other settings
        would mix two corpora under one manifest."""
        root = Path(root)
        path = root / MANIFEST
        if root.exists() and not root.is_dir():
            raise CorpusError(f"{root} exists and is not a directory; give a directory for the stories")
        if path.is_file():
            try:
                manifest = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise CorpusError(f"{path} cannot be read ({e}); the directory is damaged") from None
            if manifest.get("format") != FORMAT:
                raise CorpusError(f"{path} is not a story manifest ({FORMAT}); give another directory")
            for key, want in identity.items():
                have = manifest.get(key)
                if have != want:
                    raise CorpusError(
                        f"{root} was made with {key} {json.dumps(have, sort_keys=True)}, not "
                        f"{json.dumps(want, sort_keys=True)}; continue it with the same teacher and settings, "
                        "or give a new --out directory")
            return cls(root, manifest)
        if root.is_dir() and any(root.iterdir()):
            raise CorpusError(f"{root} is not empty and holds no {MANIFEST}; give an empty or new directory "
                              "(nothing there is touched)")
        if not root.parent.is_dir():
            raise CorpusError(f"{root.parent} does not exist; create it first (nothing was created)")
        with fsutil.writing(root):
            root.mkdir(exist_ok=True)
        manifest = {"format": FORMAT, **identity, "shards": [], "runs": []}
        store = cls(root, manifest)
        store.save()
        return store

    def _recover(self) -> None:
        """Bring the files in line with the manifest after a crash (module docstring)."""
        listed = {s["file"] for s in self.manifest["shards"]}
        for p in sorted(self.root.iterdir()):
            m = _SHARD.match(p.name)
            if not m:
                continue
            if p.name.endswith(".xz"):
                if p.name not in listed:  # sealed, but the manifest never heard of it: seal again
                    p.unlink()
            elif shard_name(int(m.group(1)), True) in listed:  # sealed and recorded: the plain copy is stale
                p.unlink()
        plain = sorted(p for p in self.root.iterdir() if _SHARD.match(p.name) and not p.name.endswith(".xz"))
        if len(plain) > 1:
            raise CorpusError(f"{self.root} has {len(plain)} open shards ({', '.join(p.name for p in plain)}); "
                              "a story directory has at most one; it was changed by hand")
        if plain:
            p = plain[0]
            data = p.read_bytes()
            keep = data.rfind(b"\n") + 1
            if keep < len(data):
                self.torn_lines = 1
                with open(p, "r+b") as f:
                    f.truncate(keep)
            rows = list(read_lines(p))
            self._open_stories = len(rows)
            self._open_tokens = sum(int(r.get("tokens", 0)) for r in rows)

    # ---- what is there --------------------------------------------------------------------
    @property
    def shards(self) -> list[Shard]:
        return [Shard(**s) for s in self.manifest["shards"]]

    def _open_path(self) -> Path:
        return self.root / shard_name(len(self.manifest["shards"]), False)

    def files(self) -> list[Path]:
        """Every shard file, sealed ones first, in order."""
        out = [self.root / s.file for s in self.shards]
        if self._open_path().exists():
            out.append(self._open_path())
        return out

    def answers(self) -> Iterator[dict[str, Any]]:
        for p in self.files():
            yield from read_lines(p)

    @property
    def stories(self) -> int:
        return sum(s.stories for s in self.shards) + self._open_stories

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards) + self._open_tokens

    def seeds(self) -> set[int]:
        return {int(a["seed"]) for a in self.answers()}

    # ---- writing --------------------------------------------------------------------------
    def append(self, answer: dict[str, Any]) -> None:
        line = (json.dumps(answer, ensure_ascii=False) + "\n").encode("utf-8")
        if self._fd is None:
            with fsutil.writing(self._open_path()):
                self._fd = os.open(self._open_path(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        with fsutil.writing(self._open_path()):
            n = os.write(self._fd, line)
            if n != len(line):  # a full disk mid-line: cut the piece so the file stays whole lines
                os.ftruncate(self._fd, os.lseek(self._fd, 0, os.SEEK_END) - n)
                raise OSError(28, "short write (is the disk full?)")
        self._open_stories += 1
        self._open_tokens += int(answer.get("tokens", 0))

    def settle(self, shard_stories: int) -> None:
        if self._open_stories >= shard_stories:
            self.seal()

    def seal(self) -> None:
        """Compress the open shard and record it (a no-op when it holds nothing)."""
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
        plain = self._open_path()
        if not plain.exists():
            return
        if self._open_stories == 0:
            plain.unlink()
            return
        data = plain.read_bytes()
        # counted again from the lines: an interrupt may have landed between a write and its count
        rows = list(read_lines(plain))
        self._open_stories, self._open_tokens = len(rows), sum(int(r.get("tokens", 0)) for r in rows)
        sealed = self.root / shard_name(len(self.manifest["shards"]), True)
        buf = io.BytesIO()
        with lzma.open(buf, "wb", preset=9) as z:
            z.write(data)
        with fsutil.writing(sealed):
            fsutil.atomic_write_bytes(sealed, buf.getvalue())
        self.manifest["shards"].append({"file": sealed.name, "stories": self._open_stories,
                                        "tokens": self._open_tokens, "sha256": hashlib.sha256(data).hexdigest()})
        self._open_stories = self._open_tokens = 0
        self.save()
        plain.unlink()

    def save(self) -> None:
        self.manifest["stories"] = self.stories
        self.manifest["tokens"] = self.tokens
        with fsutil.writing(self.root / MANIFEST):
            fsutil.atomic_write_text(self.root / MANIFEST, json.dumps(self.manifest, indent=1) + "\n")

    def close(self) -> None:
        self.seal()
        self.save()
