"""Everything about the target model: what its files say (`info`), the backend interface (`base`), and the
backends (`hf` in-process, `sglang` a capturing server).

    from eagle3.targets import make_backend
    backend = make_backend(cfg.target, cfg.extract, cfg.data.max_length, cfg.paths.logs_dir)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package stays torch-free to import: eagle3.config reads targets.info
    from pathlib import Path

    from eagle3.config import ExtractConfig, TargetConfig
    from eagle3.targets.base import TargetBackend


def make_backend(target: TargetConfig, extract: ExtractConfig, max_length: int, logs_dir: Path) -> TargetBackend:
    """The configured target backend: HF in-process (`target.backend: hf`) or an SGLang server (started with room for
    `max_length`-token prompts, data.max_length, its log in `logs_dir`)."""
    if target.backend == "hf":
        from eagle3.targets.hf import HFTarget

        return HFTarget(target, extract)
    from eagle3.targets.sglang import SGLangTarget

    return SGLangTarget(target, extract, max_length, logs_dir)
