"""Drive ``tools/maxtext/harness.py`` (MaxText 0.2.5 in ``.maxtext/venv``, Python 3.12) from the
3.11 test venv: files in and out, numpy back.

::

    import maxtext_client as mx
    spec = mx.spec_from_hf(json.load(open(hf_dir / "config.json")), scan=True)
    res = mx.run_jobs([
        mx.convert_job(spec, hf_dir, work / "mt.safetensors"),
        mx.forward_job(spec, work / "mt.safetensors", work / "tokens.npy", work / "logits.npy"),
    ])
    logits = np.load(work / "logits.npy")
    params = mx.read_params(work / "mt.safetensors")     # {"decoder/layers/...": ndarray}

MaxText imports in ~10 s of CPU, so :func:`run_jobs` sends each batch to one harness process
(``harness.py serve``) kept for the whole session (per script and device count; each batch still
gets a fresh model cache), closed when this process exits. The venv comes from ``make
maxtext-venv`` (``tools/maxtext/setup.sh``); ``MAXTEXT_PYTHON`` points elsewhere.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tools" / "maxtext" / "harness.py"

# MaxText's LLaMARotaryEmbedding hard-codes these llama3 scaling constants (maxtext 0.2.5)
_LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


class HarnessError(RuntimeError):
    """The MaxText harness failed; the message carries the end of its output."""


def python() -> Path:
    """The interpreter of the MaxText venv."""
    return Path(os.environ.get("MAXTEXT_PYTHON", ROOT / ".maxtext" / "venv" / "bin" / "python"))


def spec_from_hf(cfg: dict[str, Any], *, scan: bool = True, mesh: dict[str, int] | None = None,
                 batch: int = 8, seq: int = 16) -> dict[str, Any]:
    """The harness spec of the MaxText model equivalent to a Hugging Face ``config.json``.

    Llama with llama3 rope scaling maps to MaxText ``rope_type=llama3.1`` (only with the
    scaling constants MaxText hard-codes); everything else to ``rope_type=default``.
    """
    family = cfg["model_type"]
    if family in FAMILY_SPECS:
        return FAMILY_SPECS[family](cfg, scan=scan, mesh=mesh, batch=batch, seq=seq)
    if family not in ("llama", "mistral", "qwen2", "mixtral", "qwen3", "qwen3_moe"):
        raise ValueError(f"model_type {family!r} has no MaxText counterpart here")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope_kind == "llama3":
        off = {k: rope.get(k) for k, v in _LLAMA3.items() if float(rope.get(k, -1)) != v}
        if off:
            raise ValueError(f"llama3 rope scaling {off}: MaxText hard-codes {_LLAMA3}")
        rope_type = "llama3.1"
    elif rope_kind == "default":
        rope_type = "default"
    else:
        raise ValueError(f"rope type {rope_kind!r} is not supported by the harness")
    heads = cfg["num_attention_heads"]
    spec = {
        "family": family,
        "emb": cfg["hidden_size"],
        "layers": cfg["num_hidden_layers"],
        "heads": heads,
        "kv_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "mlp": cfg["intermediate_size"],
        "vocab": cfg["vocab_size"],
        "scan": scan,
        "rope_type": rope_type,
        "rope_theta": float(theta),
        "norm_eps": float(cfg["rms_norm_eps"]),
        "tied": bool(cfg.get("tie_word_embeddings", False)),
        "batch": batch,
        "seq": seq,
    }
    if mesh is not None:
        spec["mesh"] = dict(mesh)
    if family == "mixtral":
        spec["experts"] = cfg["num_local_experts"]
        spec["experts_per_tok"] = cfg["num_experts_per_tok"]
    if family == "qwen3_moe":  # every layer MoE: MaxText's mlp dim is the experts'
        spec |= {"experts": cfg.get("num_experts", cfg.get("num_local_experts")), "experts_per_tok": cfg["num_experts_per_tok"],
                 "mlp": cfg["moe_intermediate_size"], "norm_topk_prob": bool(cfg["norm_topk_prob"])}
    return spec


# ------------------------------------------------------------------ jobs (see harness.py)


def tree_job(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    return {"cmd": "tree", "spec": spec, "out": str(out)}


def convert_job(spec: dict[str, Any], hf_dir: Path, out: Path, *, report: Path | None = None,
                from_unscanned: bool = False) -> dict[str, Any]:
    job = {"cmd": "convert-hf", "spec": spec, "hf_dir": str(hf_dir), "out": str(out),
           "from_unscanned": from_unscanned}
    if report is not None:
        job["report"] = str(report)
    return job


def to_hf_job(spec: dict[str, Any], params: Path, hf_config: Path, out: Path,
              prefix: str = "") -> dict[str, Any]:
    """MaxText's own MaxText->HF conversion into ``out/`` (``model.safetensors`` + ``config.json``);
    ``prefix`` picks ``mu/`` or ``nu/`` out of a ``train`` optimizer-state file."""
    return {"cmd": "convert-to-hf", "spec": spec, "params": str(params), "hf_config": str(hf_config),
            "out": str(out), "prefix": prefix}


def forward_job(spec: dict[str, Any], params: Path, tokens: Path, out: Path,
                state: str | None = None) -> dict[str, Any]:
    job = {"cmd": "forward", "spec": spec, "params": str(params), "tokens": str(tokens), "out": str(out)}
    if state:
        job["state"] = state
    return job


def train_job(spec: dict[str, Any], params: Path, tokens: Path, out: Path, steps: int, *,
              opt_state: Path | None = None, mu: Path | None = None, nu: Path | None = None,
              count: int | None = None, **adamw: float) -> dict[str, Any]:
    """Optimizer state: ``opt_state`` (a harness ``train`` output) or ``mu`` + ``nu`` (params
    files, e.g. moments converted by ``convert-hf``) + ``count``. ``adamw``: lr, b1, b2, eps,
    wd (harness defaults 1e-3, 0.9, 0.95, 1e-8, 0.1)."""
    job = {"cmd": "train", "spec": spec, "params": str(params), "tokens": str(tokens),
           "out": str(out), "steps": steps, **adamw}
    if opt_state is not None:
        job["opt_state"] = str(opt_state)
    if mu is not None or nu is not None:
        job |= {"mu": str(mu), "nu": str(nu), "count": count}
    return job


def load_job(spec: dict[str, Any], source: Path, rules: Any, *, opt: bool = False, dump: Path | None = None,
             tokens: Path | None = None, logits: Path | None = None, train_tokens: Path | None = None,
             steps: int = 0, train_out: Path | None = None, update_scale: dict[str, float] | None = None,
             save_universal: Path | None = None, report: Path | None = None,
             open_options: dict[str, Any] | None = None, **adamw: float) -> dict[str, Any]:
    """``source`` (anything ckptbridge opens, with ``open_options``: ``{"dequantize_dtype": "float32"}``) seen
    through ``rules`` (rule objects, their JSON, or a
    JSON file) loaded by ``ckptbridge.adapters.flax.load`` onto MaxText's boxed tree on its mesh;
    ``opt``: also into MaxText's AdamW state. Then: ``dump`` the loaded state (params, ``mu/``,
    ``nu/``, ``count``), ``logits`` for ``tokens``, ``steps`` of training on ``train_tokens``
    (``train_out/state.safetensors``, ``train.json``), ``save_universal`` the result with
    ``ckptbridge.adapters.flax.save``. The job's result has ``load``: the report (timings, bytes
    read, leaves not boxed or not sharded as MaxText's rules say, ``count``, ``losses``)."""
    if isinstance(rules, (list, tuple)):
        from ckptbridge import rules_to_json

        rules = rules_to_json(rules)
    else:
        rules = str(rules)
    job: dict[str, Any] = {"cmd": "load", "spec": spec, "source": str(source), "rules": rules, "opt": opt,
                           **adamw}
    for key, value in (("dump", dump), ("tokens", tokens), ("logits", logits), ("train_tokens", train_tokens),
                       ("train_out", train_out), ("save_universal", save_universal), ("report", report)):
        if value is not None:
            job[key] = str(value)
    if steps:
        job["steps"] = steps
    if update_scale:
        job["update_scale"] = dict(update_scale)
    if open_options:
        job["open_options"] = dict(open_options)
    return job


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "XLA_FLAGS", "JAX_PLATFORMS")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["DECOUPLE_GCLOUD"] = "TRUE"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


class _Server:
    """One ``serve`` process of ``script``: MaxText's output goes to an unnamed temporary file (a
    kernel killed before its exit handlers leaves nothing behind), the replies come on a pipe (see
    ``harness.serve``)."""

    def __init__(self, exe: Path, script: Path) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (open for the process's life)
        read, write = os.pipe()
        self.proc = subprocess.Popen([str(exe), str(script), "serve", "--reply-fd", str(write)],
                                     stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, env=_env(),
                                     cwd=tempfile.gettempdir(), pass_fds=(write,), text=True)
        os.close(write)
        self.replies: IO[str] = os.fdopen(read)

    def ask(self, jobs_file: Path, out_file: Path, timeout: float) -> dict[str, Any]:
        """Send one batch and wait for its reply; a failed, dead or timed-out process is closed and
        its reply is ``{"error": ...}`` with the end of its output since the batch began."""
        start = os.fstat(self.log.fileno()).st_size
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"jobs": str(jobs_file), "out": str(out_file)}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: the reply below is empty
        ready, _, _ = select.select([self.replies], [], [], timeout)
        line = self.replies.readline() if ready else ""
        reply = json.loads(line) if line else {"error": "exited" if ready else f"no reply in {timeout} s"}
        if "error" in reply:
            self.stop()
            end = os.fstat(self.log.fileno()).st_size
            tail = os.pread(self.log.fileno(), min(end - start, 6000), max(start, end - 6000))
            reply["error"] += "\n" + tail.decode(errors="replace")
            self.close()
        return reply

    def close(self) -> None:
        self.stop()
        self.log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # serve() returns at the end of its input
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.replies.close()


_SERVERS: dict[Path, list[_Server]] = {}  # script -> its processes (one per device count)


@atexit.register
def close_servers() -> None:
    """End every harness process (at exit; a server also ends when its stdin closes)."""
    for servers in _SERVERS.values():
        for server in servers:
            server.close()
    _SERVERS.clear()


def run_jobs(jobs: list[dict[str, Any]], timeout: float = 900, script: Path = HARNESS) -> list[dict[str, Any]]:
    """Run the jobs as one batch of a harness process; their results (losses, converter errors,
    seconds). ``script``: a harness with more jobs (``tools/maxtext/lora.py``), the same command
    line. A failed job ends its process (the next batch starts a fresh one) and raises
    :class:`HarnessError` with the traceback and the end of MaxText's output."""
    exe = python()
    if not exe.exists():
        raise HarnessError(f"{exe} is missing: run `make maxtext-venv` (tools/maxtext/setup.sh)")
    servers = _SERVERS.setdefault(Path(script), [])
    with tempfile.TemporaryDirectory(prefix="maxtext-jobs-") as tmp:
        spec_file, out_file = Path(tmp) / "jobs.json", Path(tmp) / "results.json"
        spec_file.write_text(json.dumps(jobs))
        for server in [*servers, None]:  # the process with this batch's device count, else a new one
            if server is None:
                server = _Server(exe, Path(script))
                servers.append(server)
            reply = server.ask(spec_file, out_file, timeout)
            if "error" in reply:
                servers.remove(server)
                raise HarnessError(f"harness failed:\n{reply['error'][-8000:]}")
            if reply.get("ok"):
                return json.loads(out_file.read_text())
        raise HarnessError(f"a new harness process refused the batch: {reply}")


# ------------------------------------------------------------------ files


def read_params(path: Path) -> dict[str, np.ndarray]:
    """A harness params / optimizer-state safetensors file as ``{path: ndarray}``."""
    from safetensors.numpy import load_file

    return load_file(str(path))


def write_params(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    """Write ``{maxtext path: ndarray}`` where the harness reads params (or ``mu/``, ``nu/``, ``count``)."""
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(path))
    return Path(path)


# ------------------------------------------------------------------ more families (FAMILY_SPECS)


def _common_spec(family: str, cfg: dict[str, Any], *, scan: bool, mesh: dict[str, int] | None, batch: int,
                 seq: int, theta: float, extra: dict[str, Any]) -> dict[str, Any]:
    heads = cfg["num_attention_heads"]
    spec = {"family": family, "emb": cfg["hidden_size"], "layers": cfg["num_hidden_layers"], "heads": heads,
            "kv_heads": cfg.get("num_key_value_heads", heads), "head_dim": cfg["head_dim"],
            "mlp": cfg["intermediate_size"], "vocab": cfg["vocab_size"], "scan": scan, "rope_type": "default",
            "rope_theta": float(theta), "norm_eps": float(cfg["rms_norm_eps"]),
            "tied": bool(cfg.get("tie_word_embeddings", False)), "batch": batch, "seq": seq, "extra": extra}
    if mesh is not None:
        spec["mesh"] = dict(mesh)
    return spec


def gemma3_spec(cfg: dict[str, Any], *, scan: bool = True, mesh: dict[str, int] | None = None, batch: int = 8,
                seq: int = 16) -> dict[str, Any]:
    """The harness spec of a ``Gemma3ForCausalLM`` config.json: Gemma 3's pattern (MaxText hard-codes
    5 sliding + 1 global), the window, the local and global rotary bases, the global layers' linear
    rotary scaling, ``query_pre_attn_scalar = head_dim`` (what MaxText's ``gemma3-4b`` computes)."""
    pattern = ["sliding_attention"] * 5 + ["full_attention"]
    if cfg["layer_types"] != [pattern[i % 6] for i in range(cfg["num_hidden_layers"])]:
        raise ValueError(f"layer_types {cfg['layer_types']}: MaxText's Gemma 3 hard-codes 5 sliding + 1 global")
    if cfg["query_pre_attn_scalar"] != cfg["head_dim"] or cfg.get("final_logit_softcapping") \
            or cfg.get("attn_logit_softcapping") or not cfg.get("tie_word_embeddings", True):
        raise ValueError("MaxText's gemma3-4b: query_pre_attn_scalar = head_dim, no soft caps, tied embeddings")
    full, local = cfg["rope_parameters"]["full_attention"], cfg["rope_parameters"]["sliding_attention"]
    if local.get("rope_type", "default") != "default" or full.get("rope_type") not in ("default", "linear"):
        raise ValueError(f"rope {cfg['rope_parameters']}: MaxText scales only the global layers, linearly")
    extra = {"sliding_window_size": cfg["sliding_window"], "local_rope_max_timescale": local["rope_theta"],
             "rope_linear_scaling_factor": float(full.get("factor", 1.0))}
    return _common_spec("gemma3", cfg, scan=scan, mesh=mesh, batch=batch, seq=seq, theta=full["rope_theta"],
                        extra=extra)


def gpt_oss_spec(cfg: dict[str, Any], *, scan: bool = True, mesh: dict[str, int] | None = None, batch: int = 8,
                 seq: int = 16) -> dict[str, Any]:
    """The harness spec of a ``GptOssForCausalLM`` config.json: sliding and full layers alternating
    (MaxText hard-codes sliding first), the window, the experts, the default rotary only."""
    if cfg["layer_types"] != [("sliding_attention", "full_attention")[i % 2] for i in range(cfg["num_hidden_layers"])]:
        raise ValueError(f"layer_types {cfg['layer_types']}: MaxText's gpt-oss alternates sliding and full")
    rope = cfg["rope_parameters"]
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope {rope}: the harness maps the default rotary only")
    spec = _common_spec("gpt_oss", cfg, scan=scan, mesh=mesh, batch=batch, seq=seq, theta=rope["rope_theta"],
                        extra={"sliding_window_size": cfg["sliding_window"]})
    return {**spec, "experts": cfg["num_local_experts"], "experts_per_tok": cfg["num_experts_per_tok"]}


def spec_from_hf_deepseek(cfg: dict[str, Any], *, scan: bool = True, batch: int = 8, seq: int = 16,
                          mesh: dict[str, int] | None = None) -> dict[str, Any]:
    """The harness spec of MaxText's DeepSeek decoder (``decoder_block=deepseek``, see
    ``tools/maxtext/deepseek.py``) equivalent to an HF ``DeepseekV3ForCausalLM`` ``config.json``
    (YaRN rotary, interleaved rope rows, sigmoid routing with grouped top-k)."""
    if cfg["model_type"] != "deepseek_v3":
        raise ValueError(f"model_type {cfg['model_type']!r} is not deepseek_v3")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") != "yarn" or not cfg.get("rope_interleave", True):
        raise ValueError("the harness maps DeepSeek-V3's interleaved YaRN rotary only")
    if float(rope.get("mscale", 1.0)) != float(rope.get("mscale_all_dim", 1.0)):
        raise ValueError("MaxText's MLA scales the softmax by mscale only (mscale == mscale_all_dim)")
    heads = cfg["num_attention_heads"]
    spec = {
        "family": "deepseek_v3", "emb": cfg["hidden_size"], "layers": cfg["num_hidden_layers"], "heads": heads,
        "kv_heads": cfg.get("num_key_value_heads", heads), "head_dim": cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
        "mlp": cfg["intermediate_size"], "vocab": cfg["vocab_size"], "scan": scan, "rope_type": "default",
        "rope_theta": float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        "norm_eps": float(cfg["rms_norm_eps"]), "tied": bool(cfg.get("tie_word_embeddings", False)),
        "batch": batch, "seq": seq, "experts": cfg["n_routed_experts"], "experts_per_tok": cfg["num_experts_per_tok"],
        "extra": {
            "rope_type": "yarn", "first_num_dense_layers": cfg["first_k_dense_replace"],
            "base_moe_mlp_dim": cfg["moe_intermediate_size"], "shared_experts": cfg["n_shared_experts"],
            "routed_scaling_factor": float(cfg["routed_scaling_factor"]), "n_routing_groups": cfg["n_group"],
            "topk_routing_group": cfg["topk_group"], "q_lora_rank": cfg.get("q_lora_rank") or 0,
            "kv_lora_rank": cfg["kv_lora_rank"], "qk_nope_head_dim": cfg["qk_nope_head_dim"],
            "qk_rope_head_dim": cfg["qk_rope_head_dim"], "v_head_dim": cfg["v_head_dim"],
            "max_position_embeddings": cfg["max_position_embeddings"],
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            "rope_factor": float(rope["factor"]), "beta_fast": float(rope.get("beta_fast", 32)),
            "beta_slow": float(rope.get("beta_slow", 1)), "mscale": float(rope.get("mscale", 1.0)),
        },
    }
    if mesh is not None:
        spec["mesh"] = dict(mesh)
    return spec


# HF model_type -> its harness spec, for the families whose spec is not the Llama-like one above
# (the harness's side of each family is its tools/maxtext/<module>.py, see tools/maxtext/registry.py)
FAMILY_SPECS = {"gemma3_text": gemma3_spec, "gpt_oss": gpt_oss_spec, "deepseek_v3": spec_from_hf_deepseek}
