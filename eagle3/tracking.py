"""What training reports, and only from the main process: `<output_dir>/train_log.jsonl` (one line per step and
per eval), a tracker through accelerate's own API (`tracking.backend`: wandb with an offline fallback, tensorboard,
mlflow; tracking never stops training), and the log lines.

    tracker = Tracker(accelerator, cfg.tracking, cfg.paths, cfg.model_dump(mode="json"))  # on every rank; off the
                                             # main process each call does nothing
    tracker.info("train: %d steps", n)
    tracker.record({"step": 1, "loss": 2.5})  # train_log.jsonl
    tracker.log({"train/loss": 2.5}, step=1)  # the tracker
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from typing import Any

from eagle3.config import TrackingConfig
from eagle3.logs import UserError
from eagle3.paths import RunPaths

log = logging.getLogger("eagle3")


class Tracker:
    """Rank 0's side effects of a training run behind one object, so the loop needs no `if main` guards."""

    def __init__(self, accelerator: Any, tracking: TrackingConfig, paths: RunPaths, hparams: dict[str, Any]):
        """hparams: the whole config as JSON-able values, recorded with the run."""
        self.accelerator = accelerator
        self.main = bool(accelerator.is_main_process)
        self.path = paths.loss_log
        init_tracking(accelerator, tracking, paths, hparams)
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


def accelerator_tracking(tracking: TrackingConfig, paths: RunPaths) -> dict[str, Any]:
    """Accelerator(...) keywords for tracking.backend: `log_with` and the project folders. A backend whose package
    is missing is refused here, before the run loads anything."""
    from accelerate.utils import ProjectConfiguration

    backend = tracking.backend
    project = ProjectConfiguration(project_dir=str(paths.output_dir), logging_dir=str(paths.tracking_dir))
    if backend == "none":
        return {"log_with": None, "project_config": project}
    if not any(importlib.util.find_spec(p) for p in PACKAGES[backend]):
        raise UserError(f"tracking.backend={backend}: this environment has no {' or '.join(PACKAGES[backend])} "
                        f"package; pip install {PACKAGES[backend][0]}, or set tracking.backend to none")
    return {"log_with": backend, "project_config": project}


def init_tracking(accelerator, tracking: TrackingConfig, paths: RunPaths, hparams: dict[str, Any]) -> None:
    """The tracker through accelerate on the main process; wandb falls back to offline; never stops training."""
    if tracking.backend == "none":
        return
    if tracking.backend != "wandb":
        try:
            # tensorboard's hparams and mlflow's params take scalars only: the config flattened to dotted keys
            kwargs = {"mlflow": {"run_name": tracking.run_name}} if tracking.run_name else {}
            accelerator.init_trackers(tracking.project, config=flat_config(hparams), init_kwargs=kwargs)
        except Exception as e:  # noqa: BLE001 - tracking must never stop training
            log.warning("%s init failed: %s; training continues without tracking", tracking.backend, e)
            accelerator.log_with = []
            accelerator.trackers = []
        return
    kwargs = {"wandb": {k: v for k, v in {"name": tracking.run_name, "entity": tracking.entity,
                                          "dir": str(paths.output_dir)}.items() if v}}
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
            accelerator.init_trackers(tracking.project, config=hparams, init_kwargs=kwargs)
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


def flat_config(hparams: dict[str, Any]) -> dict[str, str | int | float | bool]:
    """The config (as JSON values) as `{"train.lr": 0.001, ...}`: scalars as they are, lists and None as their
    text."""
    out: dict[str, str | int | float | bool] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value if isinstance(value, str | int | float | bool) else json.dumps(value)

    walk("", hparams)
    return out
