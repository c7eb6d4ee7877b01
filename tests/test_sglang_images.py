"""Image samples through the real SGLang 0.5.23 on CPU: a tiny Qwen2.5-VL target (its vision tower runs in SGLang, on
`--mm-attention-backend sdpa`), the pictures sent with each request as `data:` URLs, the image token runs collapsed
(SGLang's processor expands them again).

    bash scripts/setup_sglang_cpu.sh && bash scripts/setup_torchvision.sh && pytest -q -m sglang tests/test_sglang_images.py

What runs, as a user runs it: `eagle3 extract` with target.backend=sglang on image and text samples, against the same
samples extracted by the HF backend (transformers' own Qwen2.5-VL forward, M-RoPE included): the same states, the
same image positions and merged image embeddings; the same through the Mooncake Store; online training on them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TORCHVISION
from test_images import _jsonl, _prep_cfg
from test_sglang_real import CPU_FLAGS, DEVICE, _omp_bind, sglang_env  # noqa: F401 - sglang_env: the autouse fixture
from vlm_models import image_file, sharpen, taught_head, tiny_qwen25_vl

from eagle3 import prepare
from eagle3.cache import HiddenStateDataset
from eagle3.extract import run as extract

pytestmark = [pytest.mark.sglang, pytest.mark.vision]

MM_FLAGS = ["--mm-attention-backend", "sdpa"] if DEVICE == "cpu" else []
"""SGLang's vision attention on a CPU (its default backends are GPU kernels)."""


def _data(root: Path) -> Path:
    """Six image conversations and two text ones; r6 and r7 are the same text with different pictures of the same
    size, the same ids once expanded (two prompts whose dumps SGLang would name alike)."""
    recs = []
    for i in range(8):
        image_file(root / "imgs" / f"{i}.png", 56 if i % 2 or i == 6 else 112, seed=i)
        q, a = ("Same question?", "Same answer.") if i in (6, 7) else (f"Picture {i}?", f"Answer {i}. " * (1 + i % 3))
        user = [{"type": "image_url", "image_url": {"url": f"imgs/{i}.png"}}, {"type": "text", "text": q}] \
            if i not in (0, 3) else f"Question {i}?"
        recs.append({"id": f"r{i}", "messages": [{"role": "user", "content": user},
                                                  {"role": "assistant", "content": a}]})
    return _jsonl(root / "data.jsonl", recs)


def _cache(cfg) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for split in ("train", "eval"):
        ds = HiddenStateDataset(cfg.cache_dir, split)
        out.update({ds[i]["sample_id"]: ds[i] for i in range(len(ds))})
    return out


@pytest.fixture(scope="module")
def vl(tmp_path_factory, sglang_env):  # noqa: F811
    """The target, its image data prepared and extracted by the HF backend, and one capture server (dump folder, and
    a Mooncake Store by the request) reused by the module's tests."""
    if TORCHVISION is None:
        pytest.skip("no torchvision: bash scripts/setup_torchvision.sh")
    from store_master import running_master

    from eagle3.targets.mooncake import StoreAddress
    from eagle3.targets.sglang import capture_flags, server_env
    from eagle3.targets.sglang_server import SGLangServer

    root = tmp_path_factory.mktemp("vl")
    target = sharpen(tiny_qwen25_vl(root / "qwen", with_model=True))
    data = _data(root)
    common = ("target.dtype=float32", "extract.shard_samples=4", "extract.batch_tokens=1024", "data.eval_size=2",
              "draft.vocab_size=320", "draft.image_inputs=target-embeddings", "target.aux_layer_ids=[1,2,3]",
              "train.batch_tokens=512", "train.max_steps=2", "train.eval_every=2")
    hf = _prep_cfg(root, target, data, *common)
    prepare.run(hf)
    extract(hf)
    sg = _prep_cfg(root, target, data, *common, "target.backend=sglang", f"extract.cache_dir={root / 'sg'}",
                   f"data.output_dir={hf.prepared_dir}", f"target.sglang.dump_dir={root / 'dump'}",
                   "target.sglang.startup_timeout_s=900",
                   f"target.sglang.launch_args={json.dumps([*CPU_FLAGS, *MM_FLAGS])}")
    _omp_bind(1)
    with running_master(root / "master") as master:
        env = server_env(sg.target.sglang.dump_dir, [1, 2, 3], "llama", (StoreAddress.of(master.settings), 256 << 20))
        with SGLangServer(capture_flags(sg.target, sg.data.max_length, str(target)), env, root / "server.log",
                          timeout_s=900, what="Qwen2.5-VL capture server") as server:
            sg.target.sglang.url = server.url
            yield {"root": root, "hf": hf, "sg": sg, "master": master}


def test_sglang_extracts_image_samples_as_the_hf_backend(vl):
    """`eagle3 extract` through SGLang: the states of image and text samples, their image positions and the merged
    image embeddings equal the HF backend's; r6 and r7 (same ids, other pictures) each get their own."""
    hf, sg = vl["hf"], vl["sg"]
    extract(sg)
    a, b = _cache(hf), _cache(sg)
    assert set(a) == set(b) and len(a) == 8
    with_images = {sid for sid, it in a.items() if len(it.get("image_positions", [])) > 0}
    assert with_images == {"r1", "r2", "r4", "r5", "r6", "r7"}
    assert torch.equal(a["r6"]["input_ids"], a["r7"]["input_ids"])
    for sid in a:
        x, y = a[sid], b[sid]
        assert set(x) == set(y), (sid, set(x) ^ set(y))
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for key in ("aux", "final"):
            torch.testing.assert_close(y[key].float(), x[key].float(), rtol=1e-3, atol=1e-3, msg=f"{sid} {key}")
        assert torch.equal(x["image_positions"], y["image_positions"]), sid
        torch.testing.assert_close(y["image_embeds"].float(), x["image_embeds"].float(), rtol=1e-4, atol=1e-4,
                                   msg=f"{sid} image_embeds")
        if "positions" in x:  # M-RoPE's temporal row (vLLM's draft positions): the client computes what HF does
            assert torch.equal(x["positions"], y["positions"]), sid
    assert {sid for sid, it in b.items() if "positions" in it} == with_images


def test_the_store_hands_over_image_samples_as_the_dump_folder(vl):
    """target.sglang.transport mooncake (a dump folder the client does not read): the same states and image
    embeddings, byte for byte, as the dump folder gives for the same requests; nothing left in the store."""
    from eagle3.data.prepared import load_prepared
    from eagle3.targets.mooncake import StateStore, StoreAddress
    from eagle3.targets.sglang import SGLangTarget

    cfg = vl["sg"]
    rows = load_prepared(cfg.prepared_dir).train
    batches = [(list(map(list, rows["input_ids"][i:i + 3])), rows["images"][i:i + 3]) for i in range(0, len(rows), 3)]
    with SGLangTarget(cfg.target, cfg.extract, cfg.data.max_length, cfg.paths.logs_dir, preflight=False,
                      images=True) as shm:
        ref = [c for ids, im in batches for c in shm.capture(ids, im)]
    mc = cfg.model_copy(deep=True)
    s = mc.target.sglang
    s.transport, s.mooncake, s.dump_dir = "mooncake", vl["master"].settings, str(vl["root"] / "elsewhere")
    with SGLangTarget(mc.target, mc.extract, mc.data.max_length, mc.paths.logs_dir, images=True) as t:
        got = [c for ids, im in batches for c in t.capture(ids, im)]
    assert sum(len(c.image_embeds) > 0 for c in ref) >= 3
    for r, g in zip(ref, got, strict=True):
        assert torch.equal(g.aux, r.aux) and torch.equal(g.final, r.final)
        assert torch.equal(g.image_embeds, r.image_embeds)
    assert not list((vl["root"] / "elsewhere").glob("*.safetensors"))
    checker = StateStore(StoreAddress.of(vl["master"].settings), what="the test")
    assert checker.remove_prefix("eagle3/") == 0
    checker.close()


def test_online_training_through_sglang_captures_image_samples_as_the_cache(vl):
    """extract.mode=online through SGLang: the items are the HF cache's items (states, image positions, merged
    embeddings; none for a text sample), and two steps train a target-embeddings head."""
    import numpy as np

    from eagle3.data.prepared import load_prepared
    from eagle3.online import capture_items
    from eagle3.targets.argmax import ArgmaxHead
    from eagle3.targets.sglang import SGLangTarget
    from eagle3.trainer import run as train

    cfg = vl["sg"]
    cached = _cache(vl["hf"])
    prepared = load_prepared(cfg.prepared_dir).train
    with SGLangTarget(cfg.target, cfg.extract, cfg.data.max_length, cfg.paths.logs_dir, images=True) as backend:
        argmax = ArgmaxHead.for_backend(backend, cfg.target, cfg.extract.teacher_chunk)
        online = capture_items(backend, prepared, list(range(len(prepared))), argmax)
    assert {len(it["image_positions"]) > 0 for it in online} == {True, False}
    for it in online:
        ref = cached[it["sample_id"]]
        assert set(it) == set(ref), (set(it) ^ set(ref))
        for k in ("input_ids", "loss_mask", "image_positions", *(["positions"] if "positions" in ref else [])):
            assert torch.equal(it[k].long(), ref[k].long()), k
        for k in ("aux", "final", "image_embeds"):
            torch.testing.assert_close(it[k], ref[k], rtol=1e-3, atol=1e-3)
    run = cfg.model_copy(deep=True)
    run.extract.mode, run.output_dir = "online", str(vl["root"] / "online")
    m = train(run)
    assert m["step"] == 2 and np.isfinite(m["loss"]) and m["loss"] > 0


def test_eval_with_sglang_on_the_bundled_image_prompts(vl, monkeypatch):
    """`eagle3 eval --engine sglang` with the bundled image set and a head trained with target-embeddings (SGLang's
    convention) on the target's answers to them: eagle3 exports the head and starts SGLang with it, which reads
    exactly the ids the built-in rendered (each image's run sent collapsed, with its picture), reproduces the
    vision-language model's own greedy output, fills a card row per picture kind, and takes as many verify steps per
    prompt as the built-in, which accepts most drafts. Then SGLang alone (eval.builtin false) decodes the same prompts
    with their pictures to the same outputs."""
    from eagle3.engines.reference import compare_greedy, hf_greedy
    from eagle3.evaluate import run as evaluate

    monkeypatch.setenv("EAGLE3_HOME", str(vl["root"] / "home"))
    cfg = vl["sg"].model_copy(deep=True)
    cfg.output_dir, cfg.target.sglang.url = str(vl["root"] / "eval"), None
    cfg.eval.checkpoint = str(taught_head(vl["hf"].target.path, vl["root"] / "taught", "target-embeddings"))
    cfg.eval.prompt_sets, cfg.eval.max_prompts, cfg.eval.max_new_tokens, cfg.eval.engine = ["images"], 1, 8, "sglang"
    report = evaluate(cfg)
    b, s = report["sets"]["images"], report["engines"]["sglang"]
    assert report["image_inputs"] == "target-embeddings" and b["greedy_mismatches"] == 0
    assert b["tau"] > 2, b["tau"]
    assert s["draft"] and Path(s["draft"]).name == "sglang"
    assert s["image_prompts"] == 4 and s["prompts_checked"] == s["prompts_same_tokens"] == 4, s
    prompts = json.loads((cfg.eval_dir / "rendered_prompts.json").read_text())["images"]
    images = [t["images"] for t in b["per_turn"]]
    stop = s["stop_token_ids"]
    reference = hf_greedy(cfg.target, prompts, cfg.eval.max_new_tokens, stop, images)
    same = compare_greedy(s["outputs"], reference, stop)
    assert same["greedy_same"] == 4, same
    assert s["verify_steps_per_prompt"] == [t["verify_steps"] for t in b["per_turn"]], (s, b["per_turn"])
    assert set(s["groups"]) >= {"images/chart", "images/code", "images/shapes", "images/text", "images"}

    alone = cfg.model_copy(deep=True)
    alone.eval.builtin, alone.output_dir = False, str(vl["root"] / "alone")
    r = evaluate(alone)
    assert r["engines"]["sglang"]["outputs"] == s["outputs"] and r["sets"]["images"]["turns"] == 4
