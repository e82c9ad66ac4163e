"""Fuzz every reader with mutated and truncated copies of real checkpoints.

    python tools/fuzz_readers.py SEED_CKPT [SEED_CKPT ...] --cases 1000 [--seed 0] [--time-limit 10]

Each case copies one seed checkpoint (a file or a directory) into a scratch
directory, damages one of its files (truncate, flip bytes, overwrite a run,
insert junk, inflate numbers in JSON headers, or rewrite a member of a zip
archive such as a torch pickle), then opens it with ``ckptbridge.open`` and
reads every state of every tensor. A case passes when it ends normally or in
a ``ckptbridge.CheckpointError`` whose message names a file of the scratch
copy, within the time limit, under an address-space limit (so a header that
claims terabytes cannot be honoured). Exit status 1 lists the failing cases.
Seeded: the same arguments replay the same cases.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
import zipfile


class CaseTimeout(Exception):
    pass


def _files(root: str) -> list[str]:
    if os.path.isfile(root):
        return [root]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def _mutate_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    n = len(data)
    kind = rng.choice(["truncate", "flip", "overwrite", "insert", "numbers", "zero_tail"])
    if n == 0:
        return b"\x00" * rng.randint(1, 64), "grow-empty"
    if kind == "truncate":
        cut = rng.randrange(n)
        return data[:cut], f"truncate@{cut}"
    if kind == "flip":
        buf = bytearray(data)
        spots = [rng.randrange(n) for _ in range(rng.randint(1, 8))]
        for s in spots:
            buf[s] ^= 1 << rng.randrange(8)
        return bytes(buf), f"flip@{spots}"
    if kind == "overwrite":
        at, ln = rng.randrange(n), rng.randint(1, 64)
        junk = bytes(rng.randrange(256) for _ in range(ln))
        return data[:at] + junk + data[at + ln :], f"overwrite@{at}+{ln}"
    if kind == "insert":
        at = rng.randrange(n)
        return data[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 32))) + data[at:], f"insert@{at}"
    if kind == "numbers":  # make a length/shape/offset in a text header enormous
        matches = list(re.finditer(rb"\d+", data[: 1 << 20]))
        if not matches:
            return data[: n // 2], "truncate-half"
        m = rng.choice(matches)
        big = rng.choice([b"99999999999999", b"4294967296", b"0", b"18446744073709551615", b"-1"])
        return data[: m.start()] + big + data[m.end() :], f"number@{m.start()}={big.decode()}"
    cut = rng.randrange(n)
    return data[:cut] + b"\x00" * (n - cut), f"zero-tail@{cut}"


def _mutate_zip_member(path: str, rng: random.Random) -> str:
    """Damage one member of a zip (torch) archive and rewrite it with valid CRCs,
    so the damage reaches the pickle parser instead of stopping at the zip layer."""
    with zipfile.ZipFile(path) as zf:
        members = [(i, zf.read(i.filename)) for i in zf.infolist()]
    pick = [k for k, (i, _) in enumerate(members) if i.filename.endswith(".pkl")] or list(range(len(members)))
    k = rng.choice(pick)
    info, data = members[k]
    new, how = _mutate_bytes(data, rng)
    members[k] = (info, new)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as out:
        for i, d in members:
            out.writestr(i.filename, d)
    with open(path, "wb") as fh:
        fh.write(buf.getvalue())
    return f"zip:{info.filename}:{how}"


def mutate(root: str, rng: random.Random) -> str:
    files = _files(root)
    target = rng.choice(files)
    with open(target, "rb") as fh:
        head = fh.read(4)
    if head == b"PK\x03\x04" and rng.random() < 0.6:
        how = _mutate_zip_member(target, rng)
    else:
        with open(target, "rb") as fh:
            data = fh.read()
        new, how = _mutate_bytes(data, rng)
        with open(target, "wb") as fh:
            fh.write(new)
    return f"{os.path.relpath(target, os.path.dirname(root))}: {how}"


def read_everything(path: str) -> None:
    import ckptbridge

    ckpt = ckptbridge.open(path)
    for name in ckpt:
        view = ckpt[name]
        for state in view.states:
            view.state(state).read()
    ckpt.close()


def run_case(seed_path: str, rng: random.Random, scratch: str, time_limit: float) -> str | None:
    """None when the case passed, else a description of the failure."""
    import ckptbridge

    dst = os.path.join(scratch, os.path.basename(seed_path.rstrip("/")))
    if os.path.isdir(seed_path):
        shutil.copytree(seed_path, dst)
    else:
        shutil.copyfile(seed_path, dst)
    how = mutate(dst, rng)
    signal.setitimer(signal.ITIMER_REAL, time_limit)
    try:
        read_everything(dst)
        return None
    except CaseTimeout:
        return f"{how}: no answer within {time_limit}s"
    except ckptbridge.CheckpointError as err:
        if scratch not in str(err):
            return f"{how}: error does not name the file: {err}"
        return None
    except MemoryError:
        return f"{how}: MemoryError (a size was not checked against the file)"
    except Exception:
        return f"{how}: {traceback.format_exc(limit=6)}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        shutil.rmtree(dst, ignore_errors=True) if os.path.isdir(dst) else os.path.exists(dst) and os.remove(dst)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seeds", nargs="+", help="real checkpoints (files or directories) to mutate")
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per case")
    ap.add_argument("--memory-gib", type=float, default=4.0, help="address-space limit for this process")
    args = ap.parse_args(argv)
    limit = int(args.memory_gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def on_alarm(*_: object) -> None:
        raise CaseTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    rng = random.Random(args.seed)
    failures: list[str] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ckptbridge-fuzz-") as scratch:
        for case in range(args.cases):
            seed_path = args.seeds[case % len(args.seeds)]
            problem = run_case(seed_path, random.Random(rng.random()), scratch, args.time_limit)
            if problem:
                failures.append(f"case {case} ({os.path.basename(seed_path)}) {problem}")
    print(f"{args.cases} cases over {len(args.seeds)} seed checkpoints in {time.monotonic() - t0:.1f}s: "
          f"{len(failures)} failed")
    for f in failures[:50]:
        print(f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
