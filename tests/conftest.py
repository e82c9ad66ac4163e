"""Shared test setup.

JAX tests run on 8 fake CPU devices; XLA reads ``XLA_FLAGS`` once, when jax
initialises its backend, so the flag is set here, before any test module
imports jax (setting it later has no effect).
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
