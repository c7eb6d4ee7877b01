"""Where each stage of a run reads and writes, derived in one place from `output_dir`:

    <output_dir>/prepared/            data.output_dir moves it
    <output_dir>/cache/               extract.cache_dir moves it
    <output_dir>/checkpoints/         step_N/ and best/
    <output_dir>/eval/                report.json, report.png
    <output_dir>/export/              sglang/, vllm/
    <output_dir>/regenerated.jsonl    regenerate.output moves it
    <output_dir>/train_log.jsonl      one line per training step and eval (eagle3.tracking)
    <output_dir>/tracking/            tensorboard's event files, mlflow's local store
    <output_dir>/logs/                the SGLang servers' logs

A stage built from a config takes `cfg.paths`; a tool that has only a run folder (the model card of an exported
checkpoint) takes `RunPaths.under(run)`, the default layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    output_dir: Path
    prepared_dir: Path
    cache_dir: Path
    checkpoint_dir: Path
    eval_dir: Path
    export_dir: Path
    regenerated_path: Path

    @property
    def loss_log(self) -> Path:
        return self.output_dir / "train_log.jsonl"

    @property
    def logs_dir(self) -> Path:
        """The engines' server logs (and the recipes' stage logs)."""
        return self.output_dir / "logs"

    @property
    def tracking_dir(self) -> Path:
        return self.output_dir / "tracking"

    @classmethod
    def under(cls, output_dir: str | Path, prepared_dir: str | Path | None = None, cache_dir: str | Path | None = None,
              regenerated_path: str | Path | None = None) -> RunPaths:
        out = Path(output_dir)
        return cls(out, Path(prepared_dir or out / "prepared"), Path(cache_dir or out / "cache"), out / "checkpoints",
                   out / "eval", out / "export", Path(regenerated_path or out / "regenerated.jsonl"))
