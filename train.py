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

from eagle3.cli import stage_config
from eagle3.locks import writing


def main(argv: list[str]) -> int:
    cfg = stage_config("train", argv)  # --config FILE [key=value ...], the whole file validated (exit 2 if not)
    # One writer per checkpoint folder, taken before the trainer's imports: a second run is refused at once.
    with writing(cfg.checkpoint_dir, "train", per_rank=True):
        from eagle3 import trainer

        session = trainer.set_up(cfg)  # data, head, teacher, optimizer (accelerate); resumed from the newest checkpoint
        trainer.train_loop(session)  # TTT steps; held-out acceptance, checkpoints and the tracker on the way
        trainer.finish(session)  # the best head kept and exported for SGLang
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
