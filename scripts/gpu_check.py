"""eagle3 on one GPU in one call, with no network: its device paths on tiny models, a Kimi-K2.5-sized training
step, and the extraction-side work eagle3 adds; every figure to one JSON and a short summary.

    bash scripts/gpu_check.sh                      # the lent GPU: results under $OUT (else ./gpu-check)
    bash scripts/gpu_check.sh --cpu --tiny         # the same code on the CPU at tiny sizes (tests/test_gpu_check.py)

Parts, in order; each records its figures or its error and the next one runs whatever happened:
  1. `tests`: tests/test_gpu.py on the device (HF extraction vs the reference, bf16 training with the fused loss
     and its resume compared tensor by tensor, speculative decoding exact against plain greedy in float32 and an
     exact head's acceptance). The device is there (else the check stops before), so a test that skips fails the
     check like one that fails: green means every test ran on the device.
  2. `matmul`: the device's measured bf16 matmul rate, the denominator of every utilisation figure below.
  3. `train_step`: one optimizer step of the head on synthetic Kimi-sized features (hidden 7168, target vocab
     163840; draft vocab 32000 and the full vocab; 4K and 16K tokens; TTT 3 and 7; each draft layer eagle3 ships;
     the fused loss and a plain autograd one): tokens/s, peak memory, model FLOP utilisation (FLOPs counted by
     torch.utils.flop_counter over the step's forward and backward). fp32 weights under bf16 autocast, as
     `train.mixed_precision: bf16` runs them. The shapes are BENCHMARKS.md "Training speed"'s, so the CPU profile
     and the GPU figure read together.
  4. `profiled_step`: the SmolLM2 head's step that benchmarks/bench_profile.py profiles on a CPU and
     benchmarks/bench_specforge.py compares with SpecForge (2 x 512 tokens, TTT 4), timed on the device.
  5. `extraction`: per token, the stored full-vocab argmax (eagle3.targets.argmax.lm_head_argmax over the 163840-row
     lm_head) and fp8 quantisation of the states (eagle3.cache.codec.quantize); and the capture plugin's hand-over
     of device states (`capture_rates`: the dump file, and the Mooncake Store where the package is there), the
     rate eagle3's capture path adds to a server's prefill and a trainer's read.
A part over its time share is cut short and says so: the whole run stays inside --budget-s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TESTS = "tests/test_gpu.py"
"""What the `tests` part runs (relative to the repository; tests/test_gpu_check.py points it elsewhere)."""


@dataclass(frozen=True)
class Sizes:
    hidden: int
    heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocabs: tuple[int, ...]
    tokens: tuple[int, ...]
    ttt: tuple[int, ...]
    mla: dict[str, Any]
    matmul_n: int
    kv_heads: int = 0
    """Llama layer's KV heads (0: as many as `heads`)."""


KIMI = Sizes(7168, 64, 128, 18432, 163840, (32000, 163840), (4096, 16384), (3, 7),
             {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
              "v_head_dim": 128, "max_position_embeddings": 262144,
              "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                               "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
             8192)
"""Kimi-K2.5's head: its hidden size, attention and MLP shapes, vocab, and its own MLA dimensions."""
SMOLLM2 = Sizes(576, 9, 64, 1536, 49152, (8192,), (1024,), (4,), {}, 0, kv_heads=3)
"""The SmolLM2-135M recipe's head: benchmarks/bench_profile.py's CPU profile and the SpecForge side-by-side."""
TINY = Sizes(64, 4, 16, 128, 512, (128, 512), (64, 256), (3, 7),
             {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16},
             256)


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


def environment(device: Any) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 1e9, 1), cuda=torch.version.cuda)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            env["driver"] = None
    for mod in ("transformers", "accelerate", "datasets", "pydantic", "pyarrow"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    return env


# ----------------------------------------------------------------------------------------------- the parts
def run_tests(device: Any, out: Path, budget_s: float) -> dict[str, Any]:
    """TESTS on the device, in its own process (a CUDA error there cannot take this run down)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # keeps /tmp/site
    env = {**os.environ, "EAGLE3_TEST_DEVICE": str(device), "PYTHONPATH": path}
    xml = out / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", TESTS, f"--junitxml={xml}"]
    try:
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired:
        return {"error": f"over its {budget_s:.0f} s share"}
    (out / "tests.log").write_text(r.stdout + r.stderr)
    import xml.etree.ElementTree as ET

    counts = {"returncode": r.returncode}
    if xml.is_file():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        counts.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        counts["failed"] = [c.get("name") for c in suite.iter("testcase")
                            if c.find("failure") is not None or c.find("error") is not None]
    counts["problem"] = tests_problem(counts)
    counts["tail"] = (r.stdout + r.stderr)[-1500:] if counts["problem"] else ""
    return counts


def tests_problem(t: dict[str, Any]) -> str | None:
    """Why the `tests` part did not pass, or None: pytest's failures, no JUnit report, no test at all, or a skip
    (the device is present, so every test must run on it: a skipped test is a device path nobody checked)."""
    if "error" in t:
        return t["error"]
    if "tests" not in t:
        return f"no JUnit report (pytest exited {t.get('returncode')})"
    if t["tests"] == 0:
        return "no test ran"
    if t["failures"] or t["errors"] or t.get("returncode"):
        return f"{t['failures']} failed, {t['errors']} errors (pytest exited {t.get('returncode')})"
    if t["skipped"]:
        return f"{t['skipped']} of {t['tests']} skipped on a device that is present"
    return None


def matmul_rate(device: Any, n: int) -> dict[str, Any]:
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    s = _timed(lambda: a @ b, device, 10)
    return {"n": n, "bf16_tflops": 2 * n**3 / s / 1e12}


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
               reps: int, rows: int = 1) -> dict[str, Any]:
    """One Kimi-shaped micro-batch through eagle3.objective: forward, backward and AdamW step, timed; 73% of the
    tokens scored (ShareGPT's assistant share), the rest a prompt."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import eagle3.objective as objective_mod
    from eagle3.config import TrainConfig

    batch = synthetic_batch(teacher, lm_head.shape[1], rows, tokens // rows)
    objective = objective_mod.Objective(teacher, TrainConfig(ttt_steps=ttt))
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


def extraction(sizes: Sizes, device: Any, reps: int) -> dict[str, Any]:
    import torch

    from eagle3.cache.codec import quantize
    from eagle3.targets.argmax import lm_head_argmax

    tokens = max(sizes.tokens)
    lm_head = torch.empty(sizes.vocab, sizes.hidden, dtype=torch.bfloat16, device=device).normal_(0, 0.02)
    final = torch.randn(tokens, sizes.hidden, dtype=torch.bfloat16, device=device)
    states = torch.randn(tokens, 3 * sizes.hidden, dtype=torch.bfloat16, device=device)
    argmax_s = _timed(lambda: lm_head_argmax(lm_head, final, 8192), device, reps)
    quant_s = _timed(lambda: quantize(states, 3), device, reps)
    return {"tokens": tokens, "argmax_us_per_token": argmax_s / tokens * 1e6,
            "fp8_quantize_us_per_token": quant_s / tokens * 1e6,
            "argmax_tflops": 2 * tokens * sizes.vocab * sizes.hidden / argmax_s / 1e12,
            "capture": capture_rates(sizes, device, reps, final, states)}


def capture_rates(sizes: Sizes, device: Any, reps: int, final: Any, aux: Any) -> list[dict[str, Any]]:
    """What eagle3's capture plugin adds to a server's prefill, per token of device states at this width: the dump
    file (`shm`) and the Mooncake Store on loopback (`mooncake`, exact and fp8 quantised on the device), the server's
    side (inside its forward: what slows its prefill) and the reader's (get, check, copy out, remove), each in
    tokens/s. The Mooncake rows need the `mooncake` package (and libibverbs): without them they say so."""
    import tempfile
    from types import SimpleNamespace

    import torch

    from eagle3.targets import sglang_capture
    from eagle3.targets.sglang_dump import dump_path, read_dump, sequence_key

    tokens, hidden = final.shape
    ids = torch.randint(3, sizes.vocab, (tokens,), device=device)

    class Extend:
        def is_extend(self) -> bool:
            return True

        def is_target_verify(self) -> bool:
            return False

    def meta(rid: str) -> Any:
        return SimpleNamespace(forward_mode=Extend(), extend_seq_lens_cpu=[tokens], rids=[rid])

    rows, tmp = [], Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    ids_list = ids.tolist()
    layer_ids = [2, 30, 58]

    def shm_read() -> None:
        path = dump_path(tmp, sequence_key(ids_list))
        read_dump(path, ids_list, layer_ids=layer_ids, hidden_size=hidden, sample="x")
        path.unlink()

    put_s = _timed(lambda: (sglang_capture.capture_batch(ids, final, meta("plain"), aux, str(tmp), layer_ids),
                            shm_read()), device, reps)
    rows.append({"transport": "shm", "storage": "exact", "tokens_per_s": tokens / put_s})
    try:
        rows += _store_rates(ids, final, aux, meta, layer_ids, device, reps, tmp)
    except Exception as e:  # noqa: BLE001 - recorded: a machine without Mooncake measures the dump file only
        rows.append({"transport": "mooncake", "error": f"{type(e).__name__}: {e}"})
    return rows


def _store_rates(ids: Any, final: Any, aux: Any, meta: Any, layer_ids: list[int], device: Any, reps: int,
                 tmp: Path) -> list[dict[str, Any]]:
    """The Mooncake rows of `capture_rates`: a master on loopback, the plugin's put from a server-side client, a
    reader's get, exact and fp8."""
    import subprocess
    import time as _time

    from eagle3.targets.mooncake import StateStore, StoreAddress, master_command, master_problem
    from eagle3.targets.sglang_server import free_port

    addr = StoreAddress(f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}/metadata")
    master = subprocess.Popen(master_command(addr), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = _time.monotonic()
        while master_problem(addr, timeout_s=1.0) and _time.monotonic() - t0 < 30:
            _time.sleep(0.2)
        tokens, hidden = final.shape
        server = StateStore(addr, segment=3 * tokens * 4 * hidden * 2 + (64 << 20), what="the server side")
        rows = [_store_rate(addr, server, storage, ids, final, aux, meta, layer_ids, device, reps, tmp)
                for storage in ("exact", "fp8")]
        server.close()
        return rows
    finally:
        master.terminate()
        master.wait(timeout=30)


def _store_rate(addr: Any, server: Any, storage: str, ids: Any, final: Any, aux: Any, meta: Any,
                layer_ids: list[int], device: Any, reps: int, tmp: Path) -> dict[str, Any]:
    from eagle3.targets import sglang_capture
    from eagle3.targets.sglang_store import StoreHandover, wire_bytes_per_token

    tokens, hidden = final.shape
    reader = StoreHandover(addr, tmp / "logs", rank=0, storage=storage)
    keys: list[str] = []

    def put() -> None:
        keys[:] = reader.keys(1)
        sglang_capture.capture_batch(ids, final, meta(keys[0]), aux, str(tmp), layer_ids, server)

    def get() -> None:
        reader.read(keys[0], ids.tolist(), layer_ids=layer_ids, hidden_size=hidden, sample="x", dtype=final.dtype,
                    server="loopback")
        reader.discard(keys)

    through_s = _timed(lambda: (put(), get()), device, reps)
    server_s = _timed(lambda: (put(), reader.discard(keys)), device, reps)
    reader.close()
    per_token = wire_bytes_per_token(hidden, str(final.dtype).removeprefix("torch."), storage)
    return {"transport": "mooncake", "storage": storage, "tokens_per_s": tokens / through_s,
            "server_tokens_per_s": tokens / server_s, "GB_per_s": tokens * per_token / through_s / 1e9}


# -------------------------------------------------------------------------------------------------- driver
def _part(results: dict[str, Any], name: str, fn: Any) -> None:
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:  # stop at nothing: the next part still runs
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
    print(f"[gpu_check] {name}: {'error' if 'error' in results[name] else 'done'} in "
          f"{results['seconds'][name]} s", flush=True)


def _steps(sizes: Sizes, device: Any, reps: int, deadline: float) -> list[dict[str, Any]]:
    import torch

    rows = []
    for arch in ("llama", "mla"):
        for draft_vocab in sizes.draft_vocabs:
            head = None
            for tokens in sizes.tokens:
                for ttt in sizes.ttt:
                    for fused in (True, False):
                        case = {"arch": arch, "draft_vocab": draft_vocab, "tokens": tokens, "ttt": ttt,
                                "fused_loss": fused}
                        try:
                            if time.monotonic() > deadline:
                                raise TimeoutError("skipped: the part's time share ran out")
                            head = head or _head(sizes, arch, draft_vocab, device)
                            rows.append({**case, **train_step(*head, tokens, ttt, fused, device, reps)})
                        except torch.OutOfMemoryError as e:
                            rows.append({**case, "error": f"out of memory: {str(e).splitlines()[0]}"})
                        except Exception as e:
                            rows.append({**case, "error": f"{type(e).__name__}: {e}"})
                        if head is not None:
                            for p in head[0].parameters():
                                p.grad = None
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                        print(f"[gpu_check]   {rows[-1]}", flush=True)
            del head
    return rows


def profiled_step(device: Any, reps: int, tiny: bool) -> dict[str, Any]:
    """The step benchmarks/bench_profile.py profiles on a CPU (SmolLM2's head, 2 x 512 tokens, TTT 4, fused
    loss), timed on the device: the two figures read side by side."""
    tokens = 128 if tiny else SMOLLM2.tokens[0]
    head = _head(SMOLLM2, "llama", SMOLLM2.draft_vocabs[0], device)
    return train_step(*head, tokens, SMOLLM2.ttt[0], True, device, reps, rows=2)


def summary(results: dict[str, Any]) -> str:
    env, mm = results.get("environment", {}), results.get("matmul", {})
    rate = mm.get("bf16_tflops")
    lines = [f"eagle3 gpu_check on {env.get('gpu') or env.get('cpu')} (torch {env.get('torch')}, "
             f"CUDA {env.get('cuda')}, driver {env.get('driver')})"]
    t = results.get("tests")
    if t is None:
        lines.append("tests: not run (--skip tests)")
    else:
        problem = tests_problem(t)
        lines.append(f"tests: {t.get('tests', '?')} run, {t.get('failures', '?')} failed, {t.get('errors', '?')} "
                     f"errors, {t.get('skipped', '?')} skipped: " + (f"FAILED ({problem})" if problem else "passed"))
    lines.append(f"bf16 matmul: {rate:.0f} TFLOP/s" if rate else f"bf16 matmul: {mm.get('error')}")
    lines.append("train step (arch, draft vocab, tokens, TTT, loss): tokens/s, peak GB, MFU")
    for r in results.get("train_step", []) if isinstance(results.get("train_step"), list) else []:
        key = f"  {r['arch']:5} {r['draft_vocab']:>6} {r['tokens']:>5} ttt{r['ttt']} " \
              f"{'fused' if r['fused_loss'] else 'plain'}"
        if "error" in r:
            lines.append(f"{key}: {r['error']}")
        else:
            mfu = f"{r['achieved_tflops'] / rate:.0%}" if rate else "?"
            lines.append(f"{key}: {r['tokens_per_s']:.0f} tok/s, {r.get('peak_gb', float('nan')):.1f} GB, MFU {mfu}")
    ps = results.get("profiled_step", {})
    if ps:
        lines.append(f"SmolLM2 head step (bench_profile.py's shape): {ps['error']}" if "error" in ps else
                     f"SmolLM2 head step (bench_profile.py's shape): {ps['tokens_per_s']:.0f} tok/s, "
                     f"{ps['step_s'] * 1e3:.1f} ms")
    x = results.get("extraction", {})
    if "error" in x:
        lines.append(f"extraction: {x['error']}")
    elif x:
        lines.append(f"extraction per token: argmax {x['argmax_us_per_token']:.2f} us, fp8 quantise "
                     f"{x['fp8_quantize_us_per_token']:.3f} us")
        for c in x.get("capture", []):
            lines.append(f"  capture hand-over {c['transport']} {c.get('storage', '')}: " + (
                c["error"] if "error" in c else f"{c['tokens_per_s']:.0f} tok/s through"
                + (f" ({c['server_tokens_per_s']:.0f} tok/s the server's side, {c['GB_per_s']:.2f} GB/s)"
                   if "server_tokens_per_s" in c else "")))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (CI keeps the script working this way)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes instead of Kimi-K2.5's")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check", help="results folder ($OUT on the device)")
    ap.add_argument("--budget-s", type=float, default=480, help="wall-clock budget of the whole run")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement (after one warm-up)")
    ap.add_argument("--skip", action="append", default=[], choices=["tests", "matmul", "train_step", "profiled_step",
                                                                             "extraction"])
    a = ap.parse_args(argv)
    import torch

    device = torch.device("cpu" if a.cpu else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device (run with --cpu for the CPU check)", file=sys.stderr)
        return 2
    sizes = TINY if a.tiny else KIMI
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    results: dict[str, Any] = {"environment": environment(device), "sizes": sizes.__dict__, "tiny": a.tiny}
    shares = {"tests": 0.35, "matmul": 0.05, "train_step": 0.45, "extraction": 0.1}  # profiled_step: seconds
    parts = {
        "tests": lambda: run_tests(device, out, shares["tests"] * a.budget_s),
        "matmul": lambda: matmul_rate(device, sizes.matmul_n),
        "train_step": lambda: _steps(sizes, device, a.reps, time.monotonic() + shares["train_step"] * a.budget_s),
        "profiled_step": lambda: profiled_step(device, a.reps, a.tiny),
        "extraction": lambda: extraction(sizes, device, a.reps),
    }
    for name, fn in parts.items():
        if name not in a.skip:
            _part(results, name, fn)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    results["total_s"] = round(time.monotonic() - start, 1)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    text = summary(results)
    (out / "summary.txt").write_text(text)
    print(text, end="")
    failed = [n for n in parts if n not in a.skip and ("error" in results[n] if isinstance(results[n], dict) else
                                                      any("error" in r for r in results[n]))]
    tests_failed = "tests" not in a.skip and tests_problem(results["tests"]) is not None
    return 1 if failed or tests_failed else 0


if __name__ == "__main__":
    sys.exit(main())
