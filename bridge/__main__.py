"""``python -m ckptbridge``: the command line (see ``ckptbridge --help``)."""

from ._cli import main

raise SystemExit(main())
