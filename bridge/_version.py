"""The version of ckptbridge (one place: the package and the writers read it here)."""

__version__ = "0.1.0"
