#!/usr/bin/env python
"""Run one of Megatron-LM's own scripts on CPU, with tools/megatron/cpu_shim.py installed first.

    python bench/_megatron_launch.py third_party/mlm/tools/checkpoint/convert.py --model-type GPT ...

The shim (read it: it lets megatron-core 0.16.1 and Megatron-LM's training code run on a CPU
torch with gloo, and patches three megatron-core bugs of the distributed optimizer) is
installed in this process; processes it forks inherit it. ``$MEGATRON_EXTRA_ARGS`` is appended
to every Megatron-LM argument parse (``parse_args``): Megatron's checkpoint converter builds
its own argument list, which turns on kernel fusions a CPU cannot run (RoPE fusion needs
Transformer Engine); ``--no-rope-fusion`` and friends choose the unfused kernels, same math.
For ``tools/checkpoint/convert.py --loader core`` the converter's bugs at this tag are worked
around (see below: a one-line return, the process groups it does not set up, and the saver's
check for Transformer Engine, a CUDA library, although it is told to use the local layers). Megatron-LM's source (tag
core_v0.16.1) is expected in ``third_party/mlm`` (or ``$MEGATRON_LM_DIR``): see bench/README.md.
"""

from __future__ import annotations

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    sys.path.insert(0, os.path.join(ROOT, "tools", "megatron"))
    import cpu_shim

    cpu_shim.install()
    extra = os.environ.get("MEGATRON_EXTRA_ARGS", "").split()
    if extra:
        import megatron.training.arguments as margs

        parse = margs.parse_args

        def parse_args(*args, **kwargs):
            sys.argv = [*sys.argv, *(a for a in extra if a not in sys.argv)]
            return parse(*args, **kwargs)

        margs.parse_args = parse_args
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, os.path.dirname(script))
    if os.path.basename(script) == "convert.py" and "core" in sys.argv:
        # Megatron-LM bug (tools/checkpoint/loader_core.py, core_v0.16.1 and still at its main branch):
        # import_model_provider() builds partial(model_provider, gpt_builder) into self.model_provider
        # but returns the bare model_provider, which then fails with "missing 1 required positional
        # argument: 'model_builder'". Return the partial it built.
        import loader_core

        cls = loader_core.MegatronCheckpointLoaderLLM
        orig = cls.import_model_provider

        def import_model_provider(self):
            bare = orig(self)
            return getattr(self, "model_provider", None) or bare

        cls.import_model_provider = import_model_provider
        # Megatron-LM bug (NVIDIA/Megatron-LM issues #3080, #3132; open fix PR #7027): the converter
        # runs in one process without initialize_model_parallel, fakes only the TP/EP groups, and
        # megatron-core's GPTModel asks for the data-parallel groups too (AssertionError "Intra
        # partial data parallel group is not initialized"), the saver's save_checkpoint for the
        # pipeline and expert-data-parallel groups (only their rank and size; the file names come
        # from the ranks the saver sets). Fake every group it leaves unset, as PR #7027 does: size 1
        # (the converter is one process).
        from megatron.core import parallel_state as ps
        from utils import _ConverterFakeProcessGroup

        for name in dir(ps):
            if name.startswith("_") and name.endswith(("_GROUP", "_GROUP_GLOO", "_GROUP_WITH_CP")) \
                    and getattr(ps, name) is None:
                setattr(ps, name, _ConverterFakeProcessGroup(size=1))
        # ... and megatron-core 0.16.1 reads a group's size only when torch.distributed is
        # initialised (megatron.core.utils.get_pg_size returns 1 otherwise), so without it the
        # converter builds every TP rank's model at TP=1 shapes and the load fails ("size
        # mismatch"). A one-process gloo group (file store: the forked saver inherits it).
        import tempfile

        # The saver asserts that Transformer Engine (a CUDA library) is installed, even with
        # --saver-transformer-impl local; skip that check (the sys.path part is kept).
        import saver_base
        import torch.distributed as dist

        def insert_megatron_path(self):
            sys.path.append(os.path.abspath(os.path.join(os.path.dirname(saver_base.__file__), "..", "..")))
            if self.args.megatron_path is not None:
                sys.path.insert(0, self.args.megatron_path)

        saver_base.MegatronCheckpointSaverBase.insert_megatron_path_and_check_te = insert_megatron_path
        store = os.path.join(tempfile.mkdtemp(prefix="mlm-convert-"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        # ... in a world of one, a barrier has nobody to wait for; gloo's, called in the forked
        # saver (save_checkpoint), would hang on the parent's connections: make it a no-op.
        dist.barrier = lambda *a, **k: None
    runpy.run_path(script, run_name="__main__")
