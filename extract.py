"""Extract the target's hidden states for every prepared sample into the offline cache.

    python extract.py --config configs/smollm2-135m.yaml [key=value ...]
    accelerate launch --num_processes 8 extract.py --config configs/kimi-k2.5.yaml

Each process (rank) extracts its own part of the samples; re-run the same command after a crash or a kill and
it resumes where it stopped. Inspect the result with `eagle3 cache info <cache_dir>`.
"""

import argparse

from eagle3.config import load_config
from eagle3.extract import run
from eagle3.logs import setup_logging

if __name__ == "__main__":
    setup_logging()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", "-c", required=True, help="the YAML config")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. extract.shard_samples=64")
    args = parser.parse_args()
    run(load_config(args.config, args.overrides))
