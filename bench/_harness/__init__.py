"""One measuring harness for every ckptbridge benchmark (see bench/README.md).

Suite authors use :class:`Suite`, :class:`Size`, :class:`Case`, :class:`Column`, the
:class:`Ctx` their functions receive (``ctx.region()`` is the clock) and :func:`main`.
"""

from .cli import main
from .context import Ctx, Skip, region
from .spec import Case, Column, Size, Suite

__all__ = ["Case", "Column", "Ctx", "Size", "Skip", "Suite", "main", "region"]
