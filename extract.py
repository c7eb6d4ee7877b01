"""Extract the target's hidden states for every prepared sample into the offline cache.

    python extract.py --config configs/smollm2-135m.yaml [key=value ...]
    accelerate launch --num_processes 8 extract.py --config configs/kimi-k2.5.yaml

Each process (rank) extracts its own part of the samples; re-run the same command after a crash or a kill and
it resumes where it stopped. Inspect the result with `eagle3 cache info <cache_dir>`.
"""

import sys

from eagle3.cli import stage_config
from eagle3.locks import writing


def main(argv: list[str]) -> int:
    cfg = stage_config("extract", argv)  # --config FILE [key=value ...], the whole file validated (exit 2 if not)
    with writing(cfg.cache_dir, "extract", per_rank=True):  # ranks share the cache, each writes its own part
        from eagle3 import extract

        work = extract.plan(cfg)  # the cache opened or checked; this rank's missing shards; the disk they need
        if work.jobs:
            target = extract.open_target(work)  # HF in process or the SGLang server, run on one sample first
            extract.extract_all(work, target)  # shard by shard: states + the target's argmax, a manifest after each
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
