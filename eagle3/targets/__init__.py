"""Everything about the target model: what its files say (`info`), the backend interface (`base`), and the
backends (`hf` in-process, `sglang` a capturing server).

    from eagle3.targets import make_backend
    backend = make_backend(cfg)          # target.backend: hf | sglang
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package stays torch-free to import: eagle3.config reads targets.info
    from eagle3.config import Config
    from eagle3.targets.base import TargetBackend


def make_backend(cfg: Config) -> TargetBackend:
    """The configured target backend: HF in-process (`target.backend: hf`) or an SGLang server."""
    if cfg.target.backend == "hf":
        from eagle3.targets.hf import HFTarget

        return HFTarget(cfg)
    from eagle3.targets.sglang import SGLangTarget

    return SGLangTarget(cfg)
