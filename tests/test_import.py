"""`import ckptbridge` must not pull in torch or jax (checked in a fresh interpreter)."""

import subprocess
import sys


def test_import_is_framework_free():
    code = (
        "import sys, ckptbridge, ckptbridge._cli, ckptbridge._formats.universal, ckptbridge._formats.convert\n"
        "bad = [m for m in ('torch', 'jax', 'jaxlib', 'deepspeed', 'flax', 'orbax') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import ckptbridge imported {out.stdout.strip()}"


def test_opening_a_safetensors_file_imports_no_framework(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.ones((2, 3), np.float32)}, str(tmp_path / "w.safetensors"))
    code = (
        "import sys, ckptbridge\n"
        f"c = ckptbridge.open({str(tmp_path / 'w.safetensors')!r}); c['w'][:]\n"
        "print(','.join(m for m in ('torch', 'jax') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_plugin_interface_does_not_load_the_checkpointer():
    """Every adapter imports ``ckptbridge.plugin`` when ``open`` detects a format: it must not pull
    in the Checkpointer (threads, host buffers, restore) nor ``statistics``/``fractions``, which
    only saving and the watchdog use (~0.1 s of import on a 2-core machine, paid by every open)."""
    code = (
        "import sys, ckptbridge.plugin\n"
        "print(','.join(m for m in ('ckptbridge._checkpointer.core', 'ckptbridge._checkpointer.restore',\n"
        "                          'statistics', 'fractions') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", out.stdout
