"""megatron-core's own gathered state of ``torch_dist`` checkpoints, dumped to ``.npz`` (a test reference).

Needs only megatron-core (PyPI). For each ``CKPT=OUT.npz`` pair, megatron-core's
``dist_checkpointing.load_plain_tensors`` (one gloo rank, CPU) loads every sharded tensor of the
checkpoint as one global tensor, placing each shard at the global offsets megatron-core's own
``sharded_state_dict`` code gave it when saving (experts: ``ep_rank * num_local + local index``), and
the result is written with numpy, keys unchanged (``decoder.layers.mlp.experts.experts.linear_fc1.weight``
``[layers, experts, ...]``, ``optimizer.state.exp_avg.<key>`` ...); bf16 tensors as their int16 bit
patterns, so comparisons are bitwise::

    python tools/megatron/core_plain.py run/torch_dist=/tmp/ref.npz
"""

from __future__ import annotations

import os
import socket
import sys


def _iter_dir(path: str) -> str:
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    if os.path.isfile(tracker):
        with open(tracker) as fh:
            return os.path.join(path, f"iter_{int(fh.read().strip()):07d}")
    return path


def main(pairs: list[str]) -> None:
    import numpy as np
    import torch
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        for pair in pairs:
            ckpt, _, out = pair.rpartition("=")
            sd = load_plain_tensors(_iter_dir(ckpt))
            arrays = {k: (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
                      for k, t in sd.items() if torch.is_tensor(t)}
            np.savez(out, **arrays)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
