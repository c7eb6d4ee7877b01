"""Extract the target's hidden states for every prepared sample into the offline cache.

    python extract.py --config configs/smollm2-135m.yaml [key=value ...]
    accelerate launch --num_processes 8 extract.py --config configs/kimi-k2.5.yaml

Each process (rank) extracts its own part of the samples; re-run the same command after a crash or a kill and
it resumes where it stopped. Inspect the result with `eagle3 cache info <cache_dir>`.
"""

import sys

from eagle3.cli import main

if __name__ == "__main__":  # the `eagle3 extract` command: one parser, one error path, the same exit codes
    sys.exit(main(["extract", *sys.argv[1:]]))
