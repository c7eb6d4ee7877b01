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

import sys

from eagle3.cli import main

if __name__ == "__main__":  # the `eagle3 train` command: one parser, one error path, the same exit codes
    sys.exit(main(["train", *sys.argv[1:]]))
