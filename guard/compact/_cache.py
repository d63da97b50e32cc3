"""A disk cache of encoder token states, so training reads each text through the frozen encoder once.

Entries are keyed by :func:`~guard.compact.encoder.text_key` (encoder name, window settings and the text) and stored
as float16 ``(n, 384)`` tensors in ``safetensors`` shards under the cache directory (default
``$XDG_CACHE_HOME/guard/compact``, ``~/.cache/guard/compact`` when that variable is unset; never inside the
repository). A cache only ever adds shards; delete the folder to clear it. Token states decide what a model trained on
them learns, so the cache is kept as the serving graphs are (:func:`check_private`, :func:`is_private_file`): read and
written only through folders this user owns and no one else can write to, created ``0700``, each shard read only
when it is a private regular file of this user's; otherwise it stays in memory, with a warning.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from guard.compact.encoder import TextEncoder, text_key

__all__ = ["DEFAULT_CACHE_DIR", "EmbeddingCache", "check_private", "is_private_file", "private_folders"]

logger = logging.getLogger("guard.compact")


def _user_cache() -> Path:
    """``$XDG_CACHE_HOME`` when it is an absolute path (the XDG base directory spec ignores a relative one), else
    ``~/.cache``."""
    configured = os.environ.get("XDG_CACHE_HOME", "")
    return Path(configured) if os.path.isabs(configured) else Path(os.path.expanduser("~")) / ".cache"


#: guard's compact-model caches, read once at import: ``$XDG_CACHE_HOME/guard/compact`` (default ``~/.cache``).
DEFAULT_CACHE_DIR = _user_cache() / "guard" / "compact"
#: Texts encoded per encoder call while filling the cache (longer texts take several windows each).
_FILL_BATCH = 32


def check_private(folder: Path) -> None:
    """A cache decides what a model answers or learns, so it is read only through a folder that this user owns and no
    one else can write to (where ``HOME`` is a shared folder, or its group may write to a cache folder, another user
    could plant a file under the predictable name, or swap the folder for theirs). A link is followed only when it
    is this user's (another user's link could be pointed elsewhere at any moment), and its target is checked too.

    Raises:
        PermissionError: ``folder`` (or a link to it) belongs to another user, or others may write to it.
    """
    mine = os.getuid() if hasattr(os, "getuid") else None
    link = folder.lstat()
    if stat.S_ISLNK(link.st_mode) and mine is not None and link.st_uid != mine:
        raise PermissionError(f"{folder} is a link of another user (uid {link.st_uid})")
    info = folder.stat()
    if mine is not None and info.st_uid != mine:
        raise PermissionError(f"{folder} belongs to another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{folder} is writable by other users (chmod 700 it to keep the cache there)")


def private_folders(root: Path, base: Path) -> list[Path]:
    """The folders a cached file under ``root`` is read through that must be private: ``root``, and when it lies
    under ``base`` (guard's own cache folder, ``$XDG_CACHE_HOME/guard``) every folder from ``base`` down (one a group
    member could write to would let them swap the folder below for theirs between the checks and the read). The
    missing ones are created ``0700``."""
    folders = [root]
    while folders[0] != base and base in folders[0].parents:
        folders.insert(0, folders[0].parent)
    for folder in folders:
        if not folder.exists():
            folder.parent.mkdir(parents=True, exist_ok=True)
            folder.mkdir(mode=0o700, exist_ok=True)
    return folders


def is_private_file(path: Path) -> bool:
    """Whether ``path`` is a regular file (not a link) of this user's that no one else can write to."""
    info = path.lstat()
    mine = not hasattr(os, "getuid") or info.st_uid == os.getuid()
    return stat.S_ISREG(info.st_mode) and mine and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class EmbeddingCache:
    """Token states of texts, computed once and kept on disk.

    Args:
        encoder: the frozen encoder.
        directory: where shards live; ``None`` keeps everything in memory only.
    """

    def __init__(self, encoder: TextEncoder, directory: Path | None = DEFAULT_CACHE_DIR) -> None:
        self.encoder = encoder
        self.directory = directory
        self._entries: dict[str, torch.Tensor] = {}
        if directory is None:
            return
        try:
            for folder in private_folders(directory, DEFAULT_CACHE_DIR.parent):
                check_private(folder)
        except OSError as exc:
            logger.warning("the embedding cache %s is not private or cannot be made (%s); token states are kept in "
                           "memory only", directory, exc)
            self.directory = None
            return
        from safetensors.torch import load_file

        for shard in sorted(directory.glob("shard-*.safetensors")):
            if not is_private_file(shard):
                logger.warning("the cached shard %s is not a private file of this user's; it is not read", shard)
                continue
            self._entries.update(load_file(str(shard)))

    def get(self, texts: Sequence[str], progress: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """Float16 token states for each text, encoding (and storing) the missing ones.

        Args:
            texts: the texts.
            progress: called with the number of texts just encoded (for a progress bar).
        """
        keys = [text_key(text, self.encoder.config) for text in texts]
        missing: dict[str, str] = {}
        for key, text in zip(keys, texts, strict=True):
            if key not in self._entries:
                missing.setdefault(key, text)
        if missing:
            items = sorted(missing.items(), key=lambda item: len(item[1]))
            fresh: dict[str, torch.Tensor] = {}
            for start in range(0, len(items), _FILL_BATCH):
                chunk = items[start : start + _FILL_BATCH]
                for (key, _), encoded in zip(chunk, self.encoder.encode([t for _, t in chunk]), strict=True):
                    fresh[key] = encoded.states.to(torch.float16).contiguous()
                if progress is not None:
                    progress(len(chunk))
            self._entries.update(fresh)
            self._write(fresh)
        return [self._entries[key] for key in keys]

    def _write(self, fresh: dict[str, torch.Tensor]) -> None:
        if self.directory is None or not fresh:
            return
        from safetensors.torch import save_file

        index = len(list(self.directory.glob("shard-*.safetensors")))
        target = self.directory / f"shard-{index:05d}-{os.getpid()}.safetensors"
        tmp = target.with_suffix(".tmp")
        save_file(fresh, str(tmp))
        tmp.replace(target)
