"""Real text that ships with the interpreter: the Python standard library's own ``.py`` sources.

Files: every ``*.py`` under ``dirname(os.__file__)`` (e.g. ``lib/python3.11``), excluding
``site-packages`` and ``dist-packages``, sorted by relative path. Split (deterministic, no
randomness): a file is HELD OUT when ``zlib.crc32(relative_path) % 10 == 0`` (about 10% of the
files), otherwise it is a TRAINING file. Tokens are bytes (vocabulary 256); files are
concatenated in path order, each followed by one NUL byte (``0``) as a separator.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import zlib
from pathlib import Path

import numpy as np

HELD_OUT_MODULUS = 10
SEPARATOR = 0


def stdlib_root() -> Path:
    return Path(os.path.dirname(os.__file__))


def is_held_out(relpath: str) -> bool:
    """The split rule: ``crc32(relative path, utf-8) % 10 == 0``."""
    return zlib.crc32(relpath.encode("utf-8")) % HELD_OUT_MODULUS == 0


def list_files(root: Path | None = None) -> list[str]:
    root = stdlib_root() if root is None else root
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        if path.is_file():
            out.append(rel)
    return sorted(out)


@dataclasses.dataclass
class Corpus:
    train: np.ndarray  # u8[N_train]
    held_out: np.ndarray  # u8[N_held]
    train_files: int
    held_out_files: int
    root: str
    digest: str  # sha256 of (train bytes, held-out bytes): identifies the data exactly

    def describe(self) -> dict:
        return {"source": f"Python standard library *.py under {self.root} (no site-packages)",
                "split": "held out iff zlib.crc32(relative path) % 10 == 0",
                "train_files": self.train_files, "held_out_files": self.held_out_files,
                "train_bytes": int(self.train.size), "held_out_bytes": int(self.held_out.size),
                "sha256": self.digest}


def load_corpus(root: Path | None = None, max_files: int | None = None) -> Corpus:
    """Reads the corpus. ``max_files`` (each split: its first files in path order) is for tests
    and the quick run only."""
    root = stdlib_root() if root is None else root
    train, held = [], []
    for rel in list_files(root):
        (held if is_held_out(rel) else train).append(rel)
    if max_files is not None:
        train, held = train[:max_files], held[:max(1, max_files // 4)]

    def cat(names):
        parts = []
        for rel in names:
            parts.append((root / rel).read_bytes())
            parts.append(bytes([SEPARATOR]))
        return np.frombuffer(b"".join(parts), np.uint8).copy()

    tr, ho = cat(train), cat(held)
    h = hashlib.sha256()
    h.update(tr.tobytes())
    h.update(b"|")
    h.update(ho.tobytes())
    return Corpus(tr, ho, len(train), len(held), str(root), h.hexdigest()[:16])


def random_windows(data: np.ndarray, rng: np.random.Generator, batch: int,
                   length: int) -> np.ndarray:
    """i32[batch, length] windows at uniform random offsets."""
    starts = rng.integers(0, data.size - length, size=batch)
    return np.stack([data[s:s + length] for s in starts]).astype(np.int32)


def eval_windows(data: np.ndarray, count: int, length: int, seed: int) -> np.ndarray:
    """i32[count, length] held-out windows: ``count`` evenly spaced offsets, each jittered by
    a seeded draw inside its stride (deterministic in ``seed``)."""
    stride = (data.size - length) // count
    rng = np.random.default_rng([seed, 7])
    starts = [i * stride + int(rng.integers(0, max(stride - length, 1))) for i in range(count)]
    return np.stack([data[s:s + length] for s in starts]).astype(np.int32)
