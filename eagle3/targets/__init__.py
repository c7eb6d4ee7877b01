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


def make_backend(target: TargetConfig, extract: ExtractConfig, max_length: int, logs_dir: Path,
                 request: tuple[int, str] | None = None, preflight: bool | None = None, images: bool = False
                 ) -> TargetBackend:
    """The configured target backend: HF in-process (`target.backend: hf`) or SGLang servers (one started with room
    for `max_length`-token prompts, data.max_length, its log in `logs_dir`; `request`: the largest request's tokens and
    the storage its states travel in, eagle3.targets.sglang.request_shape; `preflight`: None follows
    extract.preflight; `images`: the samples hold images)."""
    if target.backend == "hf":
        from eagle3.targets.hf import HFTarget

        return HFTarget(target, extract, images=images)
    from eagle3.targets.sglang import SGLangTarget

    return SGLangTarget(target, extract, max_length, logs_dir, request=request, preflight=preflight, images=images)
