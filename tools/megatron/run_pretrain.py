"""Run Megatron-LM's own pretrain_gpt.py (tag core_v0.16.1) on CPU/gloo with the patches in cpu_shim.py.

Usage (in the Megatron venv, see setup.sh):
    MEGATRON_CPU_SHIM=1 torchrun --nproc_per_node N tools/megatron/run_pretrain.py <pretrain_gpt.py args>
"""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cpu_shim  # noqa: E402

cpu_shim.install()
MLM = os.environ.get("MEGATRON_LM_DIR") or os.path.join(HERE, "..", "..", "third_party", "mlm")
sys.argv = [os.path.join(MLM, "pretrain_gpt.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
