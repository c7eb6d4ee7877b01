"""Heads whose drafts depend on all three aux features in their order, on fc_norm's three weights and on norm_output:
what the engine tests serve, so that an engine that feeds the features in another order, applies a fc_norm weight
to the wrong third, ignores fc_norm, or hands the pre-norm state on where the head says post-norm (or the reverse),
serves another τ than the built-in evaluator's.

The target is test_sglang_eval's repeating target (`make_repeating_target`: the layer below the high aux id writes
m(x) into the second half, the only part the lm_head reads, so the target repeats its token) with one more MLP at
the low aux id (`add_low_mid_layer`) writing a small q(x) into the second quarter: the low, mid and high states are
e, e + q and e + q + m (e, the embedding, in the first quarter).

The head (`three_feature_head`) starts as the exact copying head (fc passes the high state on; the target's final
norm and lm_head do the rest) and is then rebuilt so that each option and each feature changes what it drafts:
- without fc_norm, fc = [A | B | C] with A = R_e on the low state's first quarter, B = -R_q on the mid state's second
  quarter and C = I - R_e + R_q on the high state: A e + B (e + q) + C (e + q + m) is exactly the high state, while
  the mid and low states swapped leave R_q q (as large as the feature) and either one missing leaves R_e e or R_q q;
- with fc_norm (each state normalised first, so terms of two states cannot cancel), the high state's random-sign
  weight u_high is undone by the final norm's weight (norm.weight / u_high), and the low and mid states' first
  quarters go into the dims the lm_head reads through B and -B diag(u_low / u_mid): they cancel (the two states
  differ by the small q alone) only where each fc_norm weight meets its own third, and otherwise leave `CANCELLED`
  times the copied m there; fc_norm ignored leaves the high state's random signs in place;
- the final scale is split as norm.weight = target's * c, lm_head / c (c with random signs): step 0 is unchanged,
  but a post-norm hand-off (norm_output) carries c into the later steps;
- random attention and MLP outputs of `noise` times the feature's size make the drafts depend on the attention, its
  RoPE and the `[embeds | hidden]` order.

`swap_low_mid_norms`, `swap_low_mid_features` and `flip_norm_output` rewrite an exported head the way a mistaken
engine would read it: the negative controls. Prompts are the prepared eval split's random tokens (`eval-split`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3.ttt import repeat_kv

NOISE = 0.3
"""Random attention and MLP outputs, as a share of the feature's part the lm_head reads."""
EVAL_PROMPTS = 12
"""Prompts of random tokens (the prepared eval split): the target repeats each one's last token, so each prompt
drafts other tokens, where rendered chat prompts all end in the same generation prompt."""
CANCELLED = 4.0
"""With fc_norm: the size of the low and mid states' terms that cancel only when each fc_norm weight is applied to
its own third, as a multiple of the high state's share of the lm_head's dims."""
Q_SIZE = 0.02
"""q's size against the embedding's: large enough for fc (without fc_norm) to need the low and mid states apart,
small enough for the cancellation above to hold to ~1e-4 where both states are normalised."""


def rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def layer_output(draft, aux: torch.Tensor, tokens: torch.Tensor, upto: int = 0) -> torch.Tensor:
    """Decoder layer `upto`'s pre-norm output at step 0 (features in, tokens shifted by one), in float32."""
    shifted = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
    h = draft.project(aux)
    b, t = tokens.shape
    for i in range(upto + 1):
        q, k, v = draft.layer_inputs(i, shifted, h, torch.arange(t)[None])
        n_rep = q.shape[1] // k.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                                               is_causal=True, scale=draft.attn_scale)
        h = draft.layer_block(i, h, out.transpose(1, 2).reshape(b, t, -1))
    return h


def add_low_mid_layer(target: Path, low: int, high: int, size: float = Q_SIZE) -> None:
    """Give a repeating target one more MLP, at the low aux id, writing a per-token vector q(x) into the second
    quarter of the dims (which the lm_head ignores) at `size` times the embedding's size, so that the low and mid
    states differ as much as two layers' states do; then refit the lm_head rows to m(x) as the layer below the high
    id now computes it from e + q (test_sglang_eval.make_repeating_target's rule), so the target still repeats."""
    from eagle3.targets.hf import load_causal_lm

    f = target / "model.safetensors"
    w = load_file(str(f))
    g = torch.Generator().manual_seed(1)
    name = next(k for k in w if re.search(rf"layers\.{low}\.mlp\.(shared_experts\.)?down_proj\.weight$", k))
    h = w[name].shape[0]
    w[name][h // 4: h // 2] = torch.randn(h // 4, w[name].shape[1], generator=g)

    def states() -> tuple:
        save_file(w, str(f), metadata={"format": "pt"})
        model = load_causal_lm(str(target), torch.float32)
        vocab = next(v for k, v in w.items() if k.endswith("embed_tokens.weight")).shape[0]
        with torch.no_grad():
            return model.model(input_ids=torch.arange(vocab)[:, None], output_hidden_states=True).hidden_states

    hs = states()
    q, e = hs[low + 1][1:, 0, h // 4: h // 2], hs[low][1:, 0, : h // 4]  # the pad (id 0) embeds to 0
    w[name][h // 4: h // 2] *= size * rms(e) / rms(q)
    hs = states()
    m = hs[high][:, 0, h // 2:]
    norm = next(v for k, v in w.items() if k.endswith("model.norm.weight"))
    head = torch.zeros_like(next(v for k, v in w.items() if k.endswith("lm_head.weight")))
    head[:, h // 2:] = m / m.norm(dim=-1, keepdim=True).clamp_min(1e-12) / norm[h // 2:]
    w[next(k for k in w if k.endswith("lm_head.weight"))] = head
    save_file(w, str(f), metadata={"format": "pt"})


def three_feature_head(draft, aux: torch.Tensor, tokens: torch.Tensor, final_norm: torch.Tensor, seed: int = 0,
                       noise: float = NOISE, cancelled: float = CANCELLED) -> None:
    """Rebuild `draft` (init_from_target done) as the module docstring says, from one sample's `aux` [1, T, 3H] and
    `tokens` [1, T] of the target (add_low_mid_layer done) and its final norm's weight."""
    g = torch.Generator().manual_seed(seed)
    h = draft.config.hidden_size
    low, mid, high = 0, h, 2 * h  # where each state's columns start in fc

    def cols(state: int, first: int, last: int) -> slice:  # columns of dims [first, last) of one state
        return slice(state + first, state + last)

    fc = draft.fc.weight
    fc.zero_()
    fc[:, high:] = torch.eye(h)
    c = torch.empty(h).uniform_(0.5, 2.0, generator=g) * (torch.randint(0, 2, (h,), generator=g) * 2 - 1)
    scale = c
    if draft.config.fc_norm:
        weights = [torch.empty(h).uniform_(0.8, 1.25, generator=g) * (torch.randint(0, 2, (h,), generator=g) * 2 - 1)
                   for _ in range(3)]
        for norm, wt in zip(draft.fc_norm, weights, strict=True):
            norm.weight.copy_(wt)
        scale = c / weights[2]
        # The low and mid states' first quarters (e / its rms) through B and -B diag(u_low / u_mid) into the dims
        # the lm_head reads: with each fc_norm weight on its own third they cancel (the two states differ only by
        # the small q), with the weights swapped, or none, they leave `cancelled` times the high state's size there.
        read, e_dims = slice(h // 2, h), slice(0, h // 4)
        size = rms(draft.project(aux)[..., read] / weights[2][read])
        block = torch.randn(h // 2, h // 4, generator=g)
        normed = draft.fc_norm[0](aux[..., low: low + h])[..., e_dims]
        block *= cancelled * size / rms((normed @ block.T) / weights[2][read])
        fc[read, cols(low, 0, h // 4)] = block
        fc[read, cols(mid, 0, h // 4)] = -block * (weights[0][e_dims] / weights[1][e_dims])
    else:
        size = rms(aux[..., high:])
        r_e, r_q = torch.randn(h, h // 4, generator=g), torch.randn(h, h // 4, generator=g)
        r_e *= size / rms(aux[..., cols(low, 0, h // 4)] @ r_e.T)
        r_q *= size / rms(aux[..., cols(mid, h // 4, h // 2)] @ r_q.T)
        fc[:, cols(low, 0, h // 4)] = r_e
        fc[:, cols(mid, h // 4, h // 2)] = -r_q
        fc[:, cols(high, 0, h // 4)] -= r_e
        fc[:, cols(high, h // 4, h // 2)] += r_q
    draft.norm.weight.copy_(final_norm * scale)
    draft.lm_head.weight.div_(c)
    layers = [draft.midlayer, *(draft.layers[str(i)] for i in range(1, draft.config.num_layers))]
    for i, layer in enumerate(layers):
        if i:  # a stacked layer's one norm before attention (SGLang's hidden_norm, vLLM's input_layernorm): small
            # random-signed weights, so that its attention, scaled below to `noise`, is ~20x that read as ones
            layer.input_layernorm.weight.copy_(torch.empty(h).uniform_(0.02, 0.1, generator=g)
                                               * (torch.randint(0, 2, (h,), generator=g) * 2 - 1))
        for weight in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
            weight.zero_()
            before = layer_output(draft, aux, tokens, i)
            weight.copy_(torch.randn(weight.shape, generator=g))
            added = layer_output(draft, aux, tokens, i) - before
            # a set share of what the feature puts in the dims the lm_head reads (the copied m); half of it in a
            # stacked layer, whose drafts are then still right often enough at later steps for norm_output to show
            share = noise / 2 if i else noise
            weight.mul_(share * rms(draft.project(aux)[..., h // 2:]) / rms(added[..., h // 2:]))


def three_feature_setup(root: Path, target: Path, ids: list[int], arch: str, fc_norm: bool, norm_output: bool,
                        dtype: str = "float32", num_layers: int = 1):
    """The repeating target at `target` (built, with its tokenizer) made three-featured, a prepared folder and its
    extracted cache, and the three-feature head saved as `<root>/start`: (cfg with draft.init_from set, the head)."""
    from models import make_prepared, tiny_target_cfg
    from test_sglang_eval import make_repeating_target

    from eagle3.cache import HiddenStateDataset
    from eagle3.data.prepared import load_vocab
    from eagle3.extract import run as extract
    from eagle3.formats import save_draft
    from eagle3.model import Eagle3Draft, Eagle3DraftConfig
    from eagle3.targets.weights import load_target_head

    make_repeating_target(target, special=ids[-1] - 1)
    add_low_mid_layer(target, ids[0], ids[-1])
    embed, lm_head, hf = load_target_head(str(target))
    vocab, _ = embed.shape
    prepared = make_prepared(root / "prepared", n=24, n_eval=EVAL_PROMPTS, vocab=vocab, draft_vocab=vocab - 1,
                             max_len=40)
    cfg = tiny_target_cfg(target, prepared, root / "run")
    cfg.target.aux_layer_ids, cfg.target.dtype = ids, dtype
    cfg.draft.arch, cfg.draft.fc_norm, cfg.draft.norm_output = arch, fc_norm, norm_output
    cfg.draft.num_layers = num_layers
    cfg.draft.vocab_size = vocab - 1
    d2t, t2d = load_vocab(prepared / "vocab.safetensors")
    draft = Eagle3Draft(Eagle3DraftConfig.from_target(cfg.draft, cfg.target, hf, vocab - 1))
    draft.set_vocab(d2t, t2d)
    draft.init_from_target(lm_head, embed)
    text = hf.get("text_config") or hf
    assert text["num_hidden_layers"] > ids[-1]
    cfg.extract.cache_dir = str(root / "cache")
    extract(cfg)
    final_norm = next(v for k, v in load_file(str(target / "model.safetensors")).items()
                      if k.endswith("model.norm.weight"))
    sample = HiddenStateDataset(cfg.cache_dir, "train")[0]
    with torch.no_grad():
        three_feature_head(draft, sample["aux"].float()[None], sample["input_ids"][None].long(), final_norm)
    cfg.draft.init_from = str(save_draft(draft, root / "start"))
    cfg.eval.prompt_sets, cfg.eval.max_new_tokens = ["eval-split"], 24
    cfg.target.device = "cpu"
    return cfg, draft


def moved(other: dict, right: dict) -> bool:
    """Whether a rewritten head's built-in figures (a set's result in report.json) are far from the right head's:
    τ by more than 10%, or the acceptance at some draft position by more than 0.1 (a head can lose at position 0
    what it gains later, at about the same τ)."""
    far = abs(other["tau"] - right["tau"]) > 0.1 * right["tau"]
    return far or max(abs(a - b) for a, b in zip(other["acceptance_rate"], right["acceptance_rate"], strict=True)) > 0.1


def _fc_norm_keys(names: list[str]) -> list[str]:
    """The three fc_norm weights' names in an export, in low, mid, high order."""
    keys = sorted((k for k in names if re.search(r"fc_norm\.\d+\.weight$|fc_norm_\d\.weight$", k)),
                  key=lambda k: int(re.findall(r"\d+", k)[-1]))
    assert len(keys) == 3, names
    return keys


def swap_low_mid_norms(folder: Path, out: Path) -> Path:
    """A copy of an exported head whose low and mid fc_norm weights trade places: what an engine that applies each
    weight to the wrong third of the features serves."""
    import shutil

    shutil.copytree(folder, out)
    f = out / "model.safetensors"
    w = load_file(str(f))
    low, mid, _ = _fc_norm_keys(list(w))
    w[low], w[mid] = w[mid].clone(), w[low].clone()
    save_file(w, str(f), metadata={"format": "pt"})
    return out


def swap_low_mid_features(folder: Path, out: Path) -> Path:
    """A copy of an exported head whose fc (and fc_norm) reads the low state where the mid one goes and the reverse:
    what an engine that feeds the features in another order serves."""
    import shutil

    shutil.copytree(folder, out)
    f = out / "model.safetensors"
    w = load_file(str(f))
    fc = next(k for k in w if k.endswith("fc.weight"))
    h = w[fc].shape[1] // 3
    w[fc] = torch.cat([w[fc][:, h: 2 * h], w[fc][:, :h], w[fc][:, 2 * h:]], dim=1).contiguous()
    if any("fc_norm" in k for k in w):
        low, mid, _ = _fc_norm_keys(list(w))
        w[low], w[mid] = w[mid].clone(), w[low].clone()
    save_file(w, str(f), metadata={"format": "pt"})
    return out


def flip_norm_output(folder: Path, out: Path) -> Path:
    """A copy of an exported head whose config says the other norm_output: what an engine that hands the other
    state on between draft steps serves."""
    import shutil

    shutil.copytree(folder, out)
    conf = json.loads((out / "config.json").read_text())
    flipped = not conf["norm_output"]
    conf["norm_output"] = flipped
    for section in ("eagle3", "eagle_config"):
        if isinstance(conf.get(section), dict) and "norm_output" in conf[section]:
            conf[section]["norm_output"] = flipped
    (out / "config.json").write_text(json.dumps(conf))
    return out


def unit_stacked_norms(folder: Path, out: Path) -> Path:
    """A copy of a deeper head whose stacked layers' pre-attention norms are ones under both names: what an engine
    serves that reads that norm under a name the folder lacks and keeps its initial weight."""
    import shutil

    shutil.copytree(folder, out)
    f = out / "model.safetensors"
    w = load_file(str(f))
    norms = [k for k in w if re.fullmatch(r"(model\.)?layers\.[1-9]\d*\.(input_layernorm|hidden_norm)\.weight", k)]
    assert norms, f"{folder} has no stacked layer"
    for k in norms:
        w[k] = torch.ones_like(w[k])
    save_file(w, str(f), metadata={"format": "pt"})
    return out
