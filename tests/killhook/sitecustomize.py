"""Tests only: a real, uncatchable SIGKILL of an extraction or a training process at a chosen point, from
outside the package.

Python imports `sitecustomize` at start-up from the first folder of sys.path that has one; a test puts this
folder on the child's PYTHONPATH (tests/models.py `kill_after_batches`, `kill_after_checkpoint`):
- EAGLE3_TEST_KILL_AFTER_BATCHES=N: killed right after the N-th forward batch is written into a shard (on disk in
  the `.tmp` shard, not yet committed), the point a kill hurts most;
- EAGLE3_TEST_KILL_AFTER_CHECKPOINT=N: a trainer process killed right after its step-N checkpoint is complete
  (one machine of a multi-node run dying while the others go on).
And, no kill: EAGLE3_TEST_RECORD_ONLINE=DIR records every item online training is handed (tests/test_sglang_mooncake.py
compares them with an offline cache byte for byte).
"""

import os

_N = os.environ.get("EAGLE3_TEST_KILL_AFTER_BATCHES")
if _N:
    try:  # a process that inherits the variable but has no eagle3 (an engine server it launched) is left alone
        from eagle3 import cache
    except ImportError:
        cache = None
if _N and cache is not None:
    import signal

    _write = cache.ShardWriter.write
    _done = [0]

    def _write_then_maybe_die(self, rows):  # noqa: ANN001, ANN202 - the patched method's own signature
        _write(self, rows)
        _done[0] += 1
        if _done[0] >= int(_N):
            os.kill(os.getpid(), signal.SIGKILL)

    cache.ShardWriter.write = _write_then_maybe_die


_STEP = os.environ.get("EAGLE3_TEST_KILL_AFTER_CHECKPOINT")
if _STEP:
    try:
        from eagle3 import trainer
    except ImportError:
        trainer = None
if _STEP and trainer is not None:
    import signal

    _save = trainer.save_checkpoint

    def _save_then_maybe_die(accelerator, model, state, *a):  # noqa: ANN001, ANN202
        path = _save(accelerator, model, state, *a)
        if state.step >= int(_STEP):
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    trainer.save_checkpoint = _save_then_maybe_die


_RECORD = os.environ.get("EAGLE3_TEST_RECORD_ONLINE")
if _RECORD:
    try:
        from eagle3 import online
    except ImportError:
        online = None
if _RECORD and online is not None:
    import itertools

    _capture = online.capture_items
    _seen = itertools.count()

    def _capture_and_record(*a, **k):  # noqa: ANN002, ANN003, ANN202 - the patched function's own signature
        """EAGLE3_TEST_RECORD_ONLINE=DIR: every item online training is handed, as a safetensors file per item
        (`r<RANK>-<n>-<sample id>.safetensors`), for a test to compare byte for byte with an offline cache."""
        from safetensors.torch import save_file

        items = _capture(*a, **k)
        rank = os.environ.get("RANK", "0")
        for it in items:
            tensors = {key: v.contiguous() for key, v in it.items() if hasattr(v, "contiguous")}
            save_file(tensors, os.path.join(_RECORD, f"r{rank}-{next(_seen)}-{it['sample_id']}.safetensors"))
        return items

    online.capture_items = _capture_and_record
