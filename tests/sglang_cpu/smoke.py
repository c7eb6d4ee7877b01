"""Smoke checks of the real SGLang 0.5.23 on this CPU with the stand-ins of this folder.

Run with the SGLang venv's python (from the repository root):

    .venv-sglang/bin/python tests/sglang_cpu/smoke.py            # all checks, a..e
    .venv-sglang/bin/python tests/sglang_cpu/smoke.py --only a,d # a subset

Launches one server at a time (each in its own process group, killed when its check is done), prints one
`PASS` / `FAIL` line per check and exits non-zero if any failed. Checks:
  a  tiny random Llama, TP=1: /generate (input_ids, greedy) equals HF greedy `generate` token for token
  b  tiny random DeepseekV3 (MLA + MoE), TP=1: the same
  c  both at --tp-size 2: the same output as TP=1
  d  EAGLE-3, SmolLM2-135M-Instruct + the quickstart draft (topk 1 chain): output equals the plain server's
     (and HF greedy), meta_info reports spec_verify_ct and an accept length > 1, and (when the project's
     main venv .venv exists) the verify counts equal those of eagle3's own decoder (eagle3/specdec.py)
  e  EAGLE-3, tiny DeepseekV3 target + a random tiny draft: output equals the plain (HF) output, verify ran
Start-up takes 25-230 s a server on 2 cores; the whole run ~15 minutes (9 server starts).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

SMOLLM2 = Path(os.environ.get("EAGLE3_SMOLLM2_PATH", "/work/eagle3-home/models/smollm2-135m-instruct"))
SMOLLM2_DRAFT = Path(os.environ.get("EAGLE3_SMOLLM2_DRAFT", str(REPO / "runs/smollm2-135m-quickstart/export/sglang")))

TINY_PROMPTS = [[1, 5, 9, 33, 7], [1, 100, 200, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 17]]
TINY_NEW = 16
START_TIMEOUT = float(os.environ.get("EAGLE3_SGLANG_START_TIMEOUT", "400"))

RESULTS: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    return ok


# ---------------------------------------------------------------------------------------------------------------
# Server management
# ---------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(tp: int) -> dict:
    env = dict(os.environ)
    env.update(SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(HERE) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if tp > 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % os.cpu_count()) for i in range(tp))
        env["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so"
    return env


class Server:
    """One SGLang server in its own session / process group; a context manager that always kills the group."""

    def __init__(self, name: str, model: Path, logdir: Path, tp: int = 1, dtype: str = "float32",
                 extra: list[str] | None = None):
        self.name, self.model, self.tp, self.dtype = name, model, tp, dtype
        self.extra = extra or []
        self.port = free_port()
        self.log_path = logdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model), "--device", "cpu",
               "--attention-backend", "torch_native", "--disable-cuda-graph", "--max-total-tokens", "8192",
               "--disable-radix-cache", "--host", "127.0.0.1", "--port", str(self.port), "--skip-server-warmup",
               "--dtype", self.dtype, "--skip-tokenizer-init", "--tp-size", str(self.tp), *self.extra]
        self.log = open(self.log_path, "w")
        self.log.write(" ".join(cmd) + "\n")
        self.log.flush()
        t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=server_env(self.tp),
                                     start_new_session=True, cwd=str(REPO))
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.proc.returncode} during start-up\n"
                                   + self.tail())
            if time.time() - t0 > START_TIMEOUT:
                raise RuntimeError(f"server {self.name} not up after {START_TIMEOUT:.0f} s\n" + self.tail())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/model_info", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(2)
        self.startup_s = time.time() - t0
        print(f"  [{self.name}] up in {self.startup_s:.0f} s (port {self.port}, log {self.log_path})", flush=True)
        return self

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        keep = [ln for ln in lines if "server_args=" not in ln]
        return "\n".join("    | " + ln for ln in keep[-n:])

    def generate(self, input_ids, max_new_tokens: int, timeout: float = 600) -> list[dict]:
        """Greedy /generate; input_ids is one prompt or a list of prompts (one batched request)."""
        body = {"input_ids": input_ids,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"/generate on {self.name}: HTTP {e.code}: {e.read()[:2000]!r}\n" + self.tail()) from e
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            raise RuntimeError(f"/generate on {self.name} failed: {e}\n" + self.tail()) from e
        return out if isinstance(out, list) else [out]

    def greedy(self, prompts, max_new_tokens: int) -> list[list[int]]:
        """One request per prompt, in turn (batch size 1 each)."""
        return [self.generate(p, max_new_tokens)[0]["output_ids"] for p in prompts]

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.proc is not None:
            try:  # children (scheduler, detokenizer) share the group: make sure none outlives the check
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()


# ---------------------------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------------------------


def hf_greedy(model: Path, prompts, max_new_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            # Plain argmax over the full sequence each step: no EOS handling (the server runs with ignore_eos,
            # which does not touch the logits), no cache implementation in the way.
            ids = list(p)
            for _ in range(max_new_tokens):
                logits = m(torch.tensor([ids]), use_cache=False).logits[0, -1]
                ids.append(int(logits.argmax()))
            out.append(ids[len(p):])
    del m
    return out


def first_diff(a, b) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            for j, (u, v) in enumerate(zip(x, y)):
                if u != v:
                    return f"prompt {i} differs at token {j}: {u} vs {v} ({x} vs {y})"
            return f"prompt {i}: lengths {len(x)} vs {len(y)}"
    return f"{len(a)} vs {len(b)} prompts"


def compare(name: str, got, want, what: str) -> bool:
    if got == want:
        return report(name, True, f"{len(got)} prompts x {len(got[0])} tokens equal {what}")
    return report(name, False, f"not equal to {what}: {first_diff(got, want)}")


# ---------------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------------


def run_plain(name: str, model: Path, logdir: Path, prompts, n: int, tp: int = 1, batched: bool = True):
    """Greedy outputs of a plain server: one request per prompt, plus one batched request (must agree)."""
    with Server(name, model, logdir, tp=tp) as srv:
        seq = srv.greedy(prompts, n)
        if batched:
            bat = [o["output_ids"] for o in srv.generate(prompts, n)]
            if bat != seq:
                report(f"{name} batched == sequential", False, first_diff(bat, seq))
    return seq


BUILTIN_SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(2)
from transformers import AutoModelForCausalLM
from eagle3.formats import load_draft
from eagle3.model import Eagle3Draft
from eagle3.specdec import HFTargetDecoder, SpeculativeDecoder, SpecSettings
target, draft_dir, n, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
draft = load_draft(draft_dir, embed_weight=model.get_input_embeddings().weight.detach(),
                                    dtype=torch.float32).eval()
dec = SpeculativeDecoder(HFTargetDecoder(model, list(draft.config.aux_layer_ids)), draft, SpecSettings(3, 1, 4, 0.0, n), ())
print(json.dumps([(lambda g: {"tokens": g.tokens, "steps": g.num_steps})(dec.generate(p)) for p in prompts]))
"""


def builtin_cross_check(prompts, n: int, sglang_tokens, sglang_verify_ct) -> None:
    """Decode the same prompts with eagle3's own EAGLE-3 decoder (eagle3/specdec.py, HF target, float32, the
    draft's training checkpoint) and compare its verify-step counts with SGLang's spec_verify_ct: equal counts
    mean SGLang's draft (extend + per-step decode, i.e. the torch_native draft backends) proposed the same
    accepted tokens. Needs the project's main venv (.venv); skipped without it."""
    py = REPO / ".venv/bin/python"
    ckpt = SMOLLM2_DRAFT.parent.parent / "checkpoints/best"
    if not py.exists() or not ckpt.exists():
        print(f"SKIP d. verify counts == eagle3 builtin decoder: no {py} or {ckpt}", flush=True)
        return
    r = subprocess.run([str(py), "-c", BUILTIN_SCRIPT, str(SMOLLM2), str(ckpt), str(n), json.dumps(prompts)],
                       capture_output=True, text=True, cwd=str(REPO), timeout=900,
                       env=dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1"))
    if r.returncode != 0:
        report("d. verify counts == eagle3 builtin decoder", False, f"builtin decoder failed: {r.stderr[-2000:]}")
        return
    ref = json.loads(r.stdout.strip().splitlines()[-1])
    steps = [x["steps"] for x in ref]
    same_tokens = [x["tokens"] for x in ref] == sglang_tokens
    report("d. SmolLM2 EAGLE-3 verify counts == eagle3 builtin decoder", steps == sglang_verify_ct and same_tokens,
           f"builtin steps={steps}, SGLang spec_verify_ct={sglang_verify_ct}, same tokens={same_tokens}")


def guarded(name: str, fn) -> None:
    try:
        fn()
    except Exception as e:  # a server that fails to start or crashes is a FAIL line, and the next check runs
        report(name, False, f"{type(e).__name__}: {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="a,b,c,d,e", help="comma-separated subset of a,b,c,d,e")
    ap.add_argument("--workdir", default="/tmp/sgl_harness/smoke", help="tiny models and server logs go here")
    args = ap.parse_args()
    only = set(args.only.split(","))
    work = Path(args.workdir)
    logdir = work / "logs"
    logdir.mkdir(parents=True, exist_ok=True)

    from tiny_models import sglang_tiny_deepseek_v3, sglang_tiny_llama, tiny_eagle3_draft

    llama = sglang_tiny_llama(work / "models/tiny-llama")
    dsv3 = sglang_tiny_deepseek_v3(work / "models/tiny-deepseek-v3")
    t0 = time.time()
    refs: dict[str, list] = {}
    tp1: dict[str, list] = {}

    def hf(key: str, model: Path, prompts, n: int):
        if key not in refs:
            refs[key] = hf_greedy(model, prompts, n)
        return refs[key]

    for key, model, check in (("llama", llama, "a"), ("dsv3", dsv3, "b")):
        if check in only or "c" in only or (key == "dsv3" and "e" in only):
            def run(key=key, model=model, check=check):
                want = hf(key, model, TINY_PROMPTS, TINY_NEW)
                got = run_plain(f"{check}-{key}-tp1", model, logdir, TINY_PROMPTS, TINY_NEW)
                tp1[key] = got
                if check in only:
                    compare(f"{check}. tiny {key} TP=1 == HF greedy", got, want, "HF greedy")
            guarded(f"{check}. tiny {key} TP=1", run)

    if "c" in only:
        for key, model in (("llama", llama), ("dsv3", dsv3)):
            def run(key=key, model=model):
                got = run_plain(f"c-{key}-tp2", model, logdir, TINY_PROMPTS, TINY_NEW, tp=2)
                if key not in tp1:
                    raise RuntimeError("no TP=1 output to compare with (its check failed)")
                compare(f"c. tiny {key} TP=2 == TP=1", got, tp1[key], "TP=1")
            guarded(f"c. tiny {key} TP=2", run)

    if "d" in only:
        def run_d():
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(SMOLLM2))
            msgs = ["What is the capital of France? Answer in one sentence.",
                    "Write a short poem about the sea.",
                    "List three prime numbers."]
            prompts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False) for m in msgs]
            prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
            n = 32
            want = hf("smollm2", SMOLLM2, prompts, n)
            plain = run_plain("d-smollm2-plain", SMOLLM2, logdir, prompts, n, batched=False)
            compare("d. SmolLM2 plain server == HF greedy", plain, want, "HF greedy")
            eagle_args = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(SMOLLM2_DRAFT),
                          "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                          "--speculative-num-draft-tokens", "4"]
            with Server("d-smollm2-eagle3", SMOLLM2, logdir, extra=eagle_args) as srv:
                outs = [srv.generate(p, n)[0] for p in prompts]
                bat = srv.generate(prompts, n)
            got = [o["output_ids"] for o in outs]
            compare("d. SmolLM2 EAGLE-3 == plain server", got, plain, "the plain server")
            compare("d. SmolLM2 EAGLE-3 batched (bs=3) == plain server", [o["output_ids"] for o in bat], plain,
                    "the plain server")
            metas = [o["meta_info"] for o in outs]
            verify = [m.get("spec_verify_ct") for m in metas]
            accept = [m.get("spec_accept_length") for m in metas]
            ok = all(v and v > 0 for v in verify) and all(a and a > 1.0 for a in accept)
            report("d. SmolLM2 EAGLE-3 spec_verify_ct > 0 and accept length > 1", ok,
                   f"spec_verify_ct={verify}, spec_accept_length={[round(a, 2) if a else a for a in accept]}")
            builtin_cross_check(prompts, n, got, verify)
        guarded("d. SmolLM2 EAGLE-3", run_d)

    if "e" in only:
        def run_e():
            # SGLang spelling; DeepSeek adds 1 to the ids only when the first is 1 (deepseek_v2.py), so not (1, 2, 3)
            # on a 4-layer target (that would ask for layer 4).
            draft = tiny_eagle3_draft(work / "models/tiny-deepseek-v3-eagle3-draft", dsv3, aux_layer_ids=(0, 2, 3),
                                      draft_vocab=64)
            want = tp1.get("dsv3") or hf("dsv3", dsv3, TINY_PROMPTS, TINY_NEW)
            eagle_args = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
                          "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                          "--speculative-num-draft-tokens", "4"]
            with Server("e-dsv3-eagle3", dsv3, logdir, extra=eagle_args) as srv:
                outs = [srv.generate(p, TINY_NEW)[0] for p in TINY_PROMPTS]
                bat = srv.generate(TINY_PROMPTS, TINY_NEW)
            compare("e. tiny DeepseekV3 EAGLE-3 (random draft) == plain", [o["output_ids"] for o in outs], want,
                    "the plain server")
            compare("e. tiny DeepseekV3 EAGLE-3 batched (bs=3) == plain", [o["output_ids"] for o in bat], want,
                    "the plain server")
            verify = [o["meta_info"].get("spec_verify_ct") for o in outs]
            accept = [o["meta_info"].get("spec_accept_length") for o in outs]
            report("e. tiny DeepseekV3 EAGLE-3 verify ran", all(v and v > 0 for v in verify),
                   f"spec_verify_ct={verify}, spec_accept_length={[round(a, 2) if a else a for a in accept]}")
        guarded("e. tiny DeepseekV3 EAGLE-3", run_e)

    failed = [r for r in RESULTS if not r[1]]
    print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed in {time.time() - t0:.0f} s", flush=True)
    return 1 if failed or not RESULTS else 0


if __name__ == "__main__":
    sys.exit(main())
