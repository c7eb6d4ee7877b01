"""Do two trees of eagle3 compute the same numbers? Shards of every target dtype x storage, a tiny Llama target's cache
(exact and fp8) and six training steps of a Llama and an MLA head on each, printed to the last digit: a
restructuring must leave the output equal.

    git worktree add /tmp/old <commit>
    (cd /tmp/old && EAGLE3_CPU_THREADS=1 PYTHONPATH=/tmp/old python $PWD/scripts/same_numbers.py /tmp/old /tmp/sn-old > /tmp/old.txt)
    EAGLE3_CPU_THREADS=1 PYTHONPATH=$PWD python scripts/same_numbers.py $PWD /tmp/sn-new > /tmp/new.txt
    diff /tmp/old.txt /tmp/new.txt && echo identical

One thread on both sides: a different thread count sums in another order (the last digit of a loss moves).
"""

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[1] + "/tests")
from models import make_prepared, tiny_llama, tiny_target_cfg  # noqa: E402

import eagle3  # noqa: E402 - the tree on PYTHONPATH
from eagle3 import trainer  # noqa: E402
from eagle3.extract import run as extract  # noqa: E402

root = Path(sys.argv[2])
root.mkdir(parents=True, exist_ok=True)
print("code:", eagle3.__file__, file=sys.stderr)

# shards written directly, every target dtype x storage: the codec's bytes
import torch  # noqa: E402

from eagle3.cache import ShardWriter  # noqa: E402

g = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for storage in ("exact", "fp8", "fp8-aux"):
        rows = [{"sample_id": f"s{i}", "input_ids": list(range(t)), "loss_mask": [1] * t,
                 "aux": torch.randn(t, 72, generator=g).to(dtype), "final": torch.randn(t, 24, generator=g).to(dtype),
                 "target_argmax": list(range(t))} for i, t in enumerate((5, 9, 3))]
        w = ShardWriter(root / f"{dtype}-{storage}.arrow", 24, dtype, storage=storage)
        w.write(rows[:2])
        w.write(rows[2:])
        print("shard", dtype, storage, w.commit(0).sha256)
target = tiny_llama(root / "target", vocab=256, hidden=64, layers=8)
prepared = make_prepared(root / "prepared", n=24, n_eval=4, vocab=256, draft_vocab=64, max_len=40)
for storage in ("exact", "fp8"):
    cfg = tiny_target_cfg(target, prepared, root / f"x-{storage}")
    cfg.extract.cache_dir = str(root / f"cache-{storage}")
    cfg.extract.storage = storage
    extract(cfg)
    for f in sorted((root / f"cache-{storage}").rglob("*.arrow")):
        print(storage, f.name, hashlib.sha256(f.read_bytes()).hexdigest()[:16])
    for arch in ("llama", "mla"):
        c = tiny_target_cfg(target, prepared, root / f"run-{storage}-{arch}")
        c.extract.cache_dir = str(root / f"cache-{storage}")
        c.extract.storage = storage
        c.draft.vocab_size, c.draft.arch = 64, arch
        t = c.train
        t.batch_tokens, t.ttt_steps, t.lr, t.warmup_ratio, t.log_every, t.max_steps, t.eval_every = 160, 3, 3e-3, 0.2, 1, 6, 3
        trainer.run(c)
        for line in (root / f"run-{storage}-{arch}" / "train_log.jsonl").read_text().splitlines():
            r = json.loads(line)
            if "loss" in r:
                print(storage, arch, r["step"], repr(r["loss"]), repr(r["acc_0"]))
            elif "eval" in r:
                print(storage, arch, "eval", r["step"], repr(r["eval"]["sim_accept_len"]))
