"""Fill megatron-core's own ``GPTModel`` module from any checkpoint through rules; dump its logits.

Needs only megatron-core (PyPI). One gloo rank on CPU (``tools/megatron/cpu_shim.py``, with its
pure-torch ``grouped_gemm`` for the legacy ``GroupedMLP`` of ``moe_grouped_gemm=True``, which
megatron-core runs in bf16 only). For each ``ARGS,RULES=OUT`` item the model is built from the
Megatron args JSON as ``core_loss.py`` builds it (local spec, TP 1, PP 1; an MTP block with
``mtp_num_layers``), then ``ckptbridge.adapters.torch.load_into(state, source, rules, strict=True)``
fills every tensor of the module's ``state_dict`` in place (its own names: ``mlp.experts.weight1``
for a GroupedMLP; the local spec's ``_extra_state`` entries are ``None``, not tensors) and reports
any tensor the rules give that has no place; the logits of GPTModel's forward on the tokens
(``core_loss.logits``) are saved to ``OUT`` (``.npy``, fp32 ``[batch, seq, vocab]``). Prints one
line per item, ``CORE_MODULE {"rules", "out", "unplaced" | "error", "experts"}`` (``experts``: the
class of the first MoE layer's experts)::

    python tools/megatron/core_module.py --source hf_dir --tokens t.npy args.json,rules.json=logits.npy
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def run_item(model: Any, source: str, rules_file: str, tokens: Any, out: str) -> dict[str, Any]:
    """Fill ``model`` from ``source`` seen through the rules in ``rules_file``; its logits to ``out``."""
    import numpy as np
    import torch
    from core_loss import logits

    from ckptbridge.adapters import torch as cbt

    rec: dict[str, Any] = {"rules": rules_file, "out": out}
    try:
        with open(rules_file) as fh:
            rules = json.load(fh)
        state = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("._extra_state")}
        rec["unplaced"] = cbt.load_into(state, source, rules, strict=True)
    except Exception as e:  # reported, the next item still runs
        traceback.print_exc()
        return {**rec, "error": f"{type(e).__name__}: {e}"}
    seq = tokens.shape[1]
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1),  # labels: only an MTP block reads them
             "attention_mask": torch.tril(torch.ones(1, 1, seq, seq)) < 0.5,  # True = masked (causal), as core_loss.py
             "position_ids": torch.arange(seq).unsqueeze(0).expand(tokens.shape[0], seq).contiguous()}
    np.save(out, logits(model, [batch]))
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("items", nargs="+", help="ARGS.json,RULES.json=OUT.npy (Megatron args as recipes.megatron_args "
                                             "gives them, rules as rules_to_json)")
    ap.add_argument("--source", required=True, help="anything ckptbridge.open reads")
    ap.add_argument("--tokens", required=True, help="int tokens [batch, seq] (.npy)")
    opts = ap.parse_args(argv)
    os.environ.setdefault("MEGATRON_CPU_SHIM_GG", "1")
    sys.path.insert(0, HERE)
    import cpu_shim  # patches torch.cuda for CPU before megatron is imported

    cpu_shim.patch_megatron_rng()
    cpu_shim.patch_moe_no_te()
    import numpy as np
    import torch
    from core_loss import _revive, build_model
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    tokens = torch.as_tensor(np.load(opts.tokens).astype(np.int64))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        model_parallel_cuda_manual_seed(1234)
        for item in opts.items:
            files, _, out = item.rpartition("=")
            args_file, _, rules_file = files.partition(",")
            with open(args_file) as fh:
                args = argparse.Namespace(**{k: _revive(v) for k, v in json.load(fh).items()})
            model = build_model(args, 1, 1)
            experts = next((type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts")), None)
            rec = run_item(model, opts.source, rules_file, tokens, out)
            print("CORE_MODULE " + json.dumps({**rec, "experts": experts}), flush=True)
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
