"""eagle3 on one GPU (or a node) in one call, with no network: its device paths on tiny models, the Kimi-K2.5
recipe's training step at full size, the trainer on 2 GPUs with the recipe's FSDP2 settings over NCCL, and the
extraction-side work eagle3 adds; every figure to one JSON, a short summary, and one verdict line.

    bash scripts/gpu_check.sh                      # the lent GPU: results under $OUT (else ./gpu-check)
    bash scripts/gpu_check.sh --cpu --tiny         # the same code on the CPU at tiny sizes (tests/test_gpu_check.py)

Parts, in order; each records its figures or its error and the next one runs whatever happened:
  1. `tests`: tests/test_gpu.py on the device (HF extraction vs the reference, bf16 training with the fused loss
     and its resume compared tensor by tensor, speculative decoding exact against plain greedy in float32 and an
     exact head's acceptance). The device is there (else the check stops before), so a test that skips fails the
     check like one that fails: green means every test ran on the device.
  2. `matmul`: the device's measured bf16 matmul rate, the denominator of every utilisation figure below.
  3. `nccl`: train.py in 2 processes launched with recipes/accelerate/fsdp-8gpu.yaml's settings (FSDP2, the head
     one unit, bf16 mixed precision; num_processes 2), NCCL between GPUs 0 and 1, the recipe's MLA head and TTT 4 on
     a tiny bf16 cache: a few steps, a sharded checkpoint, the export; passes when both ranks ran FSDP-sharded on
     NCCL with every loss finite. Fewer than 2 GPUs: skipped, and says so. With --cpu: the same over gloo.
  4. `train_step`: one optimizer step of the head on synthetic Kimi-sized features (hidden 7168, target vocab
     163840), most important row first: the recipe's step (MLA, the shipped draft vocab 32000, 32768 tokens, TTT 4,
     fused loss; configs/kimi-k2.5.yaml) without and with train.activation_checkpointing; then BENCHMARKS.md
     "Training speed"'s grid (4K and 16K tokens, TTT 3 and 7, the fused loss and a plain autograd one) for MLA and
     Llama at draft vocab 32000, then both at the full vocab. Per row: tokens/s, peak memory, model FLOP utilisation
     (FLOPs counted by torch.utils.flop_counter over the step's forward and backward); fp32 weights under bf16
     autocast, as `train.mixed_precision: bf16` runs them. An out-of-memory row is a measurement ("does not fit: >
     N GB needed, M GB available"), not an error; rows past the part's time are listed as not measured.
  5. `profiled_step`: the SmolLM2 head's step that benchmarks/bench_profile.py profiles on a CPU and
     benchmarks/bench_specforge.py compares with SpecForge (2 x 512 tokens, TTT 4), timed on the device.
  6. `extraction`: per token, the stored full-vocab argmax (eagle3.targets.argmax.lm_head_argmax over the 163840-row
     lm_head) and fp8 quantisation of the states (eagle3.cache.codec.quantize); and the capture plugin's hand-over
     of device states (`capture_rates`: the dump file, and the Mooncake Store where the package is there), the
     rate eagle3's capture path adds to a server's prefill and a trainer's read.
Time: --budget-s (480 s) for the whole run; `tests` and `nccl` have shares, `train_step` runs until what the parts
after it need is left. The last line is the verdict: `VERDICT: PASS ...` (exit 0) or `VERDICT: FAIL: <the first
reason>` (exit 1). Only a failed or skipped test, a part's unexpected exception, a row's unexpected exception or a
failed NCCL run fail it; out-of-memory rows, rows cut by time and a missing second GPU are reported in the PASS line.
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TESTS = "tests/test_gpu.py"
"""What the `tests` part runs (relative to the repository; tests/test_gpu_check.py points it elsewhere)."""


sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check_train.py beside it, however this is loaded
from gpu_check_train import (  # noqa: E402
    KIMI,
    TINY,
    Sizes,
    _timed,
    fit_text,
    nccl_part,
    profiled_step,
    run_steps,
)


def environment(device: Any) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpus=torch.cuda.device_count(), gpu_memory_gb=round(props.total_memory / 1e9, 1),
                   cuda=torch.version.cuda)
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
    r = results[name]
    state = "error" if isinstance(r, dict) and "error" in r else "skipped" if isinstance(r, dict) and "skipped" in r \
        else "done"
    print(f"[gpu_check] {name}: {state} in {results['seconds'][name]} s", flush=True)


def _row_key(r: dict[str, Any]) -> str:
    return (f"{r['arch']:5} {r['draft_vocab']:>6} {r['tokens']:>5} ttt{r['ttt']} "
            f"{'fused' if r['fused_loss'] else 'plain'}{' ckpt' if r.get('checkpointing') else ''}")


def _row_text(r: dict[str, Any], rate: float | None) -> str:
    if "error" in r:
        return f"ERROR {r['error']}"
    if "skipped" in r:
        return "not measured (the part's time ran out)"
    if not r.get("fits", True):
        return fit_text(r)
    mfu = f"{r['achieved_tflops'] / rate:.0%}" if rate else "?"
    return f"{r['tokens_per_s']:.0f} tok/s, {r.get('peak_gb', float('nan')):.1f} GB, MFU {mfu}"


def _train_lines(rows: Any, rate: float | None) -> list[str]:
    if not isinstance(rows, list):
        return [f"train step: {rows.get('error') if isinstance(rows, dict) else rows}"]
    recipe = [r for r in rows if r.get("recipe")]
    lines = []
    if recipe:
        r = recipe[0]
        lines.append(f"the recipe's step (MLA, draft vocab {r['draft_vocab']}, {r['tokens']} tokens, TTT {r['ttt']}, "
                     "fused loss), train.activation_checkpointing:")
        lines += [f"  {'true ' if r['checkpointing'] else 'false'}: {_row_text(r, rate)}" for r in recipe]
    lines.append("train step (arch, draft vocab, tokens, TTT, loss): tokens/s, peak GB, MFU")
    lines += [f"  {_row_key(r)}: {_row_text(r, rate)}" for r in rows if not r.get("recipe")]
    return lines


def _nccl_line(n: dict[str, Any] | None) -> str:
    if n is None:
        return "NCCL part: not run (--skip nccl)"
    if "skipped" in n:
        return f"NCCL part: {n['skipped']}, skipped"
    if "error" in n:
        return f"NCCL part: FAILED ({n['error']})"
    ranks, losses = n["ranks"], n["losses"]
    peak = [x["peak_gb"] for x in ranks if x.get("peak_gb") is not None]
    return (f"NCCL part: {len(ranks)} ranks, FSDP2 sharded over {ranks[0]['backend']}, mixed precision "
            f"{ranks[0]['mixed_precision']}: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, all finite"
            + (f", peak {max(peak):.2f} GB a rank" if peak else ""))


def summary(results: dict[str, Any]) -> str:
    env, mm = results.get("environment", {}), results.get("matmul", {})
    rate = mm.get("bf16_tflops")
    where = f"{env['gpus']} x {env['gpu']} ({env.get('gpu_memory_gb')} GB)" if env.get("gpu") else env.get("cpu")
    lines = [f"eagle3 gpu_check on {where} (torch {env.get('torch')}, CUDA {env.get('cuda')}, driver "
             f"{env.get('driver')})"]
    t = results.get("tests")
    if t is None:
        lines.append("tests: not run (--skip tests)")
    else:
        problem = tests_problem(t)
        lines.append(f"tests: {t.get('tests', '?')} run, {t.get('failures', '?')} failed, {t.get('errors', '?')} "
                     f"errors, {t.get('skipped', '?')} skipped: " + (f"FAILED ({problem})" if problem else "passed"))
    lines.append(f"bf16 matmul: {rate:.0f} TFLOP/s" if rate else f"bf16 matmul: {mm.get('error', 'not run')}")
    lines.append(_nccl_line(results.get("nccl")))
    if "train_step" in results:
        lines += _train_lines(results["train_step"], rate)
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
    return "\n".join(lines) + "\n" + verdict(results)[1] + "\n"


def _failures(results: dict[str, Any]) -> list[str]:
    """Every reason the check fails, in the order the parts ran."""
    reasons = []
    t = results.get("tests")
    if t is not None and (problem := tests_problem(t)):
        first = f": {t['failed'][0]}" if t.get("failed") else ""
        reasons.append(f"tests: {problem}{first} (tests.log)")
    for name in ("matmul", "nccl", "train_step", "profiled_step", "extraction"):
        r = results.get(name)
        if isinstance(r, dict) and "error" in r:
            reasons.append(f"{name}: {r['error']}" + (" (nccl.log)" if name == "nccl" else ""))
        if isinstance(r, list):
            reasons += [f"train step {' '.join(_row_key(x).split())}: {x['error']}" for x in r if "error" in x]
    return reasons


def _recipe_note(rows: list[dict[str, Any]]) -> str | None:
    """What the recipe's step rows tell a user: fits as configured, needs checkpointing, or does not fit at all."""
    recipe = {r["checkpointing"]: r for r in rows if r.get("recipe")}
    if not recipe:
        return None
    plain, ckpt = recipe.get(False, {}), recipe.get(True, {})
    what = f"the recipe's {plain.get('tokens') or ckpt.get('tokens')}-token step"
    if "skipped" in plain:
        return f"{what} not measured (time)"
    if plain.get("fits"):
        return f"{what} fits without checkpointing" + (f" ({plain['peak_gb']:.0f} GB peak)" if "peak_gb" in plain else "")
    if ckpt.get("fits"):
        return (f"{what} needs train.activation_checkpointing: true on this GPU ({fit_text(plain)}; with it "
                f"{ckpt.get('peak_gb', 0):.0f} GB peak)")
    if "skipped" in ckpt:
        return f"{what} {fit_text(plain)}; checkpointed not measured (time)"
    return (f"{what} {fit_text(plain)}, with checkpointing {fit_text(ckpt)}: use train.sequence_parallel or a smaller "
            "train.batch_tokens on this GPU")


def verdict(results: dict[str, Any]) -> tuple[bool, str]:
    """(passed, the one line a user acts on): `VERDICT: FAIL: <first reason>` or `VERDICT: PASS: <what it shows>`."""
    reasons = _failures(results)
    if reasons:
        more = f" (and {len(reasons) - 1} more: summary.txt)" if len(reasons) > 1 else ""
        return False, f"VERDICT: FAIL: {reasons[0]}{more}"
    env = results.get("environment", {})
    left_out = [p for p in PARTS if p not in results]
    notes = [f"every part ran on {env.get('gpu') or 'the CPU'}" if not left_out else
             f"the parts run passed on {env.get('gpu') or 'the CPU'} (not run: {', '.join(left_out)})"]
    rows = results.get("train_step")
    if isinstance(rows, list):
        notes.append(_recipe_note(rows))
        oom = sum(1 for r in rows if r.get("fits") is False)
        cut = sum(1 for r in rows if "skipped" in r)
        notes += [f"{oom} step rows do not fit (measured)" if oom else None,
                  f"{cut} step rows not measured (time)" if cut else None]
    n = results.get("nccl")
    if n is not None:
        notes.append(f"NCCL part: {n['skipped']}, skipped" if "skipped" in n else "NCCL part: 2 ranks trained (FSDP2, "
                     f"{n['ranks'][0]['backend']}, bf16)")
    return True, "VERDICT: PASS: " + "; ".join(x for x in notes if x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (CI keeps the script working this way)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes instead of Kimi-K2.5's")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check", help="results folder ($OUT on the device)")
    ap.add_argument("--budget-s", type=float, default=480, help="wall-clock budget of the whole run")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement (after one warm-up)")
    ap.add_argument("--skip", action="append", default=[], choices=list(PARTS))
    a = ap.parse_args(argv)
    import torch

    device = torch.device("cpu" if a.cpu else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device (run with --cpu for the CPU check)", file=sys.stderr)
        print("VERDICT: FAIL: torch sees no CUDA device")
        return 2
    sizes = TINY if a.tiny else KIMI
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    end = start + a.budget_s
    results: dict[str, Any] = {"environment": environment(device), "sizes": sizes.__dict__, "tiny": a.tiny}
    for name in PARTS:
        if name not in a.skip:
            _part(results, name, lambda name=name: PARTS[name](device, sizes, out, a, end))
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    results["total_s"] = round(time.monotonic() - start, 1)
    passed, line = verdict(results)
    results["verdict"] = line
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    text = summary(results)
    (out / "summary.txt").write_text(text)
    print(text, end="")
    return 0 if passed else 1


SHARES = {"tests": 0.35, "nccl": 0.25}
"""The most of --budget-s the `tests` and `nccl` parts may take (their subprocesses are stopped there)."""
AFTER_TRAIN = 0.1
"""The share of --budget-s kept for the parts after `train_step` (profiled_step, extraction): train_step starts no
row once only this is left."""
PARTS: dict[str, Any] = {
    "tests": lambda device, sizes, out, a, end: run_tests(device, out, SHARES["tests"] * a.budget_s),
    "matmul": lambda device, sizes, out, a, end: matmul_rate(device, sizes.matmul_n),
    "nccl": lambda device, sizes, out, a, end: nccl_part(
        device, out, min(SHARES["nccl"] * a.budget_s, end - time.monotonic() - AFTER_TRAIN * a.budget_s)),
    "train_step": lambda device, sizes, out, a, end: run_steps(sizes, device, a.reps, end - AFTER_TRAIN * a.budget_s),
    "profiled_step": lambda device, sizes, out, a, end: profiled_step(device, a.reps, a.tiny),
    "extraction": lambda device, sizes, out, a, end: extraction(sizes, device, a.reps),
}
"""The parts in the order they run: each a function of (device, sizes, out folder, the arguments, the budget's end)."""


if __name__ == "__main__":
    sys.exit(main())
