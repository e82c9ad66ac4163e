"""Reading a checkpoint from S3: ckptbridge vs s3fs ``cat``, and bytes fetched for a 1/8 slice.

A real S3 endpoint on 127.0.0.1 (moto's standalone server, ``python -m moto.server``, spoken to
over HTTP by s3fs/botocore exactly as AWS would be) holds a universal checkpoint written by
``ckptbridge.convert`` from a safetensors file of ``--tensors`` fp32 matrices (``--size-mib`` in all).
In one run, alternating over ``--reps``:

* ``slice``: every tensor's 3rd eighth of columns read through ``ckptbridge.open("s3://...")``;
  reported: bytes fetched from the server (the storage layer's counter) / bytes the slice needs
  (goal <= 1.1x).
* ``full``: every tensor read whole by ckptbridge, open included (``ckptbridge``: ``state_dict()``,
  whose copies run in rounds of many tensors, one concurrent fetch per object;
  ``ckptbridge-per-tensor``: one tensor after another, each split into concurrent ranged GETs of
  ``part_bytes``; ``ckptbridge-threads``: the tensors read from one thread each, as a loader
  would) vs s3fs ``cat`` of the same data objects (their list given, one call, s3fs's own
  concurrency); reported: s3fs time / ckptbridge time (goal >= 1x), checksums equal to the
  source file's. ``ckptbridge-one-get`` is ``state_dict()`` with ``part_bytes`` above the object
  size: one GET per object, the request count of ``cat``. The default (8 MiB parts, as boto3's
  transfer manager and the AWS CRT use) is made for real object stores, where one connection
  is the limit; moto on loopback serves every request from Python on the same cores, so there
  more parts cost more than they bring, and the two rows show by how much.

Timings are noisy on a shared machine: compare the ratios of one run, not absolute numbers.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_remote.py --size-mib 64 --reps 3
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

KEY = SECRET = "testing"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto(log) -> tuple[subprocess.Popen, str]:
    port = _port()
    env = dict(os.environ, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=log, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=2).close()
            return proc, url
        except urllib.error.HTTPError:
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--cols", type=int, default=65536,
                    help="columns per matrix (a row's 1/8 slice is cols/2 bytes: one ranged GET per row)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "remote.json"))
    args = ap.parse_args()

    import fsspec
    from safetensors.numpy import save_file

    import ckptbridge
    from ckptbridge import _storage as storage

    cols = args.cols
    rows = max(8, (args.size_mib << 20) // (args.tensors * cols * 4))
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as log:
        src = os.path.join(tmp, "model.safetensors")
        save_file({f"layer{i}.w": rng.standard_normal((rows, cols), dtype=np.float32)
                   for i in range(args.tensors)}, src)
        from safetensors.numpy import load_file

        loaded = load_file(src)
        sums: dict[str, int] = {"source": zlib.crc32(b"".join(loaded[f"layer{i}.w"].tobytes()
                                                              for i in range(args.tensors)))}
        del loaded
        proc, ep = _moto(log)
        try:
            opts = {"endpoint_url": ep, "key": KEY, "secret": SECRET,
                    "client_kwargs": {"region_name": "us-east-1"}}
            fs = fsspec.filesystem("s3", **opts, skip_instance_cache=True)
            import boto3

            boto3.client("s3", endpoint_url=ep, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                         region_name="us-east-1").create_bucket(Bucket="bench")
            storage.configure("s3://", **opts)
            url = "s3://bench/ckpt"
            t0 = time.perf_counter()
            ckptbridge.convert(src, url)
            print(f"uploaded through convert in {time.perf_counter() - t0:.2f} s", flush=True)
            data = sorted(f for f in fs.find("bench/ckpt/data"))
            total = sum(fs.size(f) for f in data)
            names = sorted(ckptbridge.open(url), key=lambda n: int(n[5:-2]))

            # 1/8 column slice: bytes fetched vs needed
            ckpt = ckptbridge.open(url)
            ckpt.stats.reset()
            c = cols // 8
            for n in names:
                ckpt[n][:, 3 * c : 4 * c]
            needed = len(names) * rows * c * 4
            slice_fetched = ckpt.stats.bytes_fetched
            slice_requests = ckpt.stats.requests

            # full read: ckptbridge vs s3fs cat, alternating
            times: dict[str, list[float]] = {"ckptbridge": [], "ckptbridge-one-get": [], "ckptbridge-per-tensor": [],
                                             "ckptbridge-threads": [], "s3fs-cat": []}
            pool = ThreadPoolExecutor(len(names))
            fetched, fetched_full = [0], 0

            def timed(row: str, read: Callable[[], list[np.ndarray]]) -> None:
                """Time ``read()`` (open included); its arrays must hold the source file's values."""
                t0 = time.perf_counter()
                arrays = read()
                times[row].append(time.perf_counter() - t0)
                sums[row] = zlib.crc32(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays))
                if sums[row] != sums["source"]:
                    raise SystemExit(f"{row} read other values than the source file holds")

            def whole() -> list[np.ndarray]:
                ck = ckptbridge.open(url)
                ck.stats.reset()
                sd = ck.state_dict()
                fetched[0] = ck.stats.bytes_fetched
                return [sd[n] for n in names]

            def per_tensor() -> list[np.ndarray]:
                ck = ckptbridge.open(url)
                return [ck[n].read() for n in names]

            def threads() -> list[np.ndarray]:
                ck = ckptbridge.open(url)
                return list(pool.map(lambda n: ck[n].read(), names))

            for _ in range(args.reps):
                timed("ckptbridge", whole)
                fetched_full = fetched[0]
                storage.configure("s3://", part_bytes=1 << 40)
                timed("ckptbridge-one-get", whole)
                storage.configure("s3://", part_bytes=ckptbridge.RemotePolicy.part_bytes)
                timed("ckptbridge-per-tensor", per_tensor)
                timed("ckptbridge-threads", threads)
                fs.invalidate_cache()
                t0 = time.perf_counter()
                blobs = fs.cat(data)
                times["s3fs-cat"].append(time.perf_counter() - t0)
                assert sum(len(b) for b in blobs.values()) == total
                del blobs
        finally:
            storage.unconfigure()
            proc.terminate()
            proc.wait(10)

    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "benchmark": "remote",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "server": "moto S3 server on 127.0.0.1 (s3fs over HTTP)",
        "size_bytes": total, "tensors": len(names), "shape": [rows, cols], "reps": args.reps,
        "slice_1_8": {"bytes_needed": needed, "bytes_fetched": slice_fetched, "requests": slice_requests,
                      "fetched_over_needed": round(slice_fetched / needed, 4)},
        "full_read": {"seconds": times, "median_s": med, "ckptbridge_bytes_fetched": fetched_full,
                      "s3fs_bytes": total,
                      "speed_ratio_s3fs_over_ckptbridge": round(med["s3fs-cat"] / med["ckptbridge"], 3),
                      "speed_ratio_s3fs_over_ckptbridge_one_get": round(med["s3fs-cat"] / med["ckptbridge-one-get"], 3),
                      "speed_ratio_s3fs_over_ckptbridge_per_tensor":
                          round(med["s3fs-cat"] / med["ckptbridge-per-tensor"], 3),
                      "speed_ratio_s3fs_over_ckptbridge_threads":
                          round(med["s3fs-cat"] / med["ckptbridge-threads"], 3)},
        "checksum_ckptbridge": sums["ckptbridge"], "checksum_source": sums["source"],
    }
    from _proc import save_result_at

    save_result_at(args.out, result)
    print(f"1/8 column slice: fetched {slice_fetched} B for {needed} B needed "
          f"({slice_fetched / needed:.3f}x, {slice_requests} requests)")
    print(f"full read of {total / 2**20:.0f} MiB: ckptbridge state_dict {med['ckptbridge']:.3f} s, s3fs cat "
          f"{med['s3fs-cat']:.3f} s (ckptbridge {med['s3fs-cat'] / med['ckptbridge']:.2f}x s3fs's speed); "
          f"one GET per object {med['ckptbridge-one-get']:.3f} s ({med['s3fs-cat'] / med['ckptbridge-one-get']:.2f}x); "
          f"one tensor after another {med['ckptbridge-per-tensor']:.3f} s "
          f"({med['s3fs-cat'] / med['ckptbridge-per-tensor']:.2f}x); "
          f"tensors read from {len(names)} threads {med['ckptbridge-threads']:.3f} s "
          f"({med['s3fs-cat'] / med['ckptbridge-threads']:.2f}x)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
