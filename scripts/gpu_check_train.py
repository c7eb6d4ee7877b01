"""The training parts of scripts/gpu_check.py: one optimizer step of a Kimi-K2.5-sized head on synthetic features
(the recipe's 32K-token step first), the SmolLM2 head's profiled step, and a 2-process run of the trainer with the
recipe's FSDP2 launcher settings over NCCL (gloo on the CPU).

Imported by gpu_check.py (the same folder); not a command of its own.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Sizes:
    hidden: int
    heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocabs: tuple[int, ...]
    """The shipped draft vocab (configs/kimi-k2.5.yaml `draft.vocab_size`) first, then the full vocab."""
    tokens: tuple[int, ...]
    ttt: tuple[int, ...]
    mla: dict[str, Any]
    matmul_n: int
    kv_heads: int = 0
    """Llama layer's KV heads (0: as many as `heads`)."""
    recipe_tokens: int = 0
    """The recipe's micro-batch (`train.batch_tokens`: one 32K sample a GPU), 0: no recipe rows."""
    recipe_ttt: int = 4
    """The recipe's `train.ttt_steps`."""


KIMI = Sizes(7168, 64, 128, 18432, 163840, (32000, 163840), (4096, 16384), (3, 7),
             {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
              "v_head_dim": 128, "max_position_embeddings": 262144,
              "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                               "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
             8192, recipe_tokens=32768, recipe_ttt=4)
"""Kimi-K2.5's head: its hidden size, attention and MLP shapes, vocab, its own MLA dimensions, and the recipe's
micro-batch (configs/kimi-k2.5.yaml: MLA, draft vocab 32000, 32768 tokens a GPU, TTT 4)."""
SMOLLM2 = Sizes(576, 9, 64, 1536, 49152, (8192,), (1024,), (4,), {}, 0, kv_heads=3)
"""The SmolLM2-135M recipe's head: benchmarks/bench_profile.py's CPU profile and the SpecForge side-by-side."""
TINY = Sizes(64, 4, 16, 128, 512, (128, 512), (64, 256), (3, 7),
             {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16},
             256, recipe_tokens=512, recipe_ttt=4)


# ------------------------------------------------------------------------------------------------- helpers
def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Any, device: Any, reps: int) -> float:
    """Median seconds of `reps` calls of fn after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _head(sizes: Sizes, arch: str, draft_vocab: int, device: Any) -> tuple[Any, Any, Any]:
    """(head, teacher, target lm_head) with synthetic weights, built on the device: fp32 weights, as
    `train.mixed_precision: bf16` keeps them under bf16 autocast; the frozen embeddings and lm_head in bf16."""
    import torch

    from eagle3.loss import Teacher
    from eagle3.model import Eagle3Draft, Eagle3DraftConfig

    h, v = sizes.hidden, sizes.vocab
    mla = {"arch": "mla", **sizes.mla} if arch == "mla" else {}
    c = Eagle3DraftConfig(hidden_size=h, num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads or sizes.heads,
                          head_dim=sizes.head_dim, intermediate_size=sizes.intermediate, vocab_size=v,
                          draft_vocab_size=draft_vocab, target_hidden_size=h, **mla)
    torch.manual_seed(0)
    with torch.device(device):
        embed = torch.empty(v, h, dtype=torch.bfloat16).normal_(0, 0.02)
        lm_head = torch.empty(v, h, dtype=torch.bfloat16).normal_(0, 0.02)
        model = Eagle3Draft(c, embed_weight=embed)
    ids = torch.arange(draft_vocab) * (v // draft_vocab)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    model.set_vocab(ids - torch.arange(draft_vocab), t2d)
    return model, Teacher(lm_head, ids - torch.arange(draft_vocab), t2d).to(device), lm_head


class PlainSoftCE:
    """The draft's lm_head and soft cross-entropy as plain autograd (every logit kept for the backward): the
    "fused loss off" side of the comparison with eagle3.loss.SoftCE."""

    def __init__(self, probs: Any, rows: Any, decay: float, denominators: Any = None, chunk: int = 0):
        from eagle3.loss import SoftCE

        self.inner = SoftCE(probs, rows, decay, denominators, chunk or 4096)

    def __call__(self, xs: list[Any], weight: Any) -> Any:
        import torch

        from eagle3.loss import HeadOut

        s = self.inner
        total, ces, argmax = 0.0, [], []
        for j, x in enumerate(xs):
            logits = (x @ weight.T).float()
            p = s.probs[s.rows.teacher_row[j].to(s.probs.device)].float()
            ce = -(p * logits.log_softmax(-1)).sum()
            total = total + s.scales[j] * ce
            ces.append(ce.detach())
            argmax.append(logits.detach().argmax(-1))
        return HeadOut(total, torch.stack(ces), tuple(argmax))


IN_VOCAB = 0.97
"""Share of the synthetic tokens whose target argmax is in the draft vocab (the SmolLM2 recipe's train coverage).
The argmax of a random lm_head is uniform over the target vocab: a draft vocab of 1/5 of it would score 1/5 of
the rows, and a step that short is not the one training runs."""


def synthetic_batch(teacher: Any, hidden: int, rows: int, length: int) -> dict[str, Any]:
    """A cache batch of `rows` x `length` random states, 73% of each row scored (ShareGPT's assistant share), the
    target's argmax in the draft vocab at IN_VOCAB of the tokens, so each TTT step keeps the rows a real one does.
    The teacher's probabilities come from the random final states, as the timing only needs their shape."""
    import torch

    g = torch.Generator().manual_seed(0)
    in_vocab = (teacher.to_draft_host >= 0).nonzero().flatten()
    out_vocab = (teacher.to_draft_host < 0).nonzero().flatten()
    argmax = in_vocab[torch.randint(len(in_vocab), (rows, length), generator=g)]
    if len(out_vocab):
        miss = torch.rand(rows, length, generator=g) >= IN_VOCAB
        argmax[miss] = out_vocab[torch.randint(len(out_vocab), (int(miss.sum()),), generator=g)]
    mask = torch.zeros(rows, length, dtype=torch.long)
    mask[:, int(length * 0.27):] = 1
    vocab = len(teacher.to_draft_host)
    return {"aux": torch.randn(rows, length, 3 * hidden, dtype=torch.bfloat16, generator=g),
            "final": torch.randn(rows, length, hidden, dtype=torch.bfloat16, generator=g),
            "input_ids": torch.randint(0, vocab, (rows, length), generator=g), "loss_mask": mask,
            "lengths": torch.full((rows,), length), "target_argmax": argmax.to(torch.int32)}


def train_step(model: Any, teacher: Any, lm_head: Any, tokens: int, ttt: int, fused: bool, device: Any,
               reps: int, rows: int = 1, checkpointing: bool = False) -> dict[str, Any]:
    """One Kimi-shaped micro-batch through eagle3.objective: forward, backward and AdamW step, timed; 73% of the
    tokens scored (ShareGPT's assistant share), the rest a prompt. `checkpointing`: train.activation_checkpointing."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import eagle3.objective as objective_mod
    from eagle3.config import TrainConfig

    batch = synthetic_batch(teacher, lm_head.shape[1], rows, tokens // rows)
    objective = objective_mod.Objective(teacher, TrainConfig(ttt_steps=ttt, activation_checkpointing=checkpointing))
    planned = objective.plan(batch)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=True)
    real = objective_mod.SoftCE
    objective_mod.SoftCE = real if fused else PlainSoftCE

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss, _ = objective.loss(model, planned)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with FlopCounterMode(display=False) as counter:  # the warm-up step, counted once
            step()
        flops = counter.get_total_flops()
        seconds = _timed(step, device, reps)
    finally:
        objective_mod.SoftCE = real
    out = {"tokens": tokens, "ttt": ttt, "fused_loss": fused, "step_s": seconds, "tokens_per_s": tokens / seconds,
           "step_tflop": flops / 1e12, "achieved_tflops": flops / seconds / 1e12,
           "head_params_m": sum(p.numel() for p in params) / 1e6}
    if device.type == "cuda":
        out["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return out


# ------------------------------------------------------------------------------------------- train_step part
def step_cases(sizes: Sizes) -> list[dict[str, Any]]:
    """The rows of the `train_step` part, most important first (a part cut by its time share loses the last):
    the recipe's own step (MLA, the shipped draft vocab, `recipe_tokens` tokens, TTT 4, fused loss) without and with
    train.activation_checkpointing; then BENCHMARKS.md "Training speed"'s grid (tokens x TTT x fused/plain) for MLA
    and Llama at the shipped draft vocab, then both at the full vocab."""
    shipped, *others = sizes.draft_vocabs
    cases = [{"arch": "mla", "draft_vocab": shipped, "tokens": sizes.recipe_tokens, "ttt": sizes.recipe_ttt,
              "fused_loss": True, "checkpointing": ckpt, "recipe": True}
             for ckpt in (False, True) if sizes.recipe_tokens]
    groups = [("mla", shipped), ("llama", shipped)] + [(a, v) for v in others for a in ("mla", "llama")]
    for arch, draft_vocab in groups:
        cases += [{"arch": arch, "draft_vocab": draft_vocab, "tokens": tokens, "ttt": ttt, "fused_loss": fused,
                   "checkpointing": False} for tokens in sizes.tokens for ttt in sizes.ttt for fused in (True, False)]
    return cases


def does_not_fit(e: BaseException, device: Any) -> dict[str, Any]:
    """An out-of-memory row as the measurement it is: at least what was allocated when the failing allocation came
    plus that allocation (or the row's peak before it, if higher), against the device's memory. Called inside the
    `except` block, while the failed step's tensors are still held by its traceback."""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    m = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B)\b", str(e))
    tried = float(m.group(1)) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[m.group(2)] if m else 0.0
    out: dict[str, Any] = {"fits": False, "oom": first}
    if (memory := _memory(device)) is not None:
        peak, allocated, total = memory
        out["needed_gb_at_least"] = round(max(peak, allocated + tried) / 1e9, 1)
        out["available_gb"] = round(total / 1e9, 1)
    return out


def _memory(device: Any) -> tuple[float, float, float] | None:
    """(peak bytes allocated since the row began, bytes allocated now, the device's bytes) on a CUDA device; None
    elsewhere."""
    import torch

    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device),
            torch.cuda.get_device_properties(device).total_memory)


def fit_text(r: dict[str, Any]) -> str:
    """'does not fit: > N GB needed, M GB available' for an out-of-memory row."""
    if "needed_gb_at_least" in r:
        return f"does not fit: > {r['needed_gb_at_least']:.0f} GB needed, {r['available_gb']:.0f} GB available"
    return f"does not fit ({r.get('oom')})"


def run_steps(sizes: Sizes, device: Any, reps: int, deadline: float) -> list[dict[str, Any]]:
    """Every case of step_cases until `deadline`: its figures, `fits: False` for an out-of-memory (a measurement), a
    `skipped` line once the time is out, and `error` only for an unexpected exception."""
    import torch

    rows: list[dict[str, Any]] = []
    head, key = None, None
    for case in step_cases(sizes):
        if time.monotonic() > deadline:
            rows.append({**case, "skipped": "the part's time share ran out"})
            continue
        if key != (case["arch"], case["draft_vocab"]):
            head, key = None, (case["arch"], case["draft_vocab"])
            _free(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            head = head or _head(sizes, case["arch"], case["draft_vocab"], device)
            row_reps = 1 if case["tokens"] >= 32768 else reps
            rows.append({**case, "fits": True, **train_step(*head, case["tokens"], case["ttt"], case["fused_loss"],
                                                             device, row_reps, checkpointing=case["checkpointing"])})
        except torch.OutOfMemoryError as e:
            rows.append({**case, **does_not_fit(e, device)})
        except Exception as e:  # noqa: BLE001 - recorded; the verdict fails on it
            rows.append({**case, "error": f"{type(e).__name__}: {e}"})
        if head is not None:
            for p in head[0].parameters():
                p.grad = None
        _free(device)
        print(f"[gpu_check]   {rows[-1]}", flush=True)
    return rows


def _free(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def profiled_step(device: Any, reps: int, tiny: bool) -> dict[str, Any]:
    """The step benchmarks/bench_profile.py profiles on a CPU (SmolLM2's head, 2 x 512 tokens, TTT 4, fused
    loss), timed on the device: the two figures read side by side."""
    tokens = 128 if tiny else SMOLLM2.tokens[0]
    head = _head(SMOLLM2, "llama", SMOLLM2.draft_vocabs[0], device)
    return train_step(*head, tokens, SMOLLM2.ttt[0], True, device, reps, rows=2)


# ---------------------------------------------------------------------------------------------- the NCCL part
FSDP_YAML = REPO / "recipes" / "accelerate" / "fsdp-8gpu.yaml"
NCCL_STEPS = 4
RUNNER = '''
import json, os, sys, time
import torch
from eagle3 import trainer

if os.environ.get("EAGLE3_GPU_CHECK_FSDP_ON_CPU") == "1":
    # accelerate never selects FSDP for CPU processes (it runs them as MULTI_CPU): as tests/test_fsdp.py does, set the
    # one field that decides it, with the FSDP plugin the launcher configured from the YAML (FSDP_* environment).
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    real_make = trainer.make_accelerator

    def make_fsdp_accelerator(*a):
        acc = real_make(*a)
        acc.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = FullyShardedDataParallelPlugin()
        return acc

    trainer.make_accelerator = make_fsdp_accelerator

real_loop = trainer.train_loop

def train_loop(s):
    t0 = time.perf_counter()
    metrics = real_loop(s)
    acc, p = s.accelerator, next(s.model.parameters())
    dev = acc.device
    report = {"rank": acc.process_index, "world": acc.num_processes, "backend": torch.distributed.get_backend(),
              "distributed_type": str(acc.distributed_type), "mixed_precision": acc.mixed_precision,
              "device": str(dev), "sharded": type(p).__name__ == "DTensor", "param_dtype": str(p.dtype),
              "loop_s": time.perf_counter() - t0,
              "peak_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None}
    with open(os.path.join(os.environ["EAGLE3_GPU_CHECK_REPORTS"], f"rank{acc.process_index}.json"), "w") as f:
        json.dump(report, f)
    return metrics

trainer.train_loop = train_loop
sys.path.insert(0, os.environ["EAGLE3_REPO"])
from train import main  # the recipe's entry point, as `accelerate launch ... train.py --config ...` runs it

sys.exit(main(sys.argv[1:]))
'''


def _nccl_world(root: Path, cpu: bool) -> Path:
    """A tiny Llama target, its prepared data and its bf16 cache (extracted on the CPU here: HF, as tests/test_gpu.py
    builds its world), and the training config of the recipe's head (MLA, TTT 4, bf16) on them; its path."""
    sys.path.append(str(REPO / "tests"))
    from models import make_prepared, tiny_llama, tiny_target_cfg

    from eagle3.extract import run as extract

    target = tiny_llama(root / "target", vocab=512, hidden=64, layers=8)
    prepared = make_prepared(root / "prepared", n=32, n_eval=4, vocab=512, draft_vocab=64, max_len=48)
    cfg = tiny_target_cfg(target, prepared, root / "run")
    cfg.extract.cache_dir = str(root / "cache")
    cfg.target.dtype = "bfloat16"  # the recipe's cache dtype
    extract(cfg)
    cfg.target.device = "cpu" if cpu else "cuda"
    cfg.draft.vocab_size, cfg.draft.arch = 64, "mla"
    t = cfg.train
    t.batch_tokens, t.ttt_steps, t.lr, t.warmup_ratio, t.log_every = 192, 4, 3e-3, 0.25, 1
    t.max_steps, t.save_every, t.eval_every, t.mixed_precision = NCCL_STEPS, NCCL_STEPS, NCCL_STEPS, "bf16"
    config = root / "train.yaml"
    config.write_text(cfg.to_yaml())
    return config


def _launch(root: Path, config: Path, cpu: bool, timeout_s: float) -> subprocess.CompletedProcess:
    """`accelerate launch` with fsdp-8gpu.yaml's settings for 2 processes, the recipe's train.py inside."""
    import yaml

    from eagle3.targets.sglang_server import free_port

    settings = yaml.safe_load(FSDP_YAML.read_text())
    settings["num_processes"] = 2  # the only change: 2 processes instead of 8
    launcher = root / "fsdp-2proc.yaml"
    launcher.write_text(yaml.safe_dump(settings))
    runner = root / "runner.py"
    runner.write_text(RUNNER)
    (root / "reports").mkdir(exist_ok=True)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # keeps /tmp/site
    env = {**os.environ, "PYTHONPATH": path, "EAGLE3_REPO": str(REPO), "EAGLE3_GPU_CHECK_REPORTS": str(root / "reports"),
           "WANDB_MODE": "offline"}
    if cpu:
        env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", EAGLE3_GPU_CHECK_FSDP_ON_CPU="1")
    for _ in range(2):  # a port taken between the probe and the launcher's bind: once more on another
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launcher),
               "--main_process_port", str(free_port()), str(runner), "--config", str(config)]
        r = _run_group(cmd, env, timeout_s)
        port_taken = any(m in r.stdout + r.stderr for m in ("EADDRINUSE", "Address already in use"))
        if r.returncode == 0 or not port_taken:
            return r
    return r


def _run_group(cmd: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """subprocess.run in a session of its own: past the timeout the whole group goes (the launcher's ranks too,
    which would otherwise keep holding their GPUs), then TimeoutExpired as subprocess.run raises it."""
    import signal

    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout_s, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def nccl_part(device: Any, out: Path, budget_s: float) -> dict[str, Any]:
    """The trainer in 2 processes with recipes/accelerate/fsdp-8gpu.yaml's settings (FSDP2, one unit, bf16), NCCL
    between 2 GPUs (gloo between 2 CPU processes with --cpu): NCCL_STEPS real steps on a tiny cache, a sharded
    checkpoint, the export. Passes when both ranks finish on the expected backend with every loss finite."""
    import torch

    cpu = device.type == "cpu"
    if not cpu and torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 GPUs, {torch.cuda.device_count()} visible"}
    root = Path(tempfile.mkdtemp(prefix="eagle3-nccl-"))
    t0 = time.monotonic()
    try:
        config = _nccl_world(root, cpu)
        try:
            r = _launch(root, config, cpu, max(budget_s - (time.monotonic() - t0), 30))
        except subprocess.TimeoutExpired as e:
            (out / "nccl.log").write_text(f"{e.stdout or ''}{e.stderr or ''}")
            return {"error": f"the 2-process run did not finish in its {budget_s:.0f} s share (stopped)",
                    "tail": (e.stderr or "")[-2000:]}
        (out / "nccl.log").write_text(r.stdout + r.stderr)
        return _nccl_result(root, r, "gloo" if cpu else "nccl")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _nccl_result(root: Path, r: subprocess.CompletedProcess, backend: str) -> dict[str, Any]:
    reports = [json.loads(p.read_text()) for p in sorted((root / "reports").glob("rank*.json"))]
    log = root / "run" / "train_log.jsonl"
    steps = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    losses = [s["loss"] for s in steps if "loss" in s and "step" in s]
    res: dict[str, Any] = {"returncode": r.returncode, "ranks": reports, "losses": losses,
                           "tokens_per_s": [s.get("tokens_per_s") for s in steps if "loss" in s]}
    problem = None
    if r.returncode != 0:
        problem = f"the launch exited {r.returncode}: {_last_error(r.stderr)}"
    elif len(reports) != 2:
        problem = f"{len(reports)} of 2 ranks reported"
    elif {x["backend"] for x in reports} != {backend}:
        problem = f"backend {sorted({x['backend'] for x in reports})}, expected {backend}"
    elif not all("FSDP" in x["distributed_type"] and x["sharded"] for x in reports):
        problem = f"not FSDP-sharded: {[(x['distributed_type'], x['sharded']) for x in reports]}"
    elif {x["mixed_precision"] for x in reports} != {"bf16"}:
        problem = f"mixed precision {sorted({x['mixed_precision'] for x in reports})}, expected bf16"
    elif len(losses) < NCCL_STEPS or not all(math.isfinite(v) for v in losses):
        problem = f"losses {losses}: expected {NCCL_STEPS} finite ones"
    if problem:
        res["error"] = problem
        res["tail"] = (r.stdout + r.stderr)[-3000:]
    return res


def _last_error(stderr: str) -> str:
    """The last line of a traceback (what went wrong) in a launcher's stderr, or its last line."""
    lines = [x for x in stderr.splitlines() if x.strip()]
    errs = [x for x in lines if re.match(r"^\s*(\[rank\d+\]:\s*)?\w+(\.\w+)*(Error|Exception)\b", x)]
    return (errs or lines or ["(no output)"])[-1].strip()[:300]
