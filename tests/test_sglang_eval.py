"""`eagle3 eval --engine sglang` against the real SGLang 0.5.23 on CPU: eagle3 exports the head, starts SGLang with
it as the EAGLE-3 draft (steps 3 / topk 1 / 4 draft tokens), replays the built-in evaluator's prompts and reads
SGLang's own verify counters.

    bash scripts/setup_sglang_cpu.sh && pytest -m sglang tests/test_sglang_eval.py

The tiny targets are built so that a head fed the layers its config names is exact, and one fed any other layer,
the next one included, is not: embeddings live in the first quarter of the hidden dims; every decoder layer is an
identity (attention and MLP outputs zeroed, MoE routed experts included) except two MLPs (the shared expert for
DeepSeek). The layer just below the high aux id writes a per-token vector m(x) into the second half, which the
lm_head reads alone (row x = m(x)/|m(x)|): the target repeats its current token, and only states from the high aux
id on carry m(x). The layer AT the high aux id writes p(x) into the second quarter, which the lm_head ignores: the
high aux id's state has none of it, the next id's has. The head copies the high feature's second half (fc = [0 | 0
| I], its own o_proj/down_proj zeroed) through the target's final norm and lm_head rows, and adds a large random
map of the feature's second quarter: exact at every draft position (τ near 4 at 3 draft tokens) when SGLang feeds
it the input of the high layer, near 1 when it feeds a lower layer (no m) or the next one (the +1 spelling bug:
p scrambles it). Its draft vocab leaves random tokens out, so a d2t misread proposes wrong tokens. The slow test
does the same with the real SmolLM2 and a trained head.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_sglang_real import CPU_FLAGS, DEVICE, DTYPE, IDS, REPO, _omp_bind, build_target, sglang_env  # noqa: F401

from eagle3.config import Config, load_config

pytestmark = pytest.mark.sglang
FAMILIES = ["llama", "deepseek", "kimi"]


def make_repeating_target(target: Path, special: int) -> None:
    """Rewrite a saved tiny target's weights as the module docstring says (layer `special` writes m, layer
    `special + 1`, the high aux id's, writes p)."""
    import re

    from safetensors.torch import load_file, save_file

    from eagle3.targets.hf import load_causal_lm

    f = target / "model.safetensors"
    w = load_file(str(f))
    embed_name = next(k for k in w if k.endswith("embed_tokens.weight"))
    h = w[embed_name].shape[1]
    a, b = slice(0, h // 2), slice(h // 2, h)
    w[embed_name][:, h // 4:] = 0
    for name, t in w.items():
        m = re.search(r"layers\.(\d+)\.", name)
        if not m or not ("o_proj" in name or "down_proj" in name):
            continue
        layer = int(m.group(1))
        if layer not in (special, special + 1) or "o_proj" in name or ".experts." in name:
            t.zero_()
        elif layer == special:  # the kept MLP (Llama's, or DeepSeek's shared expert) writes m into the second half
            t[a] = 0
        else:  # the high aux layer's MLP writes p into the second quarter only
            keep = t[h // 4: h // 2].clone()
            t.zero_()
            t[h // 4: h // 2] = keep
    save_file(w, str(f), metadata={"format": "pt"})
    model = load_causal_lm(str(target), torch.float32)
    vocab = w[embed_name].shape[0]
    with torch.no_grad():
        hs = model.model(input_ids=torch.arange(vocab)[:, None], output_hidden_states=True).hidden_states
    mvec = hs[special + 1][:, 0, b]  # m(x) of every token: what layer `special` added
    norm_name = next(k for k in w if k.endswith("model.norm.weight"))
    head = torch.zeros(vocab, h)
    head[:, b] = mvec / mvec.norm(dim=-1, keepdim=True).clamp_min(1e-12) / w[norm_name][b]  # the pad embeds to 0
    w[next(k for k in w if k.endswith("lm_head.weight"))] = head
    save_file(w, str(f), metadata={"format": "pt"})


def exact_head_cfg(family: str, root: Path) -> Config:
    from eagle3.formats import save_draft
    from eagle3.model import Eagle3Draft, Eagle3DraftConfig
    from eagle3.targets.weights import load_target_head

    ids = IDS[family]
    target = build_target(family, root / "target")
    make_repeating_target(target, special=ids[-1] - 1)
    hf = json.loads((target / "config.json").read_text())
    text = hf.get("text_config") or hf
    embed, lm_head, _ = load_target_head(str(target))
    vocab, h = embed.shape
    cfg = Config(output_dir=str(root / "run"))
    cfg.target.path, cfg.target.dtype, cfg.target.aux_layer_ids = str(target), DTYPE, ids
    cfg.target.device = "cpu" if DEVICE == "cpu" else "cuda"
    cfg.target.sglang.launch_args = list(CPU_FLAGS)
    cfg.target.sglang.startup_timeout_s = 900
    cfg.data.chat_template = "kimi-k2.5" if family == "kimi" else "auto"
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n{"prompt": "Count to ten"}\n{"prompt": "abc abc abc"}\n')
    cfg.eval.prompt_sets = [str(prompts)]
    cfg.eval.max_new_tokens = 24
    cfg.eval.engine = "sglang"
    dc = Eagle3DraftConfig(hidden_size=h, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           intermediate_size=128, vocab_size=vocab, draft_vocab_size=vocab - 1 - LEFT_OUT,
                           target_hidden_size=h,
                           aux_layer_ids=ids, rms_norm_eps=text.get("rms_norm_eps", 1e-6),
                           target={"path": str(target), "architectures": hf.get("architectures"),
                                   "model_type": hf.get("model_type"), "num_layers": text["num_hidden_layers"]})
    torch.manual_seed(0)
    draft = Eagle3Draft(dc)
    draft.set_vocab(*sparse_vocab(vocab, prompt_tokens(cfg)))
    draft.init_from_target(lm_head, embed)
    norm = next(v for k, v in _target_tensors(target).items() if k.endswith("model.norm.weight"))
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, 2 * h:] = torch.eye(h)
        # p (the next layer's mark) scrambles the copied m: nothing where the high id's own input has no p.
        draft.fc.weight[h // 2:, 2 * h + h // 4: 2 * h + h // 2] = 10 * torch.randn(h // 2, h // 4)
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
        draft.norm.weight.copy_(norm)
    save_draft(draft, cfg.checkpoint_dir / "best")
    return cfg


LEFT_OUT = 24
"""Random tokens (besides the pad) the draft vocab leaves out: d2t's offsets step up at random places."""


def prompt_tokens(cfg: Config) -> set[int]:
    """Every token of the rendered prompts: the repeating target only ever outputs these, so the draft vocab must
    keep them (left out, the draft could never propose them and τ would fall for a reason that is not a bug)."""
    from eagle3.data.templates import load_tokenizer
    from eagle3.data.types import Turn
    from eagle3.evaluate import PromptRenderer
    from eagle3.prompts import load_prompt_set

    render = PromptRenderer(load_tokenizer(cfg.target), cfg.data)
    return {t for name in cfg.eval.prompt_sets for p in load_prompt_set(name).prompts for text in p.turns
            for t in render([Turn("user", text)])}


def sparse_vocab(vocab: int, keep: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) leaving out the pad and LEFT_OUT random tokens outside `keep`."""
    g = torch.Generator().manual_seed(7)
    candidates = torch.tensor([t for t in range(1, vocab) if t not in keep])
    t2d = torch.ones(vocab, dtype=torch.bool)
    t2d[0] = False
    t2d[candidates[torch.randperm(len(candidates), generator=g)[:LEFT_OUT]]] = False
    ids = t2d.nonzero().flatten()
    return ids - torch.arange(len(ids)), t2d


def _target_tensors(target: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(target / "model.safetensors"))


@pytest.mark.parametrize("family", FAMILIES, ids=[f"{f}-tp1" for f in FAMILIES])
def test_sglang_accept_length_equals_the_builtin_and_wrong_ids_lose_it(family, tmp_path):
    from eagle3.evaluate import run

    _omp_bind(1)
    cfg = exact_head_cfg(family, tmp_path)
    report = run(cfg)
    s, b = report["engines"]["sglang"], report["sets"]["prompts"]
    assert s["draft"] and Path(s["draft"]).name == "sglang"  # eagle3 exported the head and started the server
    assert b["greedy_mismatches"] == 0
    assert b["acceptance_rate"][0] >= 0.85, b["acceptance_rate"]  # exact at position 0, as built
    assert s["requests"] == 3 and s["verify_steps"] > 0
    assert s["tau"] == pytest.approx(s["builtin_tau"], rel=0.02), (s, b["tau"])
    assert s["tau"] >= 3.5  # every draft position exact, as built

    if family == "llama":  # temperature > 0: the target's distribution is nearly flat, so sampling accepts ~nothing
        from eagle3.engines.sglang_eval import CPU_GREEDY

        cfg.eval.temperature = 0.7
        hot = run(cfg)
        s_hot, b_hot = hot["engines"]["sglang"], hot["sets"]["prompts"]
        assert b_hot["acceptance_rate"][0] < 0.2, b_hot  # the built-in samples: the exact head's argmax rarely wins
        greedy_after_first = all(len(set(o[1:])) <= 1 for o in s_hot["outputs"])  # the repeating target's argmax
        if DEVICE == "cpu":  # SGLang's CPU platform commits the argmax at any temperature: flagged, not sampled
            assert s_hot.get("untrusted") == CPU_GREEDY and greedy_after_first, s_hot
        else:
            assert not s_hot.get("untrusted") and not greedy_after_first, s_hot
        cfg.eval.temperature = 0.0

    if family == "kimi":  # the Kimi recipe's mode: SGLang alone decodes every turn (eval.builtin=false)
        cfg.eval.checkpoint, cfg.eval.builtin = s["draft"], False
        alone = run(cfg)
        assert alone["engines"]["sglang"]["tau"] == pytest.approx(s["builtin_tau"], rel=0.02)
        assert alone["sets"]["prompts"]["turns"] == 3 and (cfg.eval_dir / "report.png").is_file()
        # Turns that end at their first (prefill) token: SGLang writes no spec_verify_ct for them; the run counts
        # no verify step and finishes, where it used to abort on the missing key.
        cfg.eval.max_new_tokens = 1
        once = run(cfg)
        assert once["sets"]["prompts"]["turns"] == 3 and once["engines"]["sglang"]["verify_steps"] == 0, once
        cfg.eval.max_new_tokens = 24

    # The same export spelled one layer up (an engine reading "output of layer k"): SGLang serves it without a
    # word; only the acceptance shows it.
    from eagle3.layer_ids import arch_family, to_engine_ids

    ids = IDS[family]
    conf = json.loads((Path(s["draft"]) / "config.json").read_text())
    family_of = arch_family(conf["eagle3"]["target"]["architectures"], conf["eagle3"]["target"]["model_type"])
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == to_engine_ids(ids, "sglang", family_of)
    wrong = tmp_path / "off-by-one"
    shutil.copytree(s["draft"], wrong)
    conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = to_engine_ids([i + 1 for i in ids], "sglang", family_of)
    (wrong / "config.json").write_text(json.dumps(conf))
    cfg.eval.checkpoint, cfg.eval.builtin = str(wrong), False
    bad = run(cfg)["engines"]["sglang"]
    assert bad["tau"] <= 1.5, (bad["tau"], s["tau"])


SMOLLM2_HEAD = REPO / "runs" / "smollm2-135m-quickstart" / "checkpoints" / "best"


@pytest.mark.slow
def test_real_smollm2_head_agrees_with_the_builtin(tmp_path):
    """The bundled SmolLM2-135M with a head trained by the quickstart (float32 on both sides, so greedy text must
    agree token for token), on MT-bench turns."""
    head = SMOLLM2_HEAD
    if not (head / "config.json").is_file():
        from recipe_runner import run_recipe

        run_recipe("quickstart.sh", [f"output_dir={tmp_path / 'qs'}", "data.max_samples=40", "train.max_steps=12",
                                     "train.mixed_precision=no", "target.dtype=float32"], cwd=REPO,
                   STAGES="prepare extract train")
        head = tmp_path / "qs" / "checkpoints" / "best"
    from eagle3.evaluate import run

    _omp_bind(1)
    cfg = load_config(REPO / "configs" / "smollm2-135m-quickstart.yaml", [
        f"output_dir={tmp_path / 'eval'}", f"eval.checkpoint={head}", "eval.engine=sglang", "eval.max_prompts=2",
        "eval.max_new_tokens=48", "target.dtype=float32", f"target.device={'cpu' if DEVICE == 'cpu' else 'cuda'}",
        f"target.sglang.launch_args={json.dumps(CPU_FLAGS)}",
        "target.sglang.startup_timeout_s=900"])
    report = run(cfg)
    s, b = report["engines"]["sglang"], report["sets"]["mt-bench"]
    assert b["greedy_mismatches"] == 0
    assert s["requests"] == b["turns"] == 4
    assert s["tau"] == pytest.approx(s["builtin_tau"], rel=0.02), (s, b["tau"])
