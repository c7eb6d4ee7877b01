"""What training reports, and only from the main process: `<output_dir>/train_log.jsonl` (one line per step and
per eval), a tracker through accelerate's own API (`tracking.backend`: wandb with an offline fallback, tensorboard,
mlflow; tracking never stops training), and the log lines.

    tracker = Tracker(accelerator, cfg)      # every rank builds one; off the main process each call does nothing
    tracker.info("train: %d steps", n)
    tracker.record({"step": 1, "loss": 2.5})  # train_log.jsonl
    tracker.log({"train/loss": 2.5}, step=1)  # the tracker
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

from eagle3.config import Config
from eagle3.logs import UserError

log = logging.getLogger("eagle3")

LOSS_LOG = "train_log.jsonl"


class Tracker:
    """Rank 0's side effects of a training run behind one object, so the loop needs no `if main` guards."""

    def __init__(self, accelerator: Any, cfg: Config):
        self.accelerator = accelerator
        self.main = bool(accelerator.is_main_process)
        self.path = Path(cfg.output_dir) / LOSS_LOG
        init_tracking(accelerator, cfg)
        if self.main:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def info(self, msg: str, *args: Any) -> None:
        if self.main:
            log.info(msg, *args)

    def record(self, row: dict[str, Any]) -> None:
        if self.main:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def log(self, values: dict[str, Any], step: int) -> None:
        self.accelerator.log(values, step=step)  # accelerate logs on the main process only


PACKAGES = {"wandb": ("wandb",), "tensorboard": ("tensorboard", "tensorboardX"), "mlflow": ("mlflow",)}
"""The packages each backend can write through (accelerate's tensorboard tracker takes either)."""
TRACKING_DIR = "tracking"
"""Under output_dir: tensorboard's event files (`<project>/`), mlflow's local store."""


def accelerator_tracking(cfg: Config) -> dict[str, Any]:
    """Accelerator(...) keywords for tracking.backend: `log_with` and the project folders. A backend whose package
    is missing is refused here, before the run loads anything."""
    from accelerate.utils import ProjectConfiguration

    backend = cfg.tracking.backend
    project = ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=str(Path(cfg.output_dir) / TRACKING_DIR))
    if backend == "none":
        return {"log_with": None, "project_config": project}
    if not any(importlib.util.find_spec(p) for p in PACKAGES[backend]):
        raise UserError(f"tracking.backend={backend}: this environment has no {' or '.join(PACKAGES[backend])} "
                        f"package; pip install {PACKAGES[backend][0]}, or set tracking.backend to none")
    return {"log_with": backend, "project_config": project}


def init_tracking(accelerator, cfg: Config) -> None:
    """The tracker through accelerate on the main process; wandb falls back to offline; never stops training."""
    if cfg.tracking.backend == "none":
        return
    if cfg.tracking.backend != "wandb":
        try:
            # tensorboard's hparams and mlflow's params take scalars only: the config flattened to dotted keys
            kwargs = {"mlflow": {"run_name": cfg.tracking.run_name}} if cfg.tracking.run_name else {}
            accelerator.init_trackers(cfg.tracking.project, config=flat_config(cfg), init_kwargs=kwargs)
        except Exception as e:  # noqa: BLE001 - tracking must never stop training
            log.warning("%s init failed: %s; training continues without tracking", cfg.tracking.backend, e)
            accelerator.log_with = []
            accelerator.trackers = []
        return
    kwargs = {"wandb": {k: v for k, v in {"name": cfg.tracking.run_name, "entity": cfg.tracking.entity,
                                          "dir": cfg.output_dir}.items() if v}}
    attempts = ["as configured", "offline"]
    if os.environ.get("WANDB_MODE", "").lower() not in ("offline", "disabled", "dryrun") and not _wandb_reachable():
        log.warning("wandb: %s is not reachable; logging offline", os.environ.get("WANDB_BASE_URL", "api.wandb.ai"))
        attempts = ["offline"]
    for attempt in attempts:
        if attempt == "offline":
            # wandb ignores WANDB_MODE changes once its session started: say it in the init kwargs, and drop a key
            # that broke the online attempt (offline needs none, but wandb keeps a bad one in its session).
            kwargs["wandb"]["mode"] = "offline"
            os.environ["WANDB_MODE"] = "offline"
            os.environ.pop("WANDB_API_KEY", None)
            try:
                import wandb

                wandb.teardown()
            except Exception:  # noqa: BLE001 - best effort
                pass
        try:
            accelerator.init_trackers(cfg.tracking.project, config=cfg.model_dump(mode="json"), init_kwargs=kwargs)
            if attempt == "offline":
                log.warning("wandb: online init failed; logging offline (sync later with `wandb sync`)")
            return
        except Exception as e:  # noqa: BLE001 - tracking must never stop training
            log.warning("wandb init failed (%s): %s", attempt, e)
            os.environ["WANDB_MODE"] = "offline"
    log.warning("wandb unavailable; training continues without tracking")
    accelerator.log_with = []
    accelerator.trackers = []


def _wandb_reachable(timeout_s: float = 5.0) -> bool:
    """A TCP connect to the wandb server, so an offline machine does not wait out wandb's own 90 s timeout."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:
        socket.create_connection((url.hostname or "api.wandb.ai", url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout_s).close()
        return True
    except OSError:
        return False


def flat_config(cfg: Config) -> dict[str, str | int | float | bool]:
    """The whole config as `{"train.lr": 0.001, ...}`: scalars as they are, lists and None as their text."""
    out: dict[str, str | int | float | bool] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value if isinstance(value, str | int | float | bool) else json.dumps(value)

    walk("", cfg.model_dump(mode="json"))
    return out
