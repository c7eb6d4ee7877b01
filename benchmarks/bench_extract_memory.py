"""Peak memory of an HF extraction at 2K and 32K tokens per sample on a tiny target: this tree vs git revisions.

    python benchmarks/bench_extract_memory.py                       # this tree, 2048 and 32768 tokens
    python benchmarks/bench_extract_memory.py --against b47580e     # and a revision, side by side
    python benchmarks/bench_extract_memory.py --tokens 2048 8192 32768 --vocab 32000 --storage fp8

The target: a random Llama (hidden 64, 8 layers, 4 heads / 2 kv heads, `--vocab` tokens, window 40960) in float32,
one prepared sample of T tokens in the train split and one in eval, `eagle3.extract.run` with the preflight off.
Each (tree, T) runs in its own process; the figure is the peak resident memory of the extraction above what was
resident before it (Linux VmHWM, reset just before), so it holds the target's forward, the captured states, the
lm_head argmax, the cache writer's buffers, not the weights. The states of one sample are T x 4H float32 (the three
aux layers and the final state): `states` below; `x states` is the peak over that. `forward alone` is the peak
of the target's own forward over one such sample with nothing kept (this tree's process, no extraction): the least
any extraction needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step_memory import _status  # noqa: E402
from trees import REPO, checkout, run_in_tree  # noqa: E402


def one(a: argparse.Namespace) -> dict:
    import tempfile

    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    from transformers import LlamaConfig, LlamaForCausalLM

    import eagle3

    sys.path.insert(0, str(Path(eagle3.__file__).resolve().parents[1] / "tests"))
    from models import make_prepared, tiny_target_cfg

    from eagle3 import extract
    from eagle3.targets.hf import HFTarget

    root = Path(tempfile.mkdtemp(prefix="bench-extract-mem-"))
    t, h = a.tokens[0], 64
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=a.vocab, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=8,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40960,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0)).save_pretrained(root / "target")
    make_prepared(root / "prepared", n=1, n_eval=1, vocab=a.vocab, min_len=t, max_len=t, max_length=t)
    cfg = tiny_target_cfg(root / "target", root / "prepared", root / "out", batch_tokens=t, preflight=False,
                          storage=a.storage)
    cfg.data.max_length = t
    backend = HFTarget(cfg.target, cfg.extract)
    ids = torch.randint(3, a.vocab, (1, t))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter
    before = _status("VmRSS:")
    t0 = time.perf_counter()
    if a.forward_only:  # the target's own forward over the sample, nothing kept: what any extraction needs
        backend.tap.active = False
        with torch.inference_mode():
            backend.base(input_ids=ids, use_cache=False)
    else:
        extract.run(cfg, backend=backend)
    dt = time.perf_counter() - t0
    peak = _status("VmHWM:")
    return {"eagle3": str(Path(eagle3.__file__).parent), "peak_extra_mb": (peak - before) / 1e6,
            "states_mb": t * 4 * h * 4 / 1e6, "seconds": dt}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", action="append", default=[], metavar="REV", help="also measure this git revision")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 32768])
    p.add_argument("--vocab", type=int, default=32000, help="the target's vocab (the lm_head argmax's width)")
    p.add_argument("--storage", choices=["exact", "fp8", "fp8-aux"], default="exact")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--forward-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        Path(a.out).write_text(json.dumps(one(a)))
        return
    forward = {t: run_in_tree(__file__, REPO, ["--one", "--forward-only", f"--tokens={t}", f"--vocab={a.vocab}"])
               for t in a.tokens}
    rows = []
    for rev in [*a.against, None]:
        for t in a.tokens:
            argv = ["--one", f"--tokens={t}", f"--vocab={a.vocab}", f"--storage={a.storage}"]
            if rev is None:
                r = run_in_tree(__file__, REPO, argv)
            else:
                with checkout(rev) as tree:
                    r = run_in_tree(__file__, tree, argv)
            rows.append((rev or "this tree", t, r))
            print(rows[-1][0], t, json.dumps(r), flush=True)
    print(f"\ntiny Llama (hidden 64, 8 layers, vocab {a.vocab}), float32, storage {a.storage}, one sample per split")
    print("| tree | tokens | peak above the weights | per token | states | x states | forward alone | extraction |")
    print("|---|---|---|---|---|---|---|---|")
    for name, t, r in rows:
        per = r["peak_extra_mb"] * 1e6 / t / 1e3
        print(f"| {name} | {t} | {r['peak_extra_mb']:.0f} MB | {per:.1f} KB | {r['states_mb']:.0f} MB | "
              f"{r['peak_extra_mb'] / r['states_mb']:.1f} | {forward[t]['peak_extra_mb']:.0f} MB | {r['seconds']:.1f} s |")


if __name__ == "__main__":
    main()
