"""eagle3.targets.info: the one reader of the target's config.json, plain and Kimi-wrapped."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from models import kimi_wrapped, tiny_llama

from eagle3.cache import expected_fingerprint
from eagle3.config import Config
from eagle3.targets.info import TargetInfo, read_target_info

PKG = Path(__file__).resolve().parent.parent / "eagle3"


def test_plain_and_wrapped_targets_read_alike(tmp_path):
    llama = read_target_info(tiny_llama(tmp_path / "llama", layers=6))
    assert not llama.wrapped and (llama.num_layers, llama.hidden_size, llama.vocab_size) == (6, 64, 256)
    assert llama.family == "llama" and llama.architectures == ["LlamaForCausalLM"]
    kimi = read_target_info(kimi_wrapped(tmp_path / "kimi"))
    assert kimi.wrapped and (kimi.num_layers, kimi.hidden_size, kimi.vocab_size) == (4, 64, 256)
    assert kimi.family == "deepseek" and kimi.architectures == kimi.config["architectures"]
    assert kimi.model_type == kimi.config["model_type"] and kimi.text["model_type"] == "deepseek_v3"
    assert read_target_info(tmp_path / "kimi") == kimi  # a Path reads the same as a str


def test_tied_and_missing_fields(tmp_path):
    assert TargetInfo.of({"num_hidden_layers": 2, "tie_word_embeddings": True}).tied
    assert TargetInfo.of({"text_config": {"num_hidden_layers": 2}, "tie_word_embeddings": True}).tied
    assert not TargetInfo.of({"text_config": {"num_hidden_layers": 2, "tie_word_embeddings": False},
                              "tie_word_embeddings": True}).tied
    with pytest.raises(ValueError, match="missing 'hidden_size' \\(looked in text_config\\)"):
        _ = TargetInfo.of({"text_config": {"num_hidden_layers": 2}}).hidden_size
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_target_info(tmp_path)


def test_the_fingerprint_records_the_wrappers_architectures(tmp_path):
    cfg = Config()
    cfg.target.path = str(kimi_wrapped(tmp_path / "kimi"))
    fp = expected_fingerprint(cfg.target, cfg.extract.storage, {"samples_fingerprint": "p", "max_length": 64})
    assert fp["architectures"] == json.loads((tmp_path / "kimi" / "config.json").read_text())["architectures"]
    assert (fp["num_layers"], fp["hidden_size"]) == (4, 64)


def test_only_the_info_module_reads_a_targets_config_json():
    """Other modules read a *draft's* config.json (export, model, evaluation engines) but never open the
    target's: every `text_config` lookup lives in eagle3/targets/info.py."""
    readers = []
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == "text_config":
                readers.append(str(path.relative_to(PKG)))
    assert sorted(set(readers)) == ["targets/info.py"]


def _calls(attr: str) -> set[str]:
    """Modules of the package that call `<something>.<attr>(...)`."""
    out = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr:
                out.add(str(path.relative_to(PKG)))
    return out


def test_one_capture_hook_and_one_eos_rule():
    """The layer hooks extraction and evaluation read states through are one helper (targets/hf.LayerTap);
    verify-extraction keeps its own norm hook on purpose (the independent witness), and reads layers through
    output_hidden_states, not hooks."""
    assert _calls("register_forward_pre_hook") == {"targets/hf.py"}
    assert _calls("register_forward_hook") == {"targets/hf.py", "verify_extraction.py"}
    readers = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == "eos_token_id":
                readers.add(str(path.relative_to(PKG)))
    assert readers == {"targets/hf.py"}
