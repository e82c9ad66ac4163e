"""What format detection needs of DeepSpeed checkpoints, cheap to import: :func:`detect` and the
options classes (the reader and writer are imported on first use, see the package)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptbridge.plugin import OpenOptions, OptionError, WriteOptions

from ._files import looks_like_deepspeed


def detect(path: str) -> bool:
    """True for a DeepSpeed checkpoint root (with ``latest``) or tag folder. Never raises."""
    return looks_like_deepspeed(os.fspath(path))


@dataclass(frozen=True)
class DeepSpeedOpenOptions(OpenOptions):
    """Opening a DeepSpeed checkpoint.

    ``tag``: which tag folder under a checkpoint root (default: the one ``latest`` names).
    """

    tag: str | None = None


@dataclass(frozen=True)
class DeepSpeedUniversalWriteOptions(WriteOptions):
    """Writing DeepSpeed's universal layout (the same for every target DP degree and ZeRO stage:
    DeepSpeed partitions it when it loads, so it takes no layout options).

    ``tag``: the tag folder (default ``global_step<step>``).
    ``workers``: threads reading the source and checksumming (default 2; the writes run in
    threads of their own).
    """

    tag: str | None = None
    workers: int | None = None

    def validate(self) -> None:
        if self.tag is not None and (os.sep in self.tag or self.tag in ("", ".", "..")):
            raise OptionError(f"format 'deepspeed-universal' (write): invalid tag {self.tag!r}")
        if self.workers is not None and self.workers < 1:
            raise OptionError(f"format 'deepspeed-universal' (write): workers must be >= 1, got {self.workers}")
