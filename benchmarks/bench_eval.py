"""Speculative vs plain decoding speed on the real SmolLM2-135M-Instruct, with a trained EAGLE-3 head.

    python benchmarks/bench_eval.py --checkpoint runs/smollm2-135m/checkpoints/best
    python benchmarks/bench_eval.py --checkpoint runs/smollm2-135m/checkpoints/best --shapes 3,1,4 5,1,6 3,4,8 \
        --max-prompts 8 --max-new-tokens 96 --dtype float32 --threads 2
    python benchmarks/bench_eval.py --untrained     # a head initialised from the target: the cost side only

For every drafting shape (num_steps, topk, num_draft_tokens) it runs the built-in evaluator (eagle3.evaluate) on
the first `--max-prompts` MT-Bench questions (both turns) at temperature 0 and prints τ, generated tokens per
target forward, and tokens/s with and without speculation. The greedy outputs are checked token for token
against plain decoding on every turn (a mismatch is a bug and is printed).
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eagle3.config import load_config  # noqa: E402
from eagle3.engines import EngineRun  # noqa: E402
from eagle3.evaluate import run_builtin  # noqa: E402
from eagle3.logs import setup_logging  # noqa: E402


def untrained_head(cfg, out: Path) -> Path:
    """A head whose lm_head is the target's (on a draft vocab of the lowest ids): measures overhead, not skill."""
    from transformers import AutoConfig

    from eagle3.bundled import resolve_target_path
    from eagle3.formats import save_draft
    from eagle3.model import Eagle3Draft, Eagle3DraftConfig
    from eagle3.targets.weights import load_target_head

    path = resolve_target_path(cfg.target.path)
    hf = AutoConfig.from_pretrained(path)
    dc = Eagle3DraftConfig.from_target(cfg.draft, cfg.target, hf, cfg.draft.vocab_size)
    draft = Eagle3Draft(dc)
    d2t = torch.zeros(dc.draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(dc.vocab_size, dtype=torch.bool)
    t2d[: dc.draft_vocab_size] = True
    draft.set_vocab(d2t, t2d)
    embed, lm_head, _ = load_target_head(path)
    draft.init_from_target(lm_head, embed)
    return save_draft(draft, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "smollm2-135m.yaml"))
    p.add_argument("--checkpoint", help="draft folder / checkpoint (default: the config's best)")
    p.add_argument("--untrained", action="store_true", help="use a head initialised from the target")
    p.add_argument("--shapes", nargs="+", default=["3,1,4", "3,4,8"], help="num_steps,topk,num_draft_tokens")
    p.add_argument("--max-prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--prompt-set", default="mt-bench")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    setup_logging()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [f"target.dtype={args.dtype}", f"eval.max_prompts={args.max_prompts}",
                                    f"eval.max_new_tokens={args.max_new_tokens}", "eval.temperature=0",
                                    f"eval.prompt_sets=[{args.prompt_set}]"])
    tmp = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    if args.untrained:
        cfg.eval.checkpoint = str(untrained_head(cfg, tmp / "untrained"))
    elif args.checkpoint:
        cfg.eval.checkpoint = args.checkpoint
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; target {cfg.target.path} ({args.dtype}); prompts: first {args.max_prompts} "
          f"{args.prompt_set} (all turns), max_new_tokens {args.max_new_tokens}, greedy")
    rows = []
    for shape in args.shapes:
        steps, topk, n = (int(x) for x in shape.split(","))
        cfg.eval.num_steps, cfg.eval.topk, cfg.eval.num_draft_tokens = steps, topk, n
        t0 = time.perf_counter()
        report, _, folder = run_builtin(EngineRun(cfg.target, cfg.eval, cfg.paths), cfg.data)
        r = report["sets"][args.prompt_set]
        rows.append((shape, r, time.perf_counter() - t0))
    print(f"\ndraft: {folder}")
    print("| steps,topk,tokens | τ | accept/pos | tokens/forward | tok/s spec | tok/s plain | speedup | mismatches |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, r, _ in rows:
        rate = " ".join(f"{100 * x:.0f}%" for x in r["acceptance_rate"])
        tps = r["tokens_per_s"]
        print(f"| {shape} | {r['tau']:.2f} | {rate} | {r['tokens_per_forward']:.2f} | {tps['spec']:.1f} | "
              f"{tps['baseline']:.1f} | {r['speedup']:.2f}x | {r.get('greedy_mismatches')} |")


if __name__ == "__main__":
    main()
