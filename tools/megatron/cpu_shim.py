# ruff: noqa: E402
"""(Copied from the fixture tools of tests/fixtures/megatron, made by the ckptbridge team; the
Megatron-LM path now comes from $MEGATRON_LM_DIR, default <repo>/third_party/mlm.)

Minimal monkeypatches that let megatron-core 0.16.1 (and Megatron-LM's training
checkpointing code at tag core_v0.16.1) run on a CPU-only torch build with the gloo
backend.  Import this module BEFORE importing anything from megatron.

Every patch is listed in PATCHES (printed by rank 0) so the report can cite them.
"""
import os
import sys

# torch.compile (megatron.core.jit.jit_fuser) would try inductor with our fake CUDA: run eagerly.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
import torch

PATCHES = ["env TORCHDYNAMO_DISABLE=1 (jit_fuser/torch.compile run eagerly)"]


def _patch(obj, name, value, why):
    setattr(obj, name, value)
    PATCHES.append(f"{getattr(obj, '__name__', obj)}.{name}: {why}")


# 1. Megatron sprinkles `device=torch.cuda.current_device()` everywhere (rotary
#    inv_freq, activation buffers, p2p recv buffers, DDP buffers...).  On a CPU build
#    torch.cuda.current_device() raises.  Returning the string 'cpu' makes all those
#    call sites allocate on CPU instead.
_patch(torch.cuda, "current_device", lambda: "cpu", "return 'cpu' so device=... args allocate on CPU")
_patch(torch.cuda, "synchronize", lambda *a, **k: None, "no-op")
_patch(torch.cuda, "set_device", lambda *a, **k: None, "no-op")
_patch(torch.cuda, "device_count", lambda: 1, "pretend 1 device (Megatron-LM init asserts >0)")
_patch(torch.cuda, "empty_cache", lambda: None, "no-op")
# A stand-in for the CUDA default generator, separate from the CPU one (as on a GPU box):
# draws that Megatron makes on device="cuda" (e.g. Megatron-LM's _warmup_jit_function
# torch.rand(..., device="cuda"), sized by TP!) must not advance the CPU generator that
# --use-cpu-initialization uses for weights, or the init would depend on TP.
CUDA_GEN = torch.Generator()
CUDA_GEN.manual_seed(67280421310721)
_patch(torch.cuda, "manual_seed", lambda s: CUDA_GEN.manual_seed(int(s)), "seeds the stand-in CUDA generator")
_patch(torch.cuda, "manual_seed_all", lambda s: CUDA_GEN.manual_seed(int(s)), "seeds the stand-in CUDA generator")
_patch(torch.cuda, "get_rng_state", lambda device=None: CUDA_GEN.get_state(),
       "state of the stand-in CUDA generator (saved as cuda_rng_state in checkpoints)")
_patch(torch.cuda, "set_rng_state", lambda st, device=None: CUDA_GEN.set_state(st), "stand-in CUDA generator")
torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
torch.cuda.random.set_rng_state = torch.cuda.set_rng_state
_patch(torch.cuda, "max_memory_allocated", lambda *a, **k: 0, "report 0")
_patch(torch.cuda, "memory_allocated", lambda *a, **k: 0, "report 0")
_patch(torch.cuda, "memory_reserved", lambda *a, **k: 0, "report 0")
_patch(torch.cuda, "max_memory_reserved", lambda *a, **k: 0, "report 0")


def patch_megatron_rng():
    """CudaRNGStatesTracker stores/restores CUDA generator states through private
    helpers; redirect them to the stand-in CUDA generator.  (Its fork() then only affects
    draws made with that generator; all dropout here is 0.)"""
    import megatron.core.tensor_parallel.random as R

    _patch(R, "_get_cuda_rng_state",
           lambda device="cuda", clone=False, graph_safe=False: CUDA_GEN.get_state(),
           "stand-in CUDA generator state")
    _patch(R, "_set_cuda_rng_state",
           lambda new_state, device=-1, graph_safe=False: CUDA_GEN.set_state(new_state),
           "stand-in CUDA generator state")


# 2. Many call sites hardcode device="cuda" / tensor.cuda() / .to("cuda")
#    (causal mask, grad scaler, clip_grads, schedules' token counter, ...).  A global
#    TorchFunctionMode rewrites any CUDA device argument to CPU.
from torch.overrides import TorchFunctionMode


def _is_cuda_dev(d):
    if isinstance(d, str):
        return d.startswith("cuda")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return False


_RANDOM_FACTORIES = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal}


class CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type:
            # clip_grads asserts grad.type() == 'torch.cuda.FloatTensor'
            if len(args) == 1 and not kwargs:
                r = func(*args)
                return r.replace("torch.", "torch.cuda.", 1) if r.startswith("torch.") and ".cuda." not in r else r
            args = tuple(a.replace("torch.cuda.", "torch.") if isinstance(a, str) else a for a in args)
        if "device" in kwargs and (_is_cuda_dev(kwargs["device"]) or isinstance(kwargs["device"], int)):
            kwargs["device"] = "cpu"
            if func in _RANDOM_FACTORIES and kwargs.get("generator") is None:
                kwargs["generator"] = CUDA_GEN
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_dev(a) else a for a in args)
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


_MODE = CudaToCpuMode()
_MODE.__enter__()
PATCHES.append("torch: global TorchFunctionMode rewriting device='cuda'/.cuda()/.to('cuda')/pin_memory to CPU; Tensor.type() reports torch.cuda.* names; random factories on 'cuda' draw from the stand-in CUDA generator")


# 3. Megatron-LM's megatron/training/initialize.py imports
#    megatron.core.transformer.custom_layers.batch_invariant_kernels, which does a bare
#    `import triton` (not installed with CPU torch).  Register a stand-in module exposing
#    the one name it imports; it is only called with --batch-invariant-mode (unused).
import sys as _sys
import types as _types

_bik = _types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")


def _no_bik(*a, **k):
    raise RuntimeError("batch-invariant kernels need triton/CUDA")


_bik.enable_batch_invariant_mode = _no_bik
_bik.is_batch_invariant_mode_enabled = lambda: False
_sys.modules[_bik.__name__] = _bik
PATCHES.append("sys.modules: stand-in for megatron.core...batch_invariant_kernels (needs triton)")


def pretend_cuda_available():
    """Megatron-LM's initialize_megatron() asserts torch.cuda.is_available()."""
    _patch(torch.cuda, "is_available", lambda: True, "Megatron-LM initialize asserts it")
    _patch(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0), "pretend sm90")
    _patch(torch.cuda, "is_bf16_supported", lambda *a, **k: True, "")
    import types
    props = types.SimpleNamespace(major=9, minor=0, name="fake-cpu", total_memory=24 << 30,
                                  multi_processor_count=2)
    _patch(torch.cuda, "get_device_properties", lambda *a, **k: props, "fake sm90 props")
    _patch(torch.cuda, "get_device_name", lambda *a, **k: "fake-cpu", "")


def patch_moe_without_te():
    """megatron/core/transformer/moe/moe_utils.py (v0.16.1): RouterGatingLinearFunction tests
    ``te_general_gemm is not None`` but the name is only bound when Transformer Engine imports, so
    the MoE router raises NameError without TE. Bind it to None (the plain torch matmul path)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        _patch(moe_utils, "te_general_gemm", None, "bind the TE gemm to None without TE (router's torch path)")


def patch_distopt_state_dict():
    """megatron/core/optimizer/distrib_optimizer.py:640-642 (v0.16.1): without Apex/TE,
    DistributedOptimizer.state_dict() collects 'step' from the torch Adam state and asserts
    len(steps) == 1, which fails on a FRESH optimizer (empty lazy state) -- exactly the
    situation when resuming/converting from a checkpoint.  Materialise the state first with
    Megatron's own _init_optimizer_states_with_dummy_values() (zero-grad step at lr=0;
    everything is overwritten by the checkpoint load that follows)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO
    orig = DO.state_dict

    def state_dict(self):
        if len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        return orig(self)

    _patch(DO, "state_dict", state_dict, "init empty torch-Adam state before state_dict() (no Apex/TE path)")


def patch_distopt_load():
    """Two more DistributedOptimizer LOAD bugs in megatron-core 0.16.1 on the native-torch-Adam
    (no Apex/TE) path; GPU users with TE/Apex never reach this code.
    (2) distrib_optimizer.py:936-940 _set_main_param_and_optimizer_states copies EVERY key of the
        torch-Adam state (incl. 'step') from the source dict:  fully_reshardable load drops
        'step' (line ~2104) -> KeyError: 'step'; dp_reshardable load passes the *template*
        'step' (never stored as a tensor) and thereby overwrites the real step.  It also runs
        without no_grad in the dp_reshardable path (line ~1804), so with fp32 params (main param
        = view of the model param) -> "a view of a leaf Variable that requires grad is being
        used in an in-place operation".  Fix: copy param/exp_avg/exp_avg_sq only, under no_grad;
        'step' is restored by load_state_dict() from the checkpoint's param_groups.
    (3) distrib_optimizer.py:818-825 load_state_dict gives ALL params the SAME 'step' tensor;
        torch Adam increments it in place once per param per iteration, so after a resume
        step jumps by #params per iteration (3 -> 31 after 2 iterations with 14 params) and
        the bias correction is wrong.  Fix: give every param its own clone."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO
    orig_set = DO._set_main_param_and_optimizer_states
    orig_load = DO.load_state_dict

    def _set(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return orig_set(self, model_param, tensors)
        gi, go = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[gi]["params"][go]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():
            for k in dst:
                if k != "step":
                    dst[k].copy_(tensors[k])

    def load_state_dict(self, state_dict):
        r = orig_load(self, state_dict)
        for st in self.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()
        return r

    _patch(DO, "_set_main_param_and_optimizer_states", _set,
           "copy param/exp_avg/exp_avg_sq only (not torch-Adam 'step'), under no_grad")
    _patch(DO, "load_state_dict", load_state_dict, "un-share the single 'step' tensor given to all params")


def patch_megatron_training():
    """Patches for Megatron-LM's megatron/training (call after sys.path has mlm)."""
    import megatron.core.datasets.utils as du
    # The pip wheel ships a prebuilt helpers_cpp*.so but no Makefile, so `make -C` fails.
    _patch(du, "compile_helpers", lambda: None, "wheel already ships helpers_cpp .so")
    import megatron.legacy.fused_kernels as fk
    # Legacy fused kernels need nvcc; mcore models do not use them.
    _patch(fk, "load", lambda args: None, "needs nvcc; unused by mcore local spec")


# 4. CUDA streams/events used by Megatron-LM's get_model (DDP side stream), timers,
#    DDP communication stream: CPU has one implicit "stream"; make them inert.
import contextlib as _contextlib
import time as _time


class FakeStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, event=None):
        return event or FakeEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class FakeEvent:
    def __init__(self, *a, **k):
        self.t = None

    def record(self, *a, **k):
        self.t = _time.time()

    def synchronize(self):
        pass

    def wait(self, *a, **k):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 1000.0 * ((other.t or 0) - (self.t or 0))


_patch(torch.cuda, "Stream", FakeStream, "inert stream object")
_patch(torch.cuda, "Event", FakeEvent, "wall-clock event")
_patch(torch.cuda, "current_stream", lambda *a, **k: FakeStream(), "inert")
_patch(torch.cuda, "default_stream", lambda *a, **k: FakeStream(), "inert")
_patch(torch.cuda, "stream", lambda s=None: _contextlib.nullcontext(), "nullcontext")
_patch(torch.cuda, "set_stream", lambda *a, **k: None, "no-op")


_INSTALLED = False


def install():
    """Everything needed to run Megatron-LM's training/checkpointing on CPU.
    Called from venv/.../megatron_cpu_shim.pth when MEGATRON_CPU_SHIM=1, so that every
    Python process (torchrun workers and the multiprocessing 'spawn' children used by
    dist_checkpointing's writer) gets the same patches."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    here = os.path.dirname(os.path.abspath(__file__))
    mlm = os.environ.get("MEGATRON_LM_DIR") or os.path.join(here, "..", "..", "third_party", "mlm")
    if mlm not in sys.path:
        sys.path.append(mlm)  # after site-packages: megatron.core from pip, megatron.training from mlm
    patch_megatron_rng()
    patch_distopt_state_dict()
    patch_distopt_load()
    if os.environ.get("MEGATRON_CPU_SHIM_TRAINING", "1") == "1":
        pretend_cuda_available()
        patch_megatron_training()
