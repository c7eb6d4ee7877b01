"""Train an EAGLE-3 draft head: the same loop as `eagle3 train`, launched by accelerate on any setup.

    accelerate launch train.py --config configs/smollm2-135m.yaml [train.lr=3e-4 ...]
    accelerate launch --config_file recipes/accelerate/ddp.yaml train.py --config configs/smollm2-135m.yaml
    accelerate launch --config_file recipes/accelerate/fsdp-8gpu.yaml train.py --config configs/kimi-k2.5.yaml

Two processes on CPU (gloo), e.g. to check data-parallel training without a GPU:

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision no --dynamo_backend no --main_process_port 29533 \
        train.py --config configs/smollm2-135m.yaml

(`accelerate launch --cpu --num_processes 2` silently runs ONE process; use the form above.)
Re-running the same command after a crash resumes from the newest checkpoint in <output_dir>/checkpoints.
"""

import argparse
import sys

from eagle3.config import ConfigError, load_config
from eagle3.logs import setup_logging
from eagle3.trainer import run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", "-c", required=True, help="the YAML config (one schema for every stage)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=3e-4")
    args = parser.parse_args()
    setup_logging()
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
