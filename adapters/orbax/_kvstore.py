"""Where TensorStore finds an Orbax item: its kvstore spec for a local directory, ``s3://`` or ``gs://``.

Orbax checkpoints live where JAX users keep them, often in GCS or S3. Their bytes
are read through ckptbridge's storage layer (fsspec: ranged, concurrent, retried);
TensorStore is needed only for what ckptbridge does not parse itself: the OCDBT
B+tree (where each chunk lies) and arrays whose codecs only TensorStore decodes. For
those, the item's location becomes TensorStore's own kvstore driver, configured from
the same storage options the fsspec side uses::

    kvstore("/ckpts/100/state")     # {"driver": "file", "path": "/ckpts/100/state/"}
    kvstore("s3://bucket/run/100/state")
    # {"driver": "s3", "bucket": "bucket", "path": "run/100/state/", "endpoint": ...}

* ``s3://``: ``endpoint_url`` (option, ``client_kwargs`` or ``AWS_ENDPOINT_URL[_S3]``) becomes
  ``endpoint``, ``region_name`` / ``AWS_REGION`` ``aws_region``, ``anon=True`` anonymous
  credentials. TensorStore takes credentials from the environment or a profile only, so
  ``key``/``secret`` given as storage options are refused unless the environment holds them too.
* ``gs://``: TensorStore takes a GCS endpoint only from ``TENSORSTORE_GCS_HTTP_URL``; an
  ``endpoint_url`` option (or ``STORAGE_EMULATOR_HOST``) that differs from it is refused
  rather than silently reading another server.
* other protocols: an error naming the URL (TensorStore has no driver for them).
"""

from __future__ import annotations

import os
from typing import Any

from ckptbridge.plugin import OptionError, StorageError, storage

_GCS_ENV = "TENSORSTORE_GCS_HTTP_URL"


def kvstore(item: str) -> dict[str, Any]:
    """TensorStore kvstore spec (JSON) of directory ``item`` (a local path or a URL)."""
    if not storage.is_url(item):
        return {"driver": "file", "path": os.path.abspath(item) + "/"}
    proto = storage.protocol(item)
    bucket, _, key = item.split("://", 1)[1].partition("/")
    prefix = key.strip("/") + "/" if key.strip("/") else ""
    opts = storage.options(item)
    client = opts.get("client_kwargs") or {}
    if proto in ("s3", "s3a"):
        return {"driver": "s3", "bucket": bucket, "path": prefix, **_s3_extra(item, opts, client)}
    if proto in ("gs", "gcs"):
        _check_gcs_endpoint(item, opts.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST"))
        return {"driver": "gcs", "bucket": bucket, "path": prefix}
    raise StorageError(
        f"{item}: this Orbax checkpoint needs TensorStore (OCDBT index or codec), which has no driver for "
        f"{proto}:// URLs; copy it to a local directory, s3:// or gs://")


def _s3_extra(item: str, opts: dict[str, Any], client: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    endpoint = (opts.get("endpoint_url") or client.get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    if endpoint:
        extra["endpoint"] = endpoint
    region = client.get("region_name") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        extra["aws_region"] = region
    if opts.get("anon"):
        extra["aws_credentials"] = {"type": "anonymous"}
    elif opts.get("key") and os.environ.get("AWS_ACCESS_KEY_ID") != opts.get("key"):
        raise OptionError(
            f"{item}: this Orbax checkpoint is read partly by TensorStore, which takes S3 credentials "
            "from the environment or a profile, not from storage options: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead of key=/secret=")
    elif os.environ.get("AWS_ACCESS_KEY_ID") and not os.environ.get("AWS_PROFILE"):
        extra["aws_credentials"] = {"type": "environment"}  # not the whole chain (no profile-file probing)
    return extra


def _check_gcs_endpoint(item: str, endpoint: str | None) -> None:
    if not endpoint:
        return
    endpoint = endpoint if "://" in endpoint else f"http://{endpoint}"
    if os.environ.get(_GCS_ENV, "").rstrip("/") != endpoint.rstrip("/"):
        raise OptionError(
            f"{item}: GCS endpoint {endpoint} is configured, but TensorStore (which reads this Orbax "
            f"checkpoint's index) takes its GCS endpoint only from {_GCS_ENV} "
            f"(now {os.environ.get(_GCS_ENV)!r}): set {_GCS_ENV}={endpoint}")
