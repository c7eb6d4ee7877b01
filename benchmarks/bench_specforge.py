"""python benchmarks/bench_specforge.py --setup && python benchmarks/bench_specforge.py \
    --config configs/smollm2-135m.yaml --precision fp32 bf16 --ttt 4 --threads 2 --steps 20 --warmup 3 --rounds 2 \
    --flops -- output_dir=/tmp/bsf data.max_samples=250 data.max_length=256 target.dtype=bfloat16

Training throughput of eagle3 against SpecForge 0.2.0 (PyPI `specforge==0.2.0`, its offline EAGLE-3 trainer with a
Llama draft layer), on the same machine, the same cached samples and the same torch, alternating run by run
(eagle3, SpecForge, eagle3, SpecForge: `--rounds`). `--setup` installs SpecForge into .venv-specforge (about a
minute; a venv where it already imports at the pinned versions is left alone). The samples are an eagle3
hidden-state cache, written first with the same overrides (SmolLM2-135M, aux layers 2/15/27, hidden 576, draft
vocab 8192; target.dtype=bfloat16 because SpecForge's teacher is bf16 whatever the cache holds):

    O="output_dir=/tmp/bsf data.max_samples=250 data.max_length=256 target.dtype=bfloat16"
    eagle3 prepare --config configs/smollm2-135m.yaml $O && eagle3 extract --config configs/smollm2-135m.yaml $O

Run from eagle3's venv. Prints, per precision and TTT depth, tokens/s of each trainer and the ratio
eagle3/SpecForge, then a JSON summary. tokens/s counts only what both trainers process, the sum of the sample
lengths of each optimizer step, over the --steps optimizer steps after --warmup uncounted ones (torch.compile's
first compilations fall in SpecForge's warm-up; one that lands in a counted step, at a new sequence length, is
reported). Each trainer runs in its own process with `--threads` torch threads set in that process (and
OMP_NUM_THREADS). bf16 is skipped on a CPU without native bf16 (no avx512_bf16/amx): emulated bf16 measures the
emulation.

`--flops` also counts the work of each trainer: one more run of each per precision and TTT depth, on the same
samples and settings, whose optimizer steps (all of `train_step` on either side: forward, backward, optimizer, and
what the teacher and loss compute) each run under torch.utils.flop_counter.FlopCounterMode; the --flops-steps
steps after one uncounted one give GFLOP per token (their FLOPs over the same tokens the timing counts; each side
its own samples of the pool, as in the timing), printed with the ratio SpecForge/eagle3 and, when the timing runs
too (`--steps 0` skips it), each one's achieved GFLOP/s (GFLOP/token x tokens/s). Work, not time: how much of
eagle3's speed is doing less, and how much is doing it faster. FlopCounterMode counts matmuls and attention (2
FLOPs a multiply-add; attention at its full, non-causal s_q x s_k), not elementwise work (softmax, norms, RoPE,
AdamW, clipping, the loss's reductions, argmax) on either side. Added for these steps on this CPU: torch 2.13's
registry has no formula for the CPU kernels of scaled_dot_product_attention
(`_scaled_dot_product_flash_attention_for_cpu` and its backward, eagle3's attention; SpecForge's reaches the
counter as bmm) nor for in-place addmm_ (eagle3's fused loss accumulates the lm_head's weight gradient with it
in fp32), and would count them as 0: they get the registry's SDPA and addmm formulas. The SpecForge counting run
has TORCHDYNAMO_DISABLE=1, so its torch.compile'd functions run eagerly, as aten ops the counter sees (inductor's
compiled kernels it would not; those functions are elementwise, so this hides no matmul, but eager is certain to
be counted). The timing runs keep compilation.

Batches, as close as the two allow: SpecForge 1 sample per optimizer step (its offline EAGLE-3 recipe's
`training.batch_size=1`, no accumulation); eagle3 `train.batch_tokens=--batch-tokens` (1024: length-bucketed
samples packed up to 1024 tokens, about 4 of ShareGPT at 256). Both: TTT --ttt, step decay 0.8, AdamW, eagle3's lr.
Precision: `fp32` = eagle3 `train.mixed_precision=no` / SpecForge `model.torch_dtype=float32`; `bf16` = eagle3's
autocast on fp32 weights / SpecForge's own bf16 path (bf16 weights, fp32 master copy in its BF16Optimizer).

The conversion (eagle3 cache -> SpecForge's offline format, written once under <output_dir>/specforge-offline and
reused while the cache and vocab are unchanged). SpecForge 0.2.0 trains offline from `data.hidden_states_path`, a
folder of `*.ckpt` files (torch.save dicts: `OfflineManifestReader`, normaliser `eagle3_offline_v1`), one per sample:

    eagle3 cache (train split)        SpecForge .ckpt key
    input_ids  int32 [T]           -> input_ids         int64 [T]
    loss_mask  int8  [T]           -> loss_mask         int64 [T]  (SpecForge zeroes the last position itself)
    aux        [T, 3H] (low|mid|high, eagle3's input-of-layer ids)
                                   -> aux_hidden_state  [1, T, 3H] in the run's dtype (fp32 or bf16; the fc input)
    final      [T, H] (post-norm)  -> hidden_state      [1, T, H]  bf16 (SpecForge's TargetHead, always bf16,
                                                                    applies the target lm_head to it each step)
    target_argmax                     (no field: SpecForge recomputes the full-vocab teacher logits every step)
    prepared vocab.safetensors d2t/t2d -> vocab_mapping.pt {"d2t", "t2d"} (`model.vocab_mapping_path`: the same
                                       offset/bool convention, so both heads train on the same 8192 draft tokens)
    target folder                  -> target/: its config.json and safetensors (links) plus the
                                       model.safetensors.index.json SpecForge's TargetHead requires; a tied target
                                       (SmolLM2) reads its lm_head as `model.lm_head_key=model.embed_tokens.weight`
    eagle3's draft dimensions      -> draft/config.json (`LlamaForCausalLMEagle3`, draft_vocab_size 8192)

What SpecForge 0.2.0 needs to train on a CPU, and why (all from its runner here; no installed file is edited):
  - dependencies: `pip install --no-deps specforge==0.2.0`, then only what its offline EAGLE-3 training path
    imports: transformers==5.8.1 (its pin), accelerate, datasets (specforge.data.utils imports it at module level
    for the collator), pydantic, pyyaml, safetensors, numpy, psutil, tqdm, huggingface-hub. Not installed: sglang
    (online capture only), yunchang (sequence parallelism only, imported lazily when sp size > 1), flash-attn
    (`fa` backend only; its import is guarded), wandb/tensorboard (tracking.report_to=none), triton (below), and
    torch==2.11: torch 2.13.0 (CPU wheel), the same torch as eagle3's .venv.
  - triton: specforge.core.loss imports triton at module level for its fused log-softmax loss kernel, which only
    runs on a GPU. Where triton is not installed, the runner executes that one module with an `__import__` that
    hands it a stub `triton` (jit = the identity); no other module sees the stub (torch probes for triton and
    would take a stub for the real one). It then replaces the kernel, `LogSoftmaxLoss.apply` as the EAGLE-3 model
    module calls it, with SpecForge's own torch reference `_compute_loss` from the same file (the same loss: the
    mean over rows of -sum(mask * p * log_softmax(logits)); SpecForge's benchmarks/benchmark_loss.py compares the
    two). SpecForge's torch.compile decorators (that reference, the teacher's softmax, RMSNorm, RoPE) stay: inductor
    compiles them for the CPU (gcc), TORCHINDUCTOR_COMPILE_THREADS=1.
  - attention: `training.attention_backend=sdpa`, SpecForge's other built-in EAGLE-3 path beside its default
    flex_attention (a torch.compile'd flex-attention kernel with block masks, its GPU path; not tried here):
    scaled_dot_product_attention at TTT step 0, explicit matmul attention over the cached keys at later steps, as
    the original EAGLE-3 trainer does.
  - distribution: one process, gloo (SpecForge's own CPU backend choice). The runner sets a one-process torchrun
    environment (RANK=0, WORLD_SIZE=1, ...) so `specforge train` runs its worker in this process instead of
    re-launching itself, and `training.fsdp_sharding=NO_SHARD`, which SpecForge wraps in DDP rather than FSDP:
    its FSDP wrap casts parameters to bf16 (MixedPrecision param_dtype=bfloat16) whatever model.torch_dtype says,
    so an fp32 run would not be fp32, and with one process there is nothing to shard. DDP's reducer still runs its
    bucketed gradient all-reduce each step, and SpecForge all-reduces its step metrics (gloo, one rank).
  - data loading: `data.dataloader_num_workers=1` (one prefetch thread, as eagle3's; its default 4 threads on a
    2-core machine only compete with the step).
  - timing: the runner wraps `TrainerCore.train_step` (one call per micro-batch = one optimizer step here) to record
    the tokens of each batch and the time between the ends of consecutive optimizer steps (data wait included, as
    in eagle3's step_s); SpecForge's own logging is set to once per run.

What still differs (each trainer's own design, not removable here):
  - SpecForge runs the target's full 49152-row lm_head, its argmax and a full-vocab logsumexp on every position of
    every step (its format has no stored argmax; eagle3 stores the argmax at extraction and runs only the 8192
    draft-vocab rows of the teacher); SpecForge's draft logits and loss cover every position, eagle3's only the
    positions a loss reads. Both teachers are bf16 with target.dtype=bfloat16 (with float32, eagle3's is float32
    and SpecForge's still bf16).
  - one sample per step against ~1024 tokens per step: per-step costs (optimizer, all-reduces) weigh more on
    SpecForge's side, and in the same number of steps eagle3 reads ~4x as many samples of the same pool (both
    shuffled; tokens/step of each is printed). SpecForge's fp32 run still keeps its optimizer's fp32 master copy.
  - SpecForge's small functions run torch.compile'd (inductor, CPU), eagle3's trainer eagerly.
  - the CPU path is neither trainer's production path (CUDA; Triton and flex attention for SpecForge): the ratio
    says how the two compare on this CPU, not on a GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import _mean, cpu_model, measurable, one, run_one  # noqa: E402
from trees import REPO  # noqa: E402

VENV = REPO / ".venv-specforge"
SPECFORGE = "specforge==0.2.0"
TORCH = "torch==2.13.0"  # eagle3's .venv's torch (.ci/run); SpecForge pins 2.11
# What SpecForge's offline EAGLE-3 training imports (its METADATA's other requirements are online/GPU/tracking only).
DEPS = ["transformers==5.8.1", "accelerate", "datasets", "pydantic", "pyyaml", "safetensors", "numpy", "psutil",
        "tqdm", "huggingface-hub"]
CONVERT_FORMAT = 1
MIXED = {"fp32": "no", "bf16": "bf16"}  # --precision as eagle3's train.mixed_precision


# --------------------------------------------------------------------------------------------------------- setup
def setup(venv: Path) -> None:
    """SpecForge 0.2.0 without its dependencies, then the ones its offline trainer imports, in `venv`; a venv where
    it already imports at the pinned versions is left alone."""
    python = str(venv / "bin" / "python")

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([python, __file__, "--check"], capture_output=True, text=True)

    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    elif (done := check()).returncode == 0:
        print(f"{done.stdout.strip()} (already in {venv})")
        return
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH], check=True)  # first and pinned, so nothing below pulls another torch
    subprocess.run([*pip, "--no-deps", SPECFORGE], check=True)
    subprocess.run([*pip, *DEPS], check=True)
    if (done := check()).returncode:
        raise SystemExit(f"{venv}: SpecForge does not import:\n{done.stderr}")
    print(done.stdout.strip())


# ---------------------------------------------------------------------------------------------------- conversion
def _sha(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def convert(cfg, out: Path, dtypes: list[str]) -> dict:
    """The eagle3 cache's train split as SpecForge offline features (one folder per aux dtype in `dtypes`), its
    vocab mapping, target folder and draft config under `out`; skipped where `out` already holds them for this
    cache. Returns what the SpecForge run config needs."""
    import torch
    from safetensors import safe_open

    from eagle3.bundled import resolve_target_path
    from eagle3.cache import HiddenStateDataset
    from eagle3.cache.codec import dense
    from eagle3.data.prepared import load_vocab
    from eagle3.formats import engine_config
    from eagle3.model import Eagle3DraftConfig

    cache, prepared = Path(cfg.cache_dir), Path(cfg.prepared_dir)
    stamp = {"format": CONVERT_FORMAT, "cache": str(cache),
             "sha256": _sha(cache / "meta.json", *sorted((cache / "train").glob("*.json")),
                            prepared / "vocab.safetensors")}
    out.mkdir(parents=True, exist_ok=True)
    if not ((out / "stamp.json").is_file() and json.loads((out / "stamp.json").read_text()) == stamp):
        for old in out.glob("features-*"):  # another cache's samples
            shutil.rmtree(old)
    ds = HiddenStateDataset(cache, "train")
    max_len = int(ds.fingerprint["max_length"])

    # the draft vocab, as SpecForge's `load_vocab_mapping` reads it (torch.load of {"d2t", "t2d"})
    d2t, t2d = load_vocab(prepared / "vocab.safetensors")
    torch.save({"d2t": d2t.long(), "t2d": t2d.bool()}, out / "vocab_mapping.pt")

    # the target: config + weights (links), with the index.json SpecForge's TargetHead and embedding loader need
    src = Path(resolve_target_path(cfg.target.path))
    tgt = out / "target"
    shutil.rmtree(tgt, ignore_errors=True)
    tgt.mkdir()
    hf = json.loads((src / "config.json").read_text())
    (tgt / "config.json").write_text(json.dumps(hf, indent=2))
    weight_map = {}
    for f in sorted(src.glob("*.safetensors")):
        (tgt / f.name).symlink_to(f.resolve())
        with safe_open(str(f), framework="pt") as st:
            weight_map.update({k: f.name for k in st.keys()})
    (tgt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    embed_key = "model.embed_tokens.weight"
    tied = bool(hf.get("tie_word_embeddings")) or "lm_head.weight" not in weight_map
    head_key = embed_key if tied else "lm_head.weight"
    if embed_key not in weight_map:
        raise SystemExit(f"{src}: no {embed_key} tensor; this converter handles Llama-style target folders only")

    # the draft: eagle3's dimensions for this config, in the SGLang LlamaForCausalLMEagle3 form SpecForge reads
    dcfg = Eagle3DraftConfig.from_target(cfg.draft, cfg.target, hf, draft_vocab_size=int(d2t.shape[0]))
    if dcfg.arch != "llama" or dcfg.fc_norm or dcfg.norm_output or dcfg.features != "fused":
        raise SystemExit("the comparison is for the plain EAGLE-3 Llama head (draft.arch=llama, no fc_norm, no "
                         "norm_output, features=fused)")
    draft = {k: v for k, v in engine_config(dcfg, "sglang", "bfloat16").items() if not k.startswith("eagle3")}
    # SpecForge's `norm_output` is another switch than eagle3's (EAGLE-3.1's carried post-norm state): there it
    # means the lm_head reads norm(h), the standard EAGLE-3 head, and a config without it means True.
    draft["norm_output"] = True
    (out / "draft").mkdir(exist_ok=True)
    (out / "draft" / "config.json").write_text(json.dumps(draft, indent=2))

    for dtype in dtypes:
        folder = out / f"features-{dtype}"
        if (folder / "stamp.json").is_file():
            continue
        folder.mkdir(exist_ok=True)
        aux_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        t0 = time.perf_counter()
        for i in range(len(ds)):
            it = dense(ds[i], ds.dtype)  # an fp8 cache's states as eagle3's trainer reads them
            # clone: the items are views of the mapped shards, and torch.save writes a view's whole storage
            torch.save({"input_ids": it["input_ids"].long().clone(),
                        "loss_mask": it["loss_mask"].long().clone(),
                        "hidden_state": it["final"].to(torch.bfloat16).clone()[None],
                        "aux_hidden_state": it["aux"].to(aux_dtype).clone()[None]},
                       folder / f"sample-{i:06d}.ckpt")
        (folder / "stamp.json").write_text(json.dumps({"samples": len(ds)}))
        print(f"bench: {len(ds)} samples -> {folder} ({time.perf_counter() - t0:.1f} s)", flush=True)
    (out / "stamp.json").write_text(json.dumps(stamp))
    return {"dir": str(out), "samples": len(ds), "tokens": int(ds.num_tokens.sum()), "max_length": max_len,
            "embed_key": embed_key, "head_key": head_key, "lr": cfg.train.lr}


def specforge_config(conv: dict, precision: str, ttt: int, total_steps: int, out: str) -> dict:
    """The `specforge train` config of one run (JSON; SpecForge's schema, extra="forbid")."""
    d = conv["dir"]
    return {
        "model": {"target_model_path": f"{d}/target", "draft_model_config": f"{d}/draft/config.json",
                  "vocab_mapping_path": f"{d}/vocab_mapping.pt", "embedding_key": conv["embed_key"],
                  "lm_head_key": conv["head_key"],
                  "torch_dtype": {"fp32": "float32", "bf16": "bfloat16"}[precision]},
        "data": {"hidden_states_path": f"{d}/features-{precision}", "max_length": conv["max_length"],
                 "dataloader_num_workers": 1},
        "training": {"strategy": "eagle3", "batch_size": 1, "accumulation_steps": 1, "max_steps": total_steps,
                     "num_epochs": math.ceil(total_steps / conv["samples"]), "learning_rate": conv["lr"],
                     "ttt_length": ttt, "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                     "log_interval": total_steps, "save_interval": 0, "seed": 0},
        "tracking": {"report_to": "none"},
        "run_id": "bench-specforge",
        "output_dir": out,
    }


# ------------------------------------------------------------------------------- inside SpecForge's venv (runner)
def _import_loss_without_triton() -> None:
    """specforge.core.loss imports triton for a GPU kernel: where there is no triton, execute that one module with
    an `__import__` that hands it a stub (nothing else sees the stub: torch probes for triton), then train with
    SpecForge's own torch reference loss."""
    if importlib.util.find_spec("triton") is None and "specforge.core.loss" not in sys.modules:
        import builtins

        stub, lang = types.ModuleType("triton"), types.ModuleType("triton.language")
        stub.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
        stub.next_power_of_2 = lambda n: 1 << max(0, int(n) - 1).bit_length()
        stub.language, lang.constexpr = lang, object

        def stub_import(name, globals=None, locals=None, fromlist=(), level=0):
            if level == 0 and name.split(".")[0] == "triton":
                return lang if fromlist and name == "triton.language" else stub
            return builtins.__import__(name, globals, locals, fromlist, level)

        spec = importlib.util.find_spec("specforge.core.loss")
        module = importlib.util.module_from_spec(spec)
        module.__builtins__ = {**vars(builtins), "__import__": stub_import}
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[spec.name]
            raise
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.core import loss

    class TorchLogSoftmaxLoss:
        apply = staticmethod(loss._compute_loss)

    eagle3_model.LogSoftmaxLoss = TorchLogSoftmaxLoss


def check() -> None:
    """In SpecForge's venv: the pinned versions, and the modules the offline EAGLE-3 run imports."""
    _import_loss_without_triton()
    import specforge.cli  # noqa: F401
    import specforge.data.utils  # noqa: F401 - the collator (datasets)
    import specforge.launch  # noqa: F401
    from specforge.modeling.draft import LlamaForCausalLMEagle3  # noqa: F401

    want = {"specforge": SPECFORGE, "torch": TORCH, "transformers": DEPS[0]}
    have = {name: _version(name) for name in want}
    wrong = [f"{name} {have[name]} (want {pin})" for name, pin in want.items()
             if have[name].split("+")[0] != pin.split("==")[1]]
    if wrong:
        raise SystemExit(f"wrong versions: {', '.join(wrong)}")
    print("OK: " + ", ".join(f"{name} {v}" for name, v in have.items()))


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _compilations() -> tuple[int, float]:
    """(torch.compile compilations so far, forward graphs and their lazily compiled backward graphs; their seconds):
    SpecForge's compiled functions recompile once for a new sequence length (dynamic=None) and compile their
    backward at its first use, so a compilation can land after the warm-up."""
    from torch._dynamo.utils import compilation_time_metrics as m

    keys = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
    return sum(len(m.get(k, ())) for k in keys), sum(sum(m.get(k, ())) for k in keys)


def _flop_counter():
    """FlopCounterMode with the formulas torch's registry lacks for what these steps run: the CPU SDPA kernels
    (the registry has the GPU ones' and counts these as 0) get its SDPA counts, so a CPU step counts its attention
    as a GPU step would; in-place addmm_/baddbmm_ (eagle3's fused loss accumulates the lm_head's weight gradient
    with addmm_ where the weight is in the matmul dtype) count as addmm/baddbmm."""
    from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

    aten = __import__("torch").ops.aten

    def forward(q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(q, k, v)

    def backward(grad_out, q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, q, k, v)

    def like(op):  # the out-of-place op's formula, called with the shapes the mapping's wrapper passes
        return lambda *args, out_shape=None, **kwargs: flop_registry[op](*args, **kwargs)

    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
        aten.addmm_: like(aten.addmm), aten.baddbmm_: like(aten.baddbmm)})


def eagle3_flops_one(config: str, overrides: list[str], out: str, steps: int, precision: str) -> None:
    """bench_train's eagle3 run in this process, each optimizer step (`eagle3.trainer.train_step`, which the loop
    looks up at each call) counted by FlopCounterMode; its tokens and FLOPs recorded to `out`."""
    import eagle3.trainer as trainer

    rows: list[dict] = []
    inner = trainer.train_step

    def counted(s, batches, plan):
        with _flop_counter() as counter:
            metrics = inner(s, batches, plan)
        rows.append({"tokens": round(metrics["tokens_per_s"] * metrics["step_s"]),
                     "flops": counter.get_total_flops()})
        return metrics

    trainer.train_step = counted
    with tempfile.TemporaryDirectory(prefix="bench-flops-") as tmp:
        one(config, overrides, tmp, steps, precision)
    Path(out).write_text(json.dumps(rows))


def specforge_one(config: str, threads: int, out: str, flops: bool = False) -> None:
    """One `specforge train` in this process, with each optimizer step's tokens and time (or, with `flops`, its
    FLOPs) recorded to `out`."""
    import contextlib

    import torch

    torch.set_num_threads(threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A one-process torchrun environment: `specforge train` runs its worker here (gloo on a CPU).
    os.environ.update({"SPECFORGE_DEVICE": "cpu", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    _import_loss_without_triton()
    from specforge.cli import main
    from specforge.training.controller import TrainerCore

    steps: list[dict] = []
    last_end = [None]
    inner = TrainerCore.train_step

    def timed(self, batch, ctx=None):
        c0 = _compilations()
        t0 = time.perf_counter()
        with _flop_counter() if flops else contextlib.nullcontext() as counter:
            result = inner(self, batch, ctx)
        t1 = time.perf_counter()
        if result.optimizer_stepped:
            c1 = _compilations()
            steps.append({"tokens": int(batch.tensors["attention_mask"].sum()), "compute_s": t1 - t0,
                          "step_s": t1 - (last_end[0] if last_end[0] is not None else t0),
                          "compiles": c1[0] - c0[0], "compile_s": c1[1] - c0[1], "loss": float(result.loss),
                          "flops": counter.get_total_flops() if flops else None})
            last_end[0] = t1
        return result

    TrainerCore.train_step = timed
    rc = main(["train", "--config", config])
    Path(out).write_text(json.dumps({"rc": rc, "steps": steps, "threads": torch.get_num_threads(),
                                     "versions": {n: _version(n) for n in ("specforge", "torch", "transformers")}}))


# ------------------------------------------------------------------------------------------------- the comparison
def specforge_steps(python: str, conv: dict, precision: str, ttt: int, total: int, threads: int,
                    flops: bool = False) -> dict:
    """One SpecForge run of `total` optimizer steps in its venv; what the runner recorded. Counting FLOPs, without
    torch.compile (TORCHDYNAMO_DISABLE: compiled code runs inductor kernels the counter does not see)."""
    with tempfile.TemporaryDirectory(prefix=f"bench-specforge-{precision}-") as tmp:
        config, out = Path(tmp) / "config.json", Path(tmp) / "steps.json"
        config.write_text(json.dumps(specforge_config(conv, precision, ttt, total, f"{tmp}/out")))
        subprocess.run([python, __file__, "--specforge-one", str(config), "--threads", str(threads), "--out",
                        str(out), *(["--count-flops"] if flops else [])], check=True,
                       env={**os.environ, **({"TORCHDYNAMO_DISABLE": "1"} if flops else {})})
        got = json.loads(out.read_text())
    if len(got["steps"]) != total:
        raise RuntimeError(f"SpecForge ran {len(got['steps'])} optimizer steps, {total} asked")
    return got


def run_specforge(python: str, conv: dict, precision: str, ttt: int, steps: int, warmup: int, threads: int) -> dict:
    got = specforge_steps(python, conv, precision, ttt, warmup + steps, threads)
    rows = got["steps"][warmup:]
    time_s = sum(r["step_s"] for r in rows)
    return {"steps": len(rows), "tokens_per_s": sum(r["tokens"] for r in rows) / time_s,
            "tokens_per_s_after_epoch_0": None, "step_s": time_s / len(rows),
            "tokens_per_step": sum(r["tokens"] for r in rows) / len(rows),
            "outside_step_share": 1 - sum(r["compute_s"] for r in rows) / time_s,
            "compiles_counted": sum(r["compiles"] for r in rows),
            "compile_s_counted": sum(r["compile_s"] for r in rows),
            "tokens_per_s_without_compile": sum(r["tokens"] for r in rows)
            / (time_s - sum(r["compile_s"] for r in rows)),
            "last_step": len(got["steps"]), "last_loss": got["steps"][-1]["loss"], "threads": got["threads"],
            "versions": got["versions"]}


def gflop_per_token(rows: list[dict]) -> float:
    """FLOPs over tokens of the counted steps (those after the first)."""
    rows = rows[1:]
    return sum(r["flops"] for r in rows) / sum(r["tokens"] for r in rows) / 1e9


def count_flops(a: argparse.Namespace, python: str, conv: dict, precision: str, ttt: int) -> dict:
    """GFLOP per token of each trainer, one run each of 1 + --flops-steps optimizer steps (the first uncounted)."""
    total = 1 + a.flops_steps
    with tempfile.TemporaryDirectory(prefix="bench-flops-") as tmp:
        out = Path(tmp) / "steps.json"
        subprocess.run([sys.executable, __file__, "--config", a.config, "--eagle3-flops", MIXED[precision], "--steps",
                        str(total), "--out", str(out), "--", *a.overrides, f"train.ttt_steps={ttt}",
                        f"train.batch_tokens={a.batch_tokens}"], check=True)
        eagle3 = json.loads(out.read_text())
    specforge = specforge_steps(python, conv, precision, ttt, total, a.threads, flops=True)["steps"]
    e, s = gflop_per_token(eagle3), gflop_per_token(specforge)
    return {"eagle3_gflop_per_token": e, "specforge_gflop_per_token": s, "ratio": s / e, "steps": a.flops_steps,
            "eagle3_tokens": sum(r["tokens"] for r in eagle3[1:]),
            "specforge_tokens": sum(r["tokens"] for r in specforge[1:])}


def _mean_of(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def run_eagle3(a: argparse.Namespace, precision: str, ttt: int) -> dict:
    over = [*a.overrides, f"train.ttt_steps={ttt}", f"train.batch_tokens={a.batch_tokens}"]
    r = run_one(REPO, a.config, over, a.warmup + a.steps, MIXED[precision], a.warmup)
    r["tokens_per_step"] = r["tokens_per_s"] * r["step_s"]
    return r


def compare(a: argparse.Namespace) -> dict:
    from eagle3.config import load_config

    if a.steps and a.warmup < 1:
        raise SystemExit("--warmup must be at least 1 (SpecForge's first step compiles, and times from its start)")
    python = str(a.specforge_python)
    if not Path(python).exists():
        raise SystemExit(f"no {python}: run `python benchmarks/bench_specforge.py --setup` first")
    precisions, native = measurable(a.precision)
    cfg = load_config(a.config, a.overrides)
    conv = convert(cfg, Path(a.convert_dir or Path(cfg.output_dir) / "specforge-offline"), precisions)
    # Each process sets its threads itself (eagle3: bench_train reads BENCH_THREADS; SpecForge: the runner);
    # OpenMP's default and inductor's compile workers follow too.
    os.environ.update({"BENCH_THREADS": str(a.threads), "OMP_NUM_THREADS": str(a.threads),
                       "TORCHINDUCTOR_COMPILE_THREADS": "1"})
    import torch

    results: dict = {"cpu": cpu_model(), "native_bf16": native, "eagle3_torch": torch.__version__,
                     "threads": a.threads, "samples": conv["samples"],
                     "sample_tokens": conv["tokens"], "eagle3_batch_tokens": a.batch_tokens,
                     "specforge_batch_samples": 1, "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds,
                     "runs": {}}
    for ttt in a.ttt:
        for prec in precisions:
            row = results["runs"][f"ttt{ttt}-{prec}"] = timing(a, python, conv, prec, ttt) if a.steps else {}
            if a.flops:
                f = row["flops"] = count_flops(a, python, conv, prec, ttt)
                line = (f"TTT {ttt}, {prec}: eagle3 {f['eagle3_gflop_per_token']:.3f} GFLOP/token, SpecForge "
                        f"{f['specforge_gflop_per_token']:.3f} GFLOP/token; SpecForge/eagle3 = {f['ratio']:.2f}x "
                        f"(FlopCounterMode, {a.flops_steps} steps after 1)")
                if a.steps:
                    for side in ("eagle3", "specforge"):
                        f[f"{side}_gflop_per_s"] = f[f"{side}_gflop_per_token"] * row[side]["tokens_per_s"]
                    line += (f"; achieved: eagle3 {f['eagle3_gflop_per_s']:.1f} GFLOP/s, SpecForge "
                             f"{f['specforge_gflop_per_s']:.1f} GFLOP/s")
                print(line, flush=True)
    return results


def timing(a: argparse.Namespace, python: str, conv: dict, prec: str, ttt: int) -> dict:
    """tokens/s of each trainer over --rounds alternating runs; prints its line."""
    got: dict[str, list[dict]] = {"eagle3": [], "specforge": []}
    for _ in range(a.rounds):
        got["eagle3"].append(run_eagle3(a, prec, ttt))
        got["specforge"].append(run_specforge(python, conv, prec, ttt, a.steps, a.warmup, a.threads))
    row = {side: _mean(rs) for side, rs in got.items()}
    e, s = row["eagle3"], row["specforge"]
    row["ratio"] = e["tokens_per_s"] / s["tokens_per_s"]
    row["per_round"] = {side: [r["tokens_per_s"] for r in rs] for side, rs in got.items()}
    compiled = sum(r["compiles_counted"] for r in got["specforge"])
    if compiled:
        without = _mean_of(got["specforge"], "tokens_per_s_without_compile")
        row["ratio_without_compile"] = e["tokens_per_s"] / without
        print(f"bench: {compiled} torch.compile compilation(s), "
              f"{sum(r['compile_s_counted'] for r in got['specforge']):.1f} s, fell in SpecForge's counted "
              f"steps (a new sequence length): without their seconds the ratio is "
              f"{row['ratio_without_compile']:.2f}x; a larger --warmup keeps them out", flush=True)
    print(f"TTT {ttt}, {prec}: eagle3 {e['tokens_per_s']:.0f} tokens/s ({e['tokens_per_step']:.0f} "
          f"tokens/step), SpecForge {s['tokens_per_s']:.0f} tokens/s ({s['tokens_per_step']:.0f} tokens/step); "
          f"eagle3/SpecForge = {row['ratio']:.2f}x ({a.rounds} round(s), {a.steps} steps after {a.warmup})",
          flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description="Training throughput: eagle3 vs SpecForge 0.2.0 on the same samples")
    p.add_argument("--setup", action="store_true", help="install SpecForge 0.2.0 into --venv and exit")
    p.add_argument("--venv", type=Path, default=VENV, help="SpecForge's venv (default .venv-specforge)")
    p.add_argument("--config", help="eagle3 config whose prepared data and cache both trainers read")
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--ttt", type=int, nargs="+", default=[4], help="TTT depths (train.ttt_steps / ttt_length)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each trainer's process")
    p.add_argument("--steps", type=int, default=20, help="counted optimizer steps of each run (0: no timing runs)")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps before them, not counted")
    p.add_argument("--rounds", type=int, default=1, help="alternating runs of each trainer")
    p.add_argument("--batch-tokens", type=int, default=1024, help="eagle3's train.batch_tokens")
    p.add_argument("--flops", action="store_true", help="also count GFLOP per token of each trainer")
    p.add_argument("--flops-steps", type=int, default=3, help="counted optimizer steps of a --flops run, after 1")
    p.add_argument("--convert-dir", help="SpecForge's copy of the samples (default <output_dir>/specforge-offline)")
    p.add_argument("--specforge-python", help="default: --venv's python")
    p.add_argument("--check", action="store_true", help=argparse.SUPPRESS)  # internal, in SpecForge's venv
    p.add_argument("--specforge-one", help=argparse.SUPPRESS)  # internal: one SpecForge run, in its venv
    p.add_argument("--count-flops", action="store_true", help=argparse.SUPPRESS)  # with --specforge-one
    p.add_argument("--eagle3-flops", help=argparse.SUPPRESS)  # internal: one eagle3 run, steps counted
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="eagle3 config overrides (after --)")
    a = p.parse_args()
    if a.setup:
        setup(a.venv)
        return 0
    if a.check:
        check()
        return 0
    if a.specforge_one:
        specforge_one(a.specforge_one, a.threads, a.out, a.count_flops)
        return 0
    if a.eagle3_flops:
        eagle3_flops_one(a.config, a.overrides, a.out, a.steps, a.eagle3_flops)
        return 0
    if not a.config:
        p.error("--config is required (or --setup)")
    a.specforge_python = a.specforge_python or a.venv / "bin" / "python"
    print(json.dumps(compare(a), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
