"""Export to SGLang / vLLM: names, dtypes and layer-id spelling per engine and target family; exact reload; errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3.export import ExportError, export
from eagle3.formats import load_draft, save_draft
from eagle3.model import Eagle3Draft, Eagle3DraftConfig

VOCAB, DRAFT_VOCAB, H = 200, 48, 32
FAMILIES = {
    "llama": {"path": "/models/tiny-llama", "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "num_layers": 12},
    "deepseek": {"path": "/models/tiny-kimi", "architectures": ["DeepseekV3ForCausalLM"],
                 "model_type": "deepseek_v3", "num_layers": 12},
}


def make_draft(family: str = "llama", ids: list[int] | None = None, seed: int = 0) -> Eagle3Draft:
    cfg = Eagle3DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            intermediate_size=64, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=H,
                            rope_theta=10000.0, max_position_embeddings=512, aux_layer_ids=ids or [2, 6, 9],
                            target=dict(FAMILIES[family]))
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg, embed_weight=torch.randn(VOCAB, H))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.2)  # norms too: nothing that an export could get right by accident
    target_ids = torch.sort(torch.randperm(VOCAB)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    draft.set_vocab(target_ids - torch.arange(DRAFT_VOCAB), t2d)
    return draft


def _outputs(draft: Eagle3Draft) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    dtype = draft.fc.weight.dtype
    aux = torch.randn(1, 7, 3 * H, generator=g).to(dtype)
    ids = torch.randint(0, VOCAB, (1, 7), generator=g)
    with torch.no_grad():
        hidden, logits, _ = draft.decode(ids, draft.project(aux), torch.arange(7)[None], None)
    return hidden, logits


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("family", ["llama", "deepseek"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_export_names_dtypes_ids(tmp_path, engine, family):
    draft = make_draft(family)
    src = save_draft(draft, tmp_path / "draft")
    out = export(src, tmp_path / "out", to=engine)
    cfg = json.loads((out / "config.json").read_text())
    t = _tensors(out)
    prefix = "midlayer." if engine == "sglang" else "layers.0."
    assert sorted(k for k in t if "self_attn" in k or "mlp" in k or "norm" in k) == sorted(
        [f"{prefix}{k}" for k in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight", "hidden_norm.weight", "input_layernorm.weight",
                                  "post_attention_layernorm.weight")] + ["norm.weight"])
    assert not any(k.startswith("embed_tokens") for k in t)
    assert t["fc.weight"].shape == (H, 3 * H) and t[f"{prefix}self_attn.q_proj.weight"].shape == (32, 2 * H)
    assert t["lm_head.weight"].shape == (DRAFT_VOCAB, H)
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in t.items() if k not in ("d2t", "t2d"))
    assert torch.equal(t["d2t"], draft.d2t) and torch.equal(t["t2d"], draft.t2d)

    # ids: eagle3 [2, 6, 9] = inputs of layers 2, 6, 9. SGLang Llama adds 1 -> write k-1; SGLang DeepSeek/Kimi
    # (0.5.23) adds 1 only to lists starting at 1 and earlier releases to every list, so [1, 5, 8] means the same
    # layers to both; vLLM as-is.
    expected = [1, 5, 8] if engine == "sglang" else [2, 6, 9]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle3_aux_layer_ids"] == [2, 6, 9]
    assert cfg["eagle3"]["aux_layer_ids"] == [2, 6, 9] and cfg["eagle3"]["layer_id_convention"] == "input-of-layer"
    assert cfg["eagle3"]["target"]["architectures"] == FAMILIES[family]["architectures"]
    if engine == "sglang":
        assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": expected, "use_aux_hidden_state": True}
        llama = cfg
        assert (cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (DRAFT_VOCAB, H)
    else:
        assert cfg["eagle_aux_hidden_state_layer_ids"] == expected
        assert cfg["speculators_model_type"] == "eagle3"
        assert cfg["norm_before_residual"] is False and cfg["norm_before_fc"] is False
        sc = cfg["speculators_config"]
        assert sc["algorithm"] == "eagle3" and sc["proposal_methods"][0]["speculative_tokens"] == 3
        assert sc["verifier"]["name_or_path"] == FAMILIES[family]["path"]
        assert (cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (DRAFT_VOCAB, H)
        llama = cfg["transformer_layer_config"]
    assert llama["model_type"] == "llama" and llama["num_hidden_layers"] == 1
    assert llama["vocab_size"] == VOCAB and llama["tie_word_embeddings"] is False
    assert (llama["hidden_size"], llama["num_attention_heads"], llama["num_key_value_heads"], llama["head_dim"],
            llama["intermediate_size"]) == (H, 4, 2, 8, 64)
    assert llama["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("family", ["llama", "deepseek"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_reload_of_export_reproduces_outputs_bit_exact(tmp_path, engine, family):
    draft = make_draft(family, seed=3)
    src = save_draft(draft, tmp_path / "draft")
    embed = draft.embed_tokens.weight
    # Kept dtype (float32): the reload equals the trained head.
    out = export(src, tmp_path / "f32", to=engine, dtype=None)
    back = load_draft(out, embed_weight=embed)
    assert back.config.aux_layer_ids == [2, 6, 9]
    assert torch.equal(back.d2t, draft.d2t) and torch.equal(back.t2d, draft.t2d)
    for a, b in zip(_outputs(draft), _outputs(back), strict=True):
        assert torch.equal(a, b)
    # bf16 export: the reload equals the head cast to bf16.
    out = export(src, tmp_path / "bf16", to=engine)
    back = load_draft(out, embed_weight=embed, dtype=torch.bfloat16)
    ref = make_draft(family, seed=3).to(torch.bfloat16)
    for a, b in zip(_outputs(ref), _outputs(back), strict=True):
        assert torch.equal(a, b)


def test_accepts_step_folder_and_existing_export(tmp_path):
    draft = make_draft()
    save_draft(draft, tmp_path / "checkpoints" / "step_10" / "draft")
    a = export(tmp_path / "checkpoints" / "step_10", tmp_path / "sg", to="sglang")
    b = export(a, tmp_path / "vl", to="vllm")  # re-export of an export
    c = export(b, tmp_path / "sg2", to="sglang")
    ta, tc = _tensors(a), _tensors(c)
    assert ta.keys() == tc.keys() and all(torch.equal(ta[k], tc[k]) for k in ta)
    assert json.loads((a / "config.json").read_text()) == json.loads((c / "config.json").read_text())
    # re-exporting over a previous export replaces it; a foreign folder is never overwritten
    export(tmp_path / "checkpoints" / "step_10", tmp_path / "sg", to="sglang")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="refusing to overwrite"):
        export(a, tmp_path / "mine", to="vllm")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_cli_export(tmp_path):
    from eagle3.cli import main

    src = save_draft(make_draft(), tmp_path / "draft")
    assert main(["export", "--to", "vllm", str(src), str(tmp_path / "v")]) == 0
    with safe_open(str(tmp_path / "v" / "model.safetensors"), "pt") as f:
        assert "layers.0.self_attn.q_proj.weight" in f.keys()


def _corrupt(tmp_path: Path, edit_cfg=None, edit_tensors=None) -> Path:
    src = save_draft(make_draft(), tmp_path / "draft")
    if edit_cfg:
        cfg = json.loads((src / "config.json").read_text())
        edit_cfg(cfg)
        (src / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        t = _tensors(src)
        edit_tensors(t)
        save_file(t, str(src / "model.safetensors"))
    return src


def _shift_d2t(t):
    t["d2t"] = t["d2t"].clone()
    t["d2t"][3] += 1


def _drop_t2d(t):
    t["t2d"] = t["t2d"].clone()
    t["t2d"][torch.nonzero(t["t2d"])[0]] = False


@pytest.mark.parametrize("case, edit_cfg, edit_tensors, message", [
    ("no draft vocab", lambda c: c.update(draft_vocab_size=None), None, "draft_vocab_size is missing"),
    ("no ids", lambda c: c.update(aux_layer_ids=None), None, "aux_layer_ids"),
    ("other convention", lambda c: c.update(layer_id_convention="output-of-layer"), None, "layer_id_convention"),
    ("no target family", lambda c: c.update(target={}), None, "architectures/model_type"),
    ("sglang cannot spell id 0", lambda c: c.update(aux_layer_ids=[0, 6, 9]), None, "cannot express layer id 0"),
    ("d2t length", lambda c: c.update(draft_vocab_size=DRAFT_VOCAB + 1), None, "d2t has 48 entries"),
    ("t2d sum", None, _drop_t2d, "t2d marks 47"),
    ("d2t vs t2d", None, _shift_d2t, "d2t is inconsistent with t2d"),
    ("lm_head rows", None, lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:-1].clone()}),
     "lm_head.weight has shape"),
    ("missing tensor", None, lambda t: t.pop("midlayer.hidden_norm.weight"), "tensors missing"),
    ("float d2t", None, lambda t: t.update(d2t=t["d2t"].float()), "integer tensor"),
])
def test_contradictory_inputs_are_errors(tmp_path, case, edit_cfg, edit_tensors, message):
    src = _corrupt(tmp_path, edit_cfg, edit_tensors)
    with pytest.raises(ExportError, match=message):
        export(src, tmp_path / "out", to="sglang")
    assert not (tmp_path / "out").exists()


def test_vllm_needs_verifier_and_deepseek_refuses_first_id_1(tmp_path):
    src = _corrupt(tmp_path, lambda c: c["target"].update(path=None))
    with pytest.raises(ExportError, match="verifier"):
        export(src, tmp_path / "v", to="vllm")
    ds = save_draft(make_draft("deepseek", ids=[1, 6, 9]), tmp_path / "ds")
    with pytest.raises(ExportError, match="first value is 1"):
        export(ds, tmp_path / "s", to="sglang")
    assert export(ds, tmp_path / "v2", to="vllm")  # vLLM spells it as-is


def test_full_vocab_head_has_no_mapping_in_the_vllm_export(tmp_path):
    cfg = make_draft().config
    cfg.draft_vocab_size = VOCAB
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg, embed_weight=torch.randn(VOCAB, H))
    draft.set_vocab(torch.zeros(VOCAB, dtype=torch.int64), torch.ones(VOCAB, dtype=torch.bool))
    save_draft(draft, tmp_path / "draft")
    vllm = export(tmp_path / "draft", tmp_path / "vllm", to="vllm", dtype=None)
    assert "d2t" not in _tensors(vllm) and "t2d" not in _tensors(vllm)  # vLLM 0.32 rejects them for a full vocab
    sglang = export(tmp_path / "draft", tmp_path / "sglang", to="sglang", dtype=None)
    assert _tensors(sglang)["d2t"].dtype == torch.int64
    again = load_draft(vllm, embed_weight=draft.embed_tokens.weight)
    for a, b in zip(_outputs(draft), _outputs(again)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "bad-json"])
def test_a_damaged_draft_folder_is_one_error_naming_it(tmp_path, damage):
    """A truncated or overwritten head (a copy cut short): export, eval and init_from all read it through
    eagle3.formats, which names the folder instead of surfacing a safetensors or JSON traceback."""
    from eagle3.cli import main
    from eagle3.logs import user_message

    src = tmp_path / "draft"
    save_draft(make_draft(), src)
    weights = src / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "garbage":
        weights.write_bytes(b"\xff" * 64 + weights.read_bytes()[64:])
    else:
        (src / "config.json").write_text('{"architectures": [')
    want = "not valid JSON" if damage == "bad-json" else "the weights cannot be read .*damaged or incomplete"
    with pytest.raises(ExportError, match=want) as e:
        main(["export", "--to", "sglang", str(src), str(tmp_path / "out")])
    assert str(src) in str(e.value) and user_message(e.value) is not None
    assert not (tmp_path / "out").exists()


def test_sglang_spellings_come_from_a_table_read_in_sglang():
    """SGLang 0.5.23's models spell ids two ways (models/*.py set_eagle3_layers_to_capture): +1 to every id
    (Llama, Qwen, Gemma, gpt-oss, GLM-4.5 MoE, ...), or +1 only when the first id is 1 (DeepSeek V2/V3/V3.2,
    Kimi-K2.5, and GLM-4.7-Flash's Glm4MoeLite, which the old name rule took for a Llama)."""
    from eagle3.layer_ids import arch_family, known_family, to_engine_ids

    assert arch_family(["Glm4MoeLiteForCausalLM"], "glm4_moe_lite") == "deepseek"
    assert arch_family(["Qwen3MoeForCausalLM"]) == arch_family(["GptOssForCausalLM"]) == "llama"
    assert arch_family(["KimiK25ForConditionalGeneration"]) == "deepseek" and known_family(["DeepseekV3ForCausalLM"])
    assert to_engine_ids([3, 24, 44], "sglang", arch_family(["Glm4MoeLiteForCausalLM"])) == [3, 24, 44]
    assert to_engine_ids([3, 24, 44], "sglang", arch_family(["Qwen3ForCausalLM"])) == [2, 23, 43]
    assert not known_family(["SomeNewForCausalLM"]) and arch_family(["SomeNewForCausalLM"]) == "llama"


def test_an_architecture_outside_the_table_is_refused_for_sglang_unless_the_family_is_given(tmp_path):
    """A guessed spelling serves the head on the layers next to the trained ones with no error; the old code
    exported `SomeNewForCausalLM` as a Llama with a warning. Now: refused naming both overrides; with one, the ids
    are that family's; vLLM (ids as-is for every family) exports without it."""
    from eagle3.cli import main

    draft = make_draft()
    draft.config.target = {"path": "/models/new", "architectures": ["SomeNewForCausalLM"], "model_type": "some_new",
                           "num_layers": 12}
    src = save_draft(draft, tmp_path / "draft")
    with pytest.raises(ExportError, match=r"\['SomeNewForCausalLM'\] are not in eagle3's table.*"
                                          r"target.layer_id_family.*--target-family"):
        export(src, tmp_path / "refused", to="sglang")
    assert not (tmp_path / "refused").exists()
    ids = {}
    for family in ("llama", "deepseek"):
        assert main(["export", "--to", "sglang", "--target-family", family, str(src), str(tmp_path / family)]) == 0
        ids[family] = json.loads((tmp_path / family / "config.json").read_text())["eagle_config"][
            "eagle_aux_hidden_state_layer_ids"]
    assert ids == {"llama": [1, 5, 8], "deepseek": [1, 5, 8]}  # first id 2: both spellings write k-1
    vllm = export(src, tmp_path / "vllm", to="vllm")
    assert json.loads((vllm / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 6, 9]


def test_the_family_override_decides_where_the_spellings_differ(tmp_path):
    draft = make_draft(ids=[3, 6, 9])
    draft.config.target = {"path": "/models/new", "architectures": ["SomeNewForCausalLM"], "num_layers": 12}
    src = save_draft(draft, tmp_path / "draft")
    got = {f: json.loads((export(src, tmp_path / f, to="sglang", target_family=f) / "config.json").read_text())
           ["eagle_config"]["eagle_aux_hidden_state_layer_ids"] for f in ("llama", "deepseek")}
    assert got == {"llama": [2, 5, 8], "deepseek": [3, 6, 9]}


def test_training_names_the_missing_family_and_skips_only_the_sglang_export(tmp_path):
    from eagle3.config import Config
    from eagle3.trainer import sglang_spelling_problem

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({
        "architectures": ["SomeNewForCausalLM"], "model_type": "some_new", "num_hidden_layers": 12}))
    cfg = Config()
    cfg.target.path = str(tmp_path / "target")
    assert "no SGLang export of the best head will be written" in sglang_spelling_problem(cfg.target)
    assert "target.layer_id_family" in sglang_spelling_problem(cfg.target)
    cfg.target.layer_id_family = "deepseek"
    assert sglang_spelling_problem(cfg.target) is None


def test_every_export_ships_a_model_card_of_its_run(tmp_path):
    """The export's README.md says the target and its weights id, the layer ids in the engine's spelling, the head,
    the data (sources, samples, tokens, mixture), the training budget, the run's last card and the serve command;
    an export of a head with no run around it says what is not recorded instead of guessing."""
    run = tmp_path / "run"
    save_draft(make_draft("deepseek"), run / "checkpoints" / "best")
    (run / "prepared").mkdir(parents=True)
    (run / "prepared" / "meta.json").write_text(json.dumps({"chat_template": "kimi-k2.5", "max_length": 32768,
        "summary": {"train_samples": 40, "train_tokens": 9000, "eval_samples": 2, "train_sources": [
            {"name": "sharegpt", "samples": 30, "tokens": 6000, "weight": 1.0, "epoch0_share": 0.25,
             "epoch0_repeat": 0.375},
            {"name": "agentic", "samples": 10, "tokens": 3000, "weight": 3.0, "epoch0_share": 0.75,
             "epoch0_repeat": 2.25}]}}))
    (run / "cache").mkdir()
    (run / "cache" / "meta.json").write_text(json.dumps({"fingerprint": {"weights_id": "abc123", "revision": None,
                                                                          "storage": "fp8", "dtype": "bfloat16"},
                                                          "layout": {"world_size": 1, "max_samples": 25}}))
    (run / "train_log.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 1, "loss": 9.0, "lr": 1e-4, "tokens_per_s": 100.0, "step_s": 2.0, "epoch": 0},
        {"step": 2, "loss": 8.0, "lr": 2e-4, "tokens_per_s": 100.0, "step_s": 2.0, "epoch": 1},
        {"step": 2, "eval": {"sim_accept_len": 2.345}}]))
    (run / "eval").mkdir()
    (run / "eval" / "report.json").write_text(json.dumps({
        "draft": str(run / "checkpoints" / "best"), "sets": {"bfcl": {}},
        "settings": {"num_steps": 3, "topk": 1, "num_draft_tokens": 4, "temperature": 0.0, "max_new_tokens": 64},
        "target": {"dtype": "bfloat16"},
        "card": [{"set": "bfcl", "turns": 70, "tau": 2.5, "tokens_per_forward": 2.4},
                 {"set": "bfcl/simple_python", "turns": 10, "tau": 2.75, "tokens_per_forward": 2.6}],
        "engines": {"sglang": {"tau": 2.49, "builtin_tau": 2.5}}}))
    out = export(run / "checkpoints" / "best", tmp_path / "sg", to="sglang")
    card = (out / "README.md").read_text()
    for part in ("/models/tiny-kimi", "weights id `abc123`", "eagle3 ids [2, 6, 9]", "spelling in this folder: [1, 5, 8]",
                 "template `kimi-k2.5`, max length 32768, 40 train samples (9000 tokens)",
                 "source `agentic`: 10 samples, 3000 tokens; weight 3: 75.0% of an epoch's tokens (x2.25)",
                 "trained on: the first 25 train samples (extract.max_samples)",
                 "2 steps over 2 epoch(s) of the train split, peak lr 0.0002", "best held-out simulated acceptance length 2.345 (step 2)",
                 "| bfcl/simple_python | 10 | 2.750 |", "sglang: τ 2.490",
                 f"--speculative-draft-model-path {out.resolve()} --speculative-num-steps 3"):
        assert part in card, (part, card)
    # a run whose cache lives elsewhere (extract.cache_dir): the trainer's export passes the run's paths
    from eagle3.paths import RunPaths

    (run / "cache").rename(tmp_path / "elsewhere")
    moved = export(run / "checkpoints" / "best", tmp_path / "sg-moved", to="sglang")
    assert "weights id" not in (moved / "README.md").read_text()
    moved = export(run / "checkpoints" / "best", tmp_path / "sg-moved", to="sglang",
                   paths=RunPaths.under(run, cache_dir=tmp_path / "elsewhere"))
    assert "weights id `abc123`" in (moved / "README.md").read_text()
    # a report older than the head (the folder trained again since) is not presented as this head's
    import os

    os.utime(run / "eval" / "report.json", (1, 1))
    stale = (export(run / "checkpoints" / "best", tmp_path / "sg-stale", to="sglang") / "README.md").read_text()
    assert "predates this head" in stale and "| bfcl |" not in stale
    # the card travels with re-exports, and a re-export replaces a previous one
    again = export(out, tmp_path / "vl", to="vllm")
    assert "vllm serve /models/tiny-kimi --speculative-config" in (again / "README.md").read_text()
    assert "no training log next to the checkpoint" in (again / "README.md").read_text()
    export(run / "checkpoints" / "best", tmp_path / "sg", to="sglang")


def test_the_hybrid_rule_is_exported_beside_the_head_and_read_back(tmp_path, monkeypatch):
    """`eagle3 export --hybrid FILE`: the router lands in the export's subfolder (vLLM loads the head's folder as
    before: no new tensor, no config change), EAGLE3_HYBRID=auto reads it back as written, the card serves it with
    one command, for vLLM and for SGLang (which refuses a router on the head's probabilities); a malformed rule is
    refused, and a plain re-export drops the rule."""
    from eagle3.cli import main
    from eagle3.engines.hybrid_rule import FEATURES, RULE_FILE, exported_rule, settings

    src = save_draft(make_draft(), tmp_path / "draft")
    router = {"rule": "router", "features": list(FEATURES),
              "weights": {"suffix": [0.5] * (len(FEATURES) + 1), "ngram": [-0.1] * (len(FEATURES) + 1)}}
    (tmp_path / "router.json").write_text(json.dumps(router))
    plain = export(src, tmp_path / "plain", to="vllm")
    assert main(["export", "--to", "vllm", "--hybrid", str(tmp_path / "router.json"), str(src),
                 str(tmp_path / "v")]) == 0
    out = tmp_path / "v"
    assert exported_rule(out) == router
    assert json.loads((out / RULE_FILE).read_text()) == router
    assert (out / "config.json").read_text() == (plain / "config.json").read_text()
    assert _tensors(out).keys() == _tensors(plain).keys()
    card = (out / "README.md").read_text()
    assert "EAGLE3_HYBRID=auto vllm serve" in card and '"disable_padded_drafter_batch": true' in card, card
    monkeypatch.setenv("EAGLE3_HYBRID", "auto")
    assert settings() == {"rule": "auto"}

    # SGLang serves the pairing too, but its chain keeps no head probabilities: a router on them is vLLM's only
    with pytest.raises(ExportError, match="served by vLLM only"):
        export(src, tmp_path / "s", to="sglang", hybrid=router)
    model_free = {"rule": "router", "features": ["suffix_score", "suffix_agree"], "weights": {"suffix": [1, 1, -1]}}
    sg = export(src, tmp_path / "s", to="sglang", hybrid=model_free)
    assert exported_rule(sg) == model_free
    assert "EAGLE3_HYBRID=auto python -m sglang.launch_server" in (sg / "README.md").read_text()
    with pytest.raises(ExportError, match=f"each with {len(FEATURES) + 1} numbers"):
        export(src, tmp_path / "bad", to="vllm", hybrid={**router, "weights": {"suffix": [1.0, 2.0]}})
    with pytest.raises(ValueError, match="has no eagle3_hybrid/rule.json"):
        exported_rule(plain)
    export(src, out, to="vllm")  # a plain re-export over it: the rule goes with the old folder
    assert not (out / RULE_FILE).exists()
