"""The INT4 HF reference (eagle3.targets.quantized): a tiny DeepSeek-V3 written the way Kimi-K2.5 ships (wrapper
config, `language_model.` prefix, `model_type: kimi_k2`, routed experts as compressed-tensors pack-quantized
`weight_packed` / `weight_scale` / `weight_shape`, two shards and an index) loads with exactly the dequantized
weights, computes what the same model with those weights written plainly computes, verifies a cache made from that
plain model, and refuses any tensor it would otherwise leave uninitialised."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import deepseek_v3_config, make_prepared, tiny_target_cfg
from safetensors.torch import load_file, save_file

from eagle3.extract import run as extract
from eagle3.targets.hf import HFTarget, load_causal_lm
from eagle3.targets.quantized import PackedExperts, pack_scheme, unpack
from eagle3.verify_extraction import run as verify

GROUP = 32  # Kimi-K2.5's group size; the tiny model's hidden 64 makes two groups per row of gate/up
KIMI_QUANT = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"type": "int", "num_bits": 4, "group_size": GROUP, "strategy": "group", "symmetric": True,
                    "dynamic": False, "observer": "minmax", "actorder": None, "block_structure": None}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"],
}
"""Kimi-K2.5's text_config.quantization_config (the K2.5/K2.6 family's, as engines' fixtures copy it)."""


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' packing, written independently of the loader: 8 values per int32, value j of a row in
    bits 4*(j%8).. of word j//8, stored as q + 8."""
    u = (q.to(torch.int64) + 8).view(q.shape[0], -1, 8)
    words = (u << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q * its group's scale, in the scale's dtype (compressed-tensors' dequantize), then float32."""
    return (q.to(s.dtype).view(q.shape[0], -1, GROUP) * s.unsqueeze(-1)).view(q.shape).float()


def write_int4_kimi(root: Path, seed: int = 0) -> tuple[Path, Path, dict]:
    """(INT4 Kimi-layout folder, the same model with the dequantized weights saved plainly, {piece key: (q, s)})."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(deepseek_v3_config()).eval()
    g = torch.Generator().manual_seed(seed)
    pieces: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=g)  # pre- and post-norm states differ, as in a trained model
        for li, layer in enumerate(model.model.layers):
            if not hasattr(layer.mlp, "experts"):
                continue
            layer.mlp.gate.weight.normal_(0, 0.5, generator=g)  # routing that is not a tie
            ex = layer.mlp.experts
            n_exp, two_i, h = ex.gate_up_proj.shape
            i = two_i // 2
            for e in range(n_exp):
                for proj, dst in (("gate_proj", ex.gate_up_proj[e, :i]), ("up_proj", ex.gate_up_proj[e, i:]),
                                  ("down_proj", ex.down_proj[e])):
                    q = torch.randint(-8, 8, dst.shape, generator=g, dtype=torch.int8)
                    s = (torch.rand(dst.shape[0], dst.shape[1] // GROUP, generator=g) * 0.03 + 0.005)
                    pieces[f"model.layers.{li}.mlp.experts.{e}.{proj}"] = (q, s.to(torch.bfloat16))
                    dst.copy_(dequant(q, s.to(torch.bfloat16)))
    plain = root / "plain"
    model.save_pretrained(plain, safe_serialization=True)
    flat = {k: v for k, v in load_file(str(plain / "model.safetensors")).items() if ".experts." not in k}
    for base, (q, s) in pieces.items():
        flat[f"{base}.weight_packed"] = pack_int4(q)
        flat[f"{base}.weight_scale"] = s
        flat[f"{base}.weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int64)
    quant = root / "int4"
    quant.mkdir()
    names = sorted(flat)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({f"language_model.{k}": flat[k] for k in keys}, str(quant / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {f"language_model.{k}": f for f, ks in shards.items() for k in ks}}
    (quant / "model.safetensors.index.json").write_text(json.dumps(index))
    text = json.loads((plain / "config.json").read_text())
    text.update(model_type="kimi_k2", quantization_config=KIMI_QUANT)
    (quant / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
        "vision_config": {"model_type": "moonvit"}}, indent=2))
    return quant, plain, pieces


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    quant, plain, pieces = write_int4_kimi(root)
    return {"int4": quant, "plain": plain, "pieces": pieces, "prepared": make_prepared(root / "prepared", n=6, n_eval=2)}


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_unpack_reads_the_compressed_tensors_layout():
    """The nibble order fixed by hand: word 0x76543210 holds 0..7 unsigned (q = -8..-1), low nibble first."""
    words = torch.tensor([[0x76543210, -19088744]], dtype=torch.int32)  # -19088744 = 0xFEDCBA98
    assert unpack(words, 4, 16).tolist() == [list(range(-8, 8))]
    q = torch.randint(-8, 8, (5, 64), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
    assert torch.equal(unpack(pack_int4(q), 4, 64), q)


def test_int4_experts_load_exactly_and_compute_as_the_plain_model(kimi):
    model = load_causal_lm(str(kimi["int4"]), torch.float32)
    plain = load_causal_lm(str(kimi["plain"]), torch.float32)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    n_packed = 0
    for li, layer in enumerate(model.model.layers):
        if not hasattr(layer.mlp, "experts"):
            continue
        ex, ref = layer.mlp.experts, plain.model.layers[li].mlp.experts
        assert isinstance(ex, PackedExperts)
        for e in range(ex.num_experts):
            gate_up, down = ex.expert_weights(e)
            q = {p: kimi["pieces"][f"model.layers.{li}.mlp.experts.{e}.{p}"] for p in ("gate_proj", "up_proj",
                                                                                       "down_proj")}
            assert torch.equal(gate_up, torch.cat([dequant(*q["gate_proj"]), dequant(*q["up_proj"])]))
            assert torch.equal(down, dequant(*q["down_proj"]))
            assert torch.equal(gate_up, ref.gate_up_proj[e]) and torch.equal(down, ref.down_proj[e])
            n_packed += 1
    assert n_packed == 3 * 4
    ours = {k: v for k, v in model.state_dict().items()}
    theirs = {k: v for k, v in plain.state_dict().items() if ".experts." not in k}
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    plain.set_experts_implementation("eager")  # the loop PackedExperts runs: the same ops, the same bits
    ids = torch.randint(3, 256, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = model(ids, output_hidden_states=True)
        b = plain(ids, output_hidden_states=True)
        plain.set_experts_implementation("grouped_mm")  # transformers' default: the same up to fp32 rounding
        c = plain(ids, output_hidden_states=True)
    for x, y, z in zip(a.hidden_states, b.hidden_states, c.hidden_states, strict=True):
        assert torch.equal(x, y)
        torch.testing.assert_close(x, z, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.logits, b.logits)


def test_bf16_keeps_transformers_dtypes_and_auto_places_on_cpu(kimi):
    """bf16 with the router in fp32 (transformers' `_keep_in_fp32_modules_strict`), as from_pretrained gives the
    plain model; and target.device=auto (accelerate's map: all on the CPU here) computes the same."""
    model = load_causal_lm(str(kimi["int4"]), torch.bfloat16, "auto")
    plain = load_causal_lm(str(kimi["plain"]), torch.bfloat16)
    ours = {k: v.dtype for k, v in model.state_dict().items()}
    assert ours == {k: v.dtype for k, v in plain.state_dict().items() if ".experts." not in k}
    assert ours["model.layers.1.mlp.gate.weight"] == torch.float32
    layer = model.model.layers[2].mlp.experts
    gate_up, _ = layer.expert_weights(1)
    q, s = kimi["pieces"]["model.layers.2.mlp.experts.1.gate_proj"]
    assert gate_up.dtype == torch.bfloat16 and torch.equal(gate_up[: q.shape[0]].float(), dequant(q, s))
    plain.set_experts_implementation("eager")
    ids = torch.randint(3, 256, (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_verify_extraction_passes_a_cache_of_the_dequantized_model(kimi, tmp_path, capsys):
    """`eagle3 verify-extraction` with target.path = the INT4 folder, against a cache extracted from the plain
    dequantized model (what SGLang's INT4 kernels compute): PASS."""
    made = tiny_target_cfg(kimi["plain"], kimi["prepared"], tmp_path / "plain")
    extract(made)
    cfg = tiny_target_cfg(kimi["int4"], kimi["prepared"], tmp_path / "int4")
    assert verify(cfg, str(made.cache_dir), 4) == 0
    assert "PASS: 4 sample(s)" in capsys.readouterr().out
    hf = HFTarget(cfg.target, cfg.extract)  # and the HF backend itself runs on it (extract / online / eval)
    assert hf.num_layers == 4 and hf.architectures == ["KimiK25ForConditionalGeneration"]


def _rewrite(folder: Path, edit) -> None:
    """Apply `edit(tensors)` to every shard of a copied folder and rewrite its index."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(folder / file))
        edit(tensors, file)
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file} | dict.fromkeys(tensors,
                                                                                                          file)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


P = "language_model.model.layers"


@pytest.mark.parametrize("case, message", [
    ("shared-expert-packed", f"{P}.1.mlp.shared_experts.gate_proj.weight_packed: a quantized tensor"),
    ("expert-out-of-range", f"{P}.2.mlp.experts.7.down_proj.weight_packed: expert 7 of a layer with 4"),
    ("expert-missing", f"{P}.3.mlp.experts.2.up_proj.weight_packed "),
    ("plain-missing", "language_model.model.norm.weight "),
    ("scale-shape", f"{P}.1.mlp.experts.0.down_proj.weight_scale: torch.bfloat16 [64, 2], the model takes"),
])
def test_refuses_what_would_stay_uninitialised(kimi, tmp_path, case, message):
    """Every tensor the loader cannot place, or the model lacks, is an error naming it, never a module at init."""
    folder = _copy(kimi["int4"], tmp_path / case)

    def edit(t: dict, _file: str) -> None:
        if case == "shared-expert-packed" and f"{P}.1.mlp.shared_experts.gate_proj.weight" in t:
            w = t.pop(f"{P}.1.mlp.shared_experts.gate_proj.weight")
            base = f"{P}.1.mlp.shared_experts.gate_proj"
            t[f"{base}.weight_packed"] = torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.int32)
            t[f"{base}.weight_scale"] = torch.ones(w.shape[0], w.shape[1] // GROUP, dtype=torch.bfloat16)
        if case == "expert-out-of-range" and f"{P}.2.mlp.experts.3.down_proj.weight_packed" in t:
            t[f"{P}.2.mlp.experts.7.down_proj.weight_packed"] = t[f"{P}.2.mlp.experts.3.down_proj.weight_packed"] + 0
        if case == "expert-missing":
            t.pop(f"{P}.3.mlp.experts.2.up_proj.weight_packed", None)
        if case == "plain-missing":
            t.pop("language_model.model.norm.weight", None)
        if case == "scale-shape" and f"{P}.1.mlp.experts.0.down_proj.weight_scale" in t:
            t[f"{P}.1.mlp.experts.0.down_proj.weight_scale"] = torch.ones(64, 2, dtype=torch.bfloat16)

    _rewrite(folder, edit)
    with pytest.raises(ValueError) as err:
        load_causal_lm(str(folder), torch.float32)
    assert message in str(err.value) and "\n" not in str(err.value)
    if case.endswith("missing"):  # refused before reading (names only), or after loading: either way by name
        assert "uninitialised" in str(err.value)


@pytest.mark.parametrize("field, value, message", [
    ("symmetric", False, "weights.symmetric is False"),
    ("actorder", "group", "weights.actorder is 'group'"),
    ("num_bits", 3, "num_bits 3"),
    ("input_activations", {"num_bits": 8, "type": "float"}, "input_activations is set"),
])
def test_refuses_a_scheme_it_would_read_wrong(field, value, message):
    cfg = json.loads(json.dumps(KIMI_QUANT))
    group = cfg["config_groups"]["group_0"]
    (group if field == "input_activations" else group["weights"])[field] = value
    with pytest.raises(ValueError, match=message):
        pack_scheme({"quantization_config": cfg})
    assert pack_scheme({"quantization_config": KIMI_QUANT}).group_size == GROUP
    assert pack_scheme({"quantization_config": {**KIMI_QUANT, "format": "float-quantized"}}) is None
    assert pack_scheme({"quantization_config": {"quant_method": "fp8"}}) is None


@pytest.mark.gpu
def test_auto_on_a_gpu_computes_what_the_plain_model_does(kimi):
    """target.device=auto as the Kimi recipe runs it (accelerate's map and hooks over the GPUs): the experts'
    dequantized weights on the GPU are the CPU's bits, and the forward matches the plain model on the same GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = load_causal_lm(str(kimi["int4"]), torch.bfloat16, "auto")
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_packed.device.type == "cuda"
    cpu = load_causal_lm(str(kimi["int4"]), torch.bfloat16).model.layers[1].mlp.experts
    for e in range(experts.num_experts):
        assert all(torch.equal(a.cpu(), b) for a, b in zip(experts.expert_weights(e), cpu.expert_weights(e),
                                                          strict=True))
    plain = load_causal_lm(str(kimi["plain"]), torch.bfloat16, "cuda")
    plain.set_experts_implementation("eager")
    ids = torch.randint(3, 256, (1, 33), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        a, b = model(ids, output_hidden_states=True), plain(ids, output_hidden_states=True)
    for x, y in zip(a.hidden_states, b.hidden_states, strict=True):
        torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=2e-2)
