"""The Kimi-K2.5 recipe on CPU: configs/kimi-k2.5.yaml, shrunk by overrides only, run end to end on a tiny random
DeepseekV3 (MLA + MoE) wrapped the way Kimi-K2.5 ships (multimodal config, `language_model.` weights) with a
tokenizer carrying Kimi's exact special ids (vocab 163840):
prepare (kimi-k2.5 template) -> extract (HF backend) -> train (a few steps, teacher in vocab chunks) -> export -> eval.

    pytest -q tests/test_kimi_recipe.py            # add -m slow if it is marked slow

The 8-GPU run differs only in sizes and in the extraction backend (SGLang, tested in test_sglang_backend.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from agentic_data import good_records
from models import kimi_wrapped
from tokenizer_builders import kimi_test_tokenizer

from eagle3.config import Config, load_config

REPO = Path(__file__).resolve().parent.parent
IDS = [2, 3, 4]  # a 6-layer miniature of Kimi's [2, 30, 58] (low, mid, high)
ORIGINAL, WINDOW = 512, 4096
KIMI_YARN = {"rope_type": "yarn", "factor": WINDOW / ORIGINAL, "original_max_position_embeddings": ORIGINAL,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
"""Kimi-K2.5's YaRN (factor 64 over 4,096 positions) in miniature: factor 8 over 512."""
LONG_TOKENS = 2600
"""The long sample: ~5x the tiny target's original window, as a 32K trace is 8x Kimi's."""


def recipe_cfg(root: Path, target: Path, data: Path, head: list[str]) -> Config:
    return load_config(REPO / "configs" / "kimi-k2.5.yaml", [
        f"output_dir={root / 'run'}", f"target.path={target}", "target.backend=hf", "target.device=cpu",
        "target.dtype=float32", "target.num_layers=6", f"target.aux_layer_ids={IDS}",
        f"data.sources=[{{path: {data}}}]", "data.eval_size=3", f"data.max_length={WINDOW}", "data.num_proc=1",
        "draft.vocab_size=96", "draft.hidden_size=null", "draft.num_attention_heads=null",
        "draft.num_key_value_heads=null", "draft.head_dim=null", "draft.intermediate_size=null",
        "extract.shard_samples=8",
        "train.max_steps=4", f"train.batch_tokens={WINDOW}", "train.grad_accum=1", "train.mixed_precision='no'",
        "train.loss_chunk_rows=1024",
        "train.eval_every=2", "train.save_every=2", "train.log_every=1", "train.lr=3e-3",
        "eval.prompt_sets=[eval-split]", "eval.max_prompts=2", "eval.max_new_tokens=12", "eval.engine=builtin", "eval.builtin=true",
        *head,
    ])


HEADS = {
    "llama": ["draft.arch=llama"],
    # The published Kimi-K2.5 MLA head's kind: MLA layer, full target vocab (no d2t), with EAGLE-3.1's options.
    "mla-3.1-full-vocab": ["draft.arch=mla", "draft.fc_norm=true", "draft.norm_output=true",
                           "draft.vocab_size=163840"],
}


@pytest.fixture(scope="module", params=list(HEADS))
def kimi_run(tmp_path_factory, request) -> dict:
    from eagle3 import prepare
    from eagle3.extract import run as extract
    from eagle3.trainer import run as train

    root = tmp_path_factory.mktemp("kimi")
    target = kimi_wrapped(root / "kimi", vocab=163840, layers=6)
    conf = target / "config.json"
    wrapper = json.loads(conf.read_text())
    theta = wrapper["text_config"].get("rope_parameters", {}).get("rope_theta", 10000.0)
    wrapper["text_config"].update(max_position_embeddings=WINDOW, rope_scaling=KIMI_YARN,
                                  rope_parameters={**KIMI_YARN, "rope_theta": theta})
    conf.write_text(json.dumps(wrapper, indent=2))
    kimi_test_tokenizer(target)
    data = root / "chats.jsonl"
    chats = [{"messages": [
        {"role": "system", "content": "You are Kimi."},
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."}]} for i in range(14)]
    # One long trace (the tokenizer spells plain text byte by byte): a long document in, a long answer out.
    long = {"id": "long-trace", "messages": [
        {"role": "system", "content": "You are Kimi."},
        {"role": "user", "content": "Summarise: " + " ".join(f"line {i} of the log" for i in range(LONG_TOKENS // 32))},
        {"role": "assistant", "content": " ".join(f"step {i} done" for i in range(LONG_TOKENS // 24))}]}
    # agentic traffic: tools declared, parallel calls, their results, text before a call, a call-only answer
    data.write_text("\n".join(json.dumps(r) for r in [*chats, *good_records(4), long]))
    cfg = recipe_cfg(root, target, data, HEADS[request.param])
    return {"cfg": cfg, "head": request.param, "prepare": prepare.run(cfg), "extract": extract(cfg),
            "train": train(cfg)}


def test_recipe_prepare_extract_train(kimi_run):
    cfg = kimi_run["cfg"]
    from eagle3.cache import summary
    from eagle3.data.prepared import load_prepared

    p = load_prepared(cfg.prepared_dir)
    assert p.t2d.shape == (163840,) and p.d2t.shape == (cfg.draft.vocab_size,)
    row = p.train[0]
    assert row["input_ids"][0] == 163594  # <|im_system|>: Kimi's template, no BOS, no newlines between turns
    masked = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
    assert masked[-1] == 163586  # the loss covers each answer's <|im_end|>
    assert p.t2d[163586]
    # a conversation with tools: the tool-call section (every marker and the arguments) is trained, the tool
    # declaration and the results are not
    rows = [r for r in [*p.train, *p.eval] if r["id"].startswith("par")]
    assert rows, "the agentic record with parallel calls and results was not prepared"
    ids, mask = rows[0]["input_ids"], rows[0]["loss_mask"]
    assert ids[:3] == [163594, *list(b"to")]  # <|im_system|>tool_declare<|im_middle|> opens the sample
    assert not any(mask[: ids.index(163586) + 1])  # the whole declaration turn is prompt
    markers = {163595: 1, 163596: 1, 163597: 2, 163598: 2, 163599: 2}  # section begin/end, 2 x call begin/args/end
    assert {t: ids.count(t) for t in markers} == markers
    assert all(m for t, m in zip(ids, mask, strict=True) if t in markers)
    result = list(b"## Return of functions.get_weather:0\n")
    start = next(i for i in range(len(ids)) if ids[i:i + len(result)] == result)
    assert not any(mask[start - 3:start + len(result)])  # the result turn's header and text are prompt

    # The long trace is prepared whole, past the target's original window, and its states are in the cache.
    long = next(r for r in [*p.train, *p.eval] if r["id"] == "long-trace")
    assert ORIGINAL * 4 < len(long["input_ids"]) <= WINDOW and sum(long["loss_mask"]) > ORIGINAL
    s = summary(cfg.cache_dir)
    assert s["splits"]["train"]["tokens"] + s["splits"]["eval"]["tokens"] == sum(
        len(r["input_ids"]) for r in [*p.train, *p.eval])
    assert s["fingerprint"]["layer_ids"] == IDS and s["fingerprint"]["hidden_size"] == 64
    assert s["fingerprint"]["num_layers"] == 6 and s["fingerprint"]["layer_id_convention"] == "input-of-layer"
    assert kimi_run["extract"]["samples"] == len(p.train) + len(p.eval)

    log = [json.loads(x) for x in (Path(cfg.output_dir) / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps][-1] == 4
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    best = json.loads((cfg.checkpoint_dir / "best" / "config.json").read_text())
    if cfg.draft.arch == "mla":  # the MLA head rotates as the target does, at the long sample's positions too
        assert best["rope_scaling"]["factor"] == WINDOW / ORIGINAL
        assert best["rope_scaling"]["original_max_position_embeddings"] == ORIGINAL
    else:  # a Llama layer on an MLA target rotates plainly (eagle3.model.Eagle3DraftConfig.from_target)
        assert best["rope_scaling"] is None
    assert (best["arch"], best["fc_norm"], best["norm_output"]) == (
        cfg.draft.arch, cfg.draft.fc_norm, cfg.draft.norm_output)
    if cfg.draft.arch == "mla":  # the target's own MLA dimensions (tests/models.py)
        assert (best["q_lora_rank"], best["kv_lora_rank"], best["qk_rope_head_dim"]) == (32, 16, 8)


def test_recipe_export_spells_kimi_ids(kimi_run, tmp_path):
    from eagle3.export import export

    cfg = kimi_run["cfg"]
    for to in ("sglang", "vllm"):
        out = tmp_path / to
        export(cfg.checkpoint_dir / "best", out, to=to)
        c = json.loads((out / "config.json").read_text())
        # Where each export keeps the ids (a missing key fails, where `.get` fell back to the other place)
        ids = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] if to == "sglang" or cfg.draft.arch == "mla" \
            else c["eagle_aux_hidden_state_layer_ids"]
        # DeepSeek family: vLLM takes eagle3's ids as-is; SGLang (0.5.23 and earlier alike) reads [1, 2, 3] as
        # inputs of layers 2, 3, 4 (a list starting at 1 is shifted by one there)
        assert ids == (IDS if to == "vllm" else [i - 1 for i in IDS])
        assert c["draft_vocab_size"] == cfg.draft.vocab_size
        assert c["architectures"] == (["Eagle3DeepseekV2ForCausalLM"] if cfg.draft.arch == "mla" else
                                      ["LlamaForCausalLMEagle3"])


def test_recipe_eval_builtin(kimi_run):
    from eagle3.evaluate import run as evaluate

    cfg = kimi_run["cfg"]
    cfg.eval.checkpoint = str(cfg.checkpoint_dir / "best")
    report = evaluate(cfg)
    result = report["sets"]["eval-split"]
    assert result["greedy_mismatches"] == 0  # speculation never changes the target's greedy output
    assert 1.0 <= result["tau"] <= 1 + cfg.eval.num_steps
    assert (cfg.eval_dir / "report.json").is_file() and (cfg.eval_dir / "report.png").is_file()


def test_the_online_recipe_gives_every_machine_its_command(tmp_path):
    """recipes/kimi-k2.5-8xh200/online.sh, each role with `eagle3` and `accelerate` stood in by scripts that record
    their command line and environment: one config (configs/kimi-k2.5.yaml with the same overrides) everywhere, valid
    as every stage loads it; the server listening on every interface and telling the store its address; the trainer
    nodes' launcher, world size and rank."""
    import os
    import shlex
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("eagle3", "accelerate"):
        (bin_dir / tool).write_text(f'#!/bin/bash\necho "{tool} $* HOST=$EAGLE3_MOONCAKE_HOSTNAME" >> {tmp_path}/calls\n')
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MODEL": "/models/K2.5",
           "MASTER": "10.0.0.1:50051", "SERVERS": "http://10.0.0.1:30000,http://10.0.0.2:30000",
           "TRAINER_NODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.1.1", "HOST_IP": "10.0.0.2",
           "STORAGE": "fp8"}
    for role in ("master", "server", "prepare", "check", "train"):
        r = subprocess.run(["bash", "recipes/kimi-k2.5-8xh200/online.sh", role], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c.split()[:3] for c in calls] == [["eagle3", "mooncake", "master"], ["eagle3", "sglang", "serve"],
                                             ["eagle3", "prepare", "--config"], ["eagle3", "mooncake", "check"],
                                             ["accelerate", "launch", "--config_file"]]
    assert "--host 0.0.0.0" in calls[1] and calls[1].endswith("HOST=10.0.0.2")
    train = calls[4]
    assert "recipes/accelerate/fsdp-2x8gpu.yaml --num_machines 2 --num_processes 16 --machine_rank 1" in train
    assert "--main_process_ip 10.0.1.1" in train
    words = shlex.split(calls[2].rsplit(" HOST=", 1)[0])
    cfg = load_config(REPO / words[words.index("--config") + 1], words[words.index("--config") + 2:])
    s = cfg.target.sglang
    assert (cfg.extract.mode, cfg.extract.storage, s.transport) == ("online", "fp8", "mooncake")
    assert s.url == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"] and s.mooncake.master == "10.0.0.1:50051"
    assert s.mooncake.clients == 16 and cfg.target.path == "/models/K2.5"
