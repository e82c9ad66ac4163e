"""Run a function on N local processes joined in a gloo process group (CPU).

Used by the torch tests: ``run(fn, 4, arg)`` starts 4 processes (spawn),
initialises ``torch.distributed`` with gloo on a free port, calls
``fn(rank, world_size, arg)`` in each, and returns the ranks' return values
(they must be picklable). An exception on any rank fails the call with that
rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

from _common import free_port


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    # a rank that fails leaves the others waiting in a collective: let them time out
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    try:
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)
    if result[0] == "ok":
        dist.barrier()
    dist.destroy_process_group()


def run(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo processes; their results by rank."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(fn, world, free_port(), out, args), nprocs=world,
                                 join=False, start_method="spawn")
        errors: list[str] = []
        try:
            while not ctx.join(timeout=600):
                pass
        except mp.ProcessRaisedException as err:
            errors.append(str(err))
        except mp.ProcessExitedException as err:
            errors.append(str(err))
        results = []
        for r in range(world):
            path = os.path.join(out, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r} left no result")
                continue
            with open(path, "rb") as fh:
                status, value = pickle.load(fh)
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            results.append(value)
        if errors:
            raise AssertionError("\n".join(errors))
        return results
