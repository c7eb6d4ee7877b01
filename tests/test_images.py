"""Images in the data: how records carry them, how each target's template and processor turn them into tokens, and
what prepare keeps, skips and fingerprints (eagle3.data.images; issue 61, item 1).

Processors come from tiny vision-language targets built in code (tests/vlm_models.py): Qwen2.5-VL and Kimi-K2.5
(transformers' native `kimi_k25`), whose processors need torchvision (`vision` marker)."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import TORCHVISION
from test_kimi_template import REAL_TEMPLATE
from tokenizer_builders import KIMI_SPECIALS, kimi_test_tokenizer, llama_test_tokenizer
from vlm_models import image_file, processor, tiny_kimi_k25_vl, tiny_qwen25_vl

from eagle3 import prepare
from eagle3.config import SourceConfig, load_config
from eagle3.data.images import IMAGE_MARK, VisionInputs, image_ref, load_image
from eagle3.data.prepared import load_prepared
from eagle3.data.sources import SourceStats, read_conversations
from eagle3.data.templates import TemplateError, answer_spans, render, render_prompt
from eagle3.data.types import Conversation, Turn


def needs_torchvision(fn):
    """A vision-language processor's test: skipped without torchvision, which under CI=true fails (conftest)."""
    return pytest.mark.vision(pytest.mark.skipif(TORCHVISION is None, reason="no torchvision: bash "
                                                 "scripts/setup_torchvision.sh")(fn))


MEDIA = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"


def _read(path: Path, **src) -> tuple[list[Conversation], SourceStats]:
    stats = SourceStats("s")
    return list(read_conversations(SourceConfig(path=str(path), **src), stats)), stats


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records))
    return path


# ------------------------------------------------------------------------------------------------ records
def test_openai_image_parts_keep_their_place_and_every_reference_shape(tmp_path):
    """An `image_url` part (object or bare URL; a path relative to the source file, `file://`, `data:`) and the
    `image` part other clients send each leave IMAGE_MARK where they stood and the image, in order, on the turn."""
    a, b = image_file(tmp_path / "pics" / "a.png"), image_file(tmp_path / "b.png", seed=1)
    data_url = "data:image/png;base64," + base64.b64encode(b.read_bytes()).decode()
    content = [{"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": {"url": "pics/a.png"}},
               {"type": "text", "text": " with "}, {"type": "image_url", "image_url": f"file://{b}"},
               {"type": "image", "image": data_url}, {"type": "text", "text": "."}]
    convs, stats = _read(_jsonl(tmp_path / "d.jsonl", [{"messages": [
        {"role": "user", "content": content}, {"role": "assistant", "content": "Same."}]}]))
    (user, answer), = [c.turns for c in convs]
    assert user.content == f"Compare {IMAGE_MARK} with {IMAGE_MARK}{IMAGE_MARK}."
    assert user.images == (str(a), str(b), data_url) and answer.images == ()
    assert not stats.skipped


def test_llava_shape_and_image_dir(tmp_path):
    """LLaVA / ShareGPT-VL: `<image>` in the text, the files in `image` (one) or `images`, relative to
    `image_dir`; without such a field `<image>` stays text."""
    image_file(tmp_path / "imgs" / "x.png")
    image_file(tmp_path / "imgs" / "y.png", seed=1)
    (tmp_path / "data").mkdir()
    src = _jsonl(tmp_path / "data" / "llava.jsonl", [
        {"id": "one", "image": "x.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "Noise."}]},
        {"id": "two", "images": ["x.png", "y.png"], "conversations": [
            {"from": "human", "value": "<image> vs <image>"}, {"from": "gpt", "value": "Both noise."}]},
        {"id": "text", "conversations": [{"from": "human", "value": "What does <image> do in LLaVA?"},
                                         {"from": "gpt", "value": "It marks the picture."}]}])
    convs, stats = _read(src, image_dir=str(tmp_path / "imgs"))
    by_id = {c.id: c for c in convs}
    assert by_id["one"].turns[0].content == f"{IMAGE_MARK}\nWhat is this?"
    assert by_id["one"].images == [str(tmp_path / "imgs" / "x.png")]
    assert [Path(i).name for i in by_id["two"].images] == ["x.png", "y.png"]
    assert by_id["text"].images == [] and "<image>" in by_id["text"].turns[0].content
    assert not stats.skipped


def test_bad_images_skip_their_records_each_by_its_reason(tmp_path):
    image_file(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_text("not a picture")

    def rec(rid: str, url: str, **extra) -> dict:
        return {"id": rid, **extra, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "A picture."}]}

    src = _jsonl(tmp_path / "d.jsonl", [
        rec("fine", "ok.png"), rec("missing", "nowhere.png"), rec("broken", "broken.png"),
        rec("remote", "https://example.com/cat.png"), rec("bad-data", "data:image/png;base64,@@@"),
        {"id": "mismatch", "images": ["ok.png"], "conversations": [
            {"from": "human", "value": "<image> <image>"}, {"from": "gpt", "value": "?"}]},
        {"id": "answer-image", "messages": [
            {"role": "user", "content": "Draw."},
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "ok.png"}}]}]},
        {"id": "audio", "messages": [
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
            {"role": "assistant", "content": "?"}]},
        {"id": "own-mark", "messages": [{"role": "user", "content": f"a {IMAGE_MARK} b"},
                                        {"role": "assistant", "content": "c"}]}])
    convs, stats = _read(src)
    assert [c.id for c in convs] == ["fine", "own-mark"]
    assert convs[1].turns[0].content == "a \ufffd b" and convs[1].images == []  # a source's U+FFFC is never an image
    assert stats.repaired["object_replacement_char_replaced"] == 1
    assert dict(stats.skipped) == {"image_missing": 1, "image_unreadable": 2, "image_remote_url": 1,
                                   "image_count_mismatch": 1, "image_in_assistant_turn": 1, "non_text_part": 1}


def test_image_refs():
    assert image_ref("file:///a/b%20c.png", None) == "/a/b c.png"
    assert image_ref("x.png", Path("/data")) == "/data/x.png"
    assert image_ref("data:image/png;base64,AAAA", None) == "data:image/png;base64,AAAA"


# ----------------------------------------------------------------------------------------------- templates
def test_builtin_kimi_template_writes_k25s_image_placeholder(tmp_path):
    """The built-in kimi-k2.5 renders an image part as K2.5's own template does (one `<|media_pad|>` and a newline),
    in the training text and in every generation prompt; the image is prompt, never in the loss."""
    tok = kimi_test_tokenizer(tmp_path / "k")
    real = kimi_test_tokenizer(tmp_path / "r")
    real.chat_template = REAL_TEMPLATE
    conv = Conversation("c", [Turn("user", f"Look: {IMAGE_MARK} and {IMAGE_MARK}?", images=("/a.png", "/b.png")),
                              Turn("assistant", "Two."), Turn("user", f"{IMAGE_MARK}Now?", images=("/c.png",)),
                              Turn("assistant", "Three.")])
    text, spans = answer_spans(conv, tok, "kimi-k2.5", thinking=False)
    assert f"Look: {MEDIA} and {MEDIA}?" in text and f"<|im_middle|>{MEDIA}Now?" in text
    real_text, real_spans = answer_spans(conv, real, "auto", thinking=False)
    assert (text, spans) == (real_text, real_spans)
    assert all(MEDIA not in text[s:e] for s, e in spans)


def test_a_text_only_target_never_renders_an_image_as_text(tmp_path):
    tok = llama_test_tokenizer(tmp_path / "t")
    conv = Conversation("c", [Turn("user", f"{IMAGE_MARK}?", images=("/a.png",)), Turn("assistant", "A.")])
    with pytest.raises(ValueError, match="non_text_part"):
        render(conv, tok, "chatml", thinking=False)
    with pytest.raises(TemplateError, match="images"):
        render_prompt(conv.turns[:1], tok, "chatml", thinking=False)


@needs_torchvision
@pytest.mark.parametrize("family", ["qwen2.5-vl", "kimi-k2.5"])
def test_render_is_the_processors_tokens_with_images_as_prompt(tmp_path, family):
    """Each image's placeholder becomes the tokens the target's processor makes of it (56 px: 4, 112 px: 16, a
    non-square 84x140: its own count), the whole sequence equal to the processor's own input_ids for the rendered
    text, and the loss mask exactly the text-only conversation's answers."""
    build, tpl = (tiny_qwen25_vl, "auto") if family == "qwen2.5-vl" else (tiny_kimi_k25_vl, "kimi-k2.5")
    proc = processor(build(tmp_path / family, with_model=False))
    vision = VisionInputs.from_processor(proc)
    refs = (str(image_file(tmp_path / "a.png", 56)), str(image_file(tmp_path / "b.png", 112, seed=1)))
    from PIL import Image

    Image.fromarray(np.zeros((84, 140, 3), np.uint8)).save(tmp_path / "c.png")
    refs += (str(tmp_path / "c.png"),)
    turns = [Turn("user", f"Look {IMAGE_MARK} and {IMAGE_MARK}?", images=refs[:2]), Turn("assistant", "Two pictures."),
             Turn("user", f"{IMAGE_MARK} More?", images=refs[2:]), Turn("assistant", "No.")]
    ids, mask = render(Conversation("c", turns), proc.tokenizer, tpl, thinking=False, vision=vision)
    text, _ = answer_spans(Conversation("c", turns), proc.tokenizer, tpl, thinking=False)
    assert ids == list(proc(text=[text], images=[load_image(r) for r in refs])["input_ids"][0])
    runs = np.diff(np.flatnonzero(np.diff(np.r_[0, np.asarray(ids) == vision.image_token_id, 0])))[::2]
    assert runs.tolist() == [4, 16, vision.count(refs[2])] and vision.count(refs[2]) not in (4, 16)
    assert not any(m for i, m in zip(ids, mask, strict=True) if i == vision.image_token_id)
    answers = proc.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert answers.replace(" ", "") == ("Two pictures.<|im_end|>No.<|im_end|>").replace(" ", "")


def test_a_cut_never_splits_an_image():
    """data.max_length inside an image's tokens moves the cut to its first token; images after the cut leave."""
    p = 9
    ids = [1, 2, p, p, p, 3, p, p, 4, 5]
    refs = ("a", "b")
    assert prepare.image_cut(ids, refs, 10, p) == (10, refs)
    assert prepare.image_cut(ids, refs, 7, p) == (6, ("a",))  # inside b: cut before it
    assert prepare.image_cut(ids, refs, 6, p) == (6, ("a",))  # b starts at the cut
    assert prepare.image_cut(ids, refs, 4, p) == (2, ())


# --------------------------------------------------------------------------------------------------- prepare
def _image_data(tmp_path: Path, n: int = 12) -> Path:
    recs = []
    for i in range(n):
        image_file(tmp_path / "imgs" / f"{i}.png", 56 if i % 2 else 112, seed=i)
        user = ([{"type": "image_url", "image_url": {"url": f"imgs/{i}.png"}}, {"type": "text", "text": f"Picture {i}?"}]
                if i % 3 else f"Question {i}?")  # every third record is text only
        recs.append({"id": f"r{i}", "messages": [{"role": "user", "content": user},
                                                  {"role": "assistant", "content": f"Answer {i}. " * (1 + i % 3)}]})
    return _jsonl(tmp_path / "data.jsonl", recs)


def _prep_cfg(tmp_path: Path, target: Path, data: Path, *more: str):
    return load_config(None, [f"output_dir={tmp_path / 'run'}", f"target.path={target}", f"data.sources=[{{path: {data}}}]",
                              "data.eval_size=2", "draft.vocab_size=64", *more])


@needs_torchvision
def test_prepare_with_images_fingerprints_their_bytes(tmp_path, capsys):
    """A Qwen2.5-VL target: image samples keep their images (a column of the prepared folder) and their image
    tokens (prompt); the summary counts them; the same config reuses the folder, and new bytes under the same file
    name re-prepare it (and change the samples' fingerprint, which caches follow)."""
    target = tiny_qwen25_vl(tmp_path / "qwen", with_model=False)
    data = _image_data(tmp_path)
    s = prepare.run(_prep_cfg(tmp_path, target, data))
    assert s["render"]["image_conversations"] == 8 and s["render"]["images"] == 8
    p = load_prepared(tmp_path / "run" / "prepared")
    rows = list(p.train) + list(p.eval)
    assert len(rows) == 12 and p.train.column_names[-1] == "images"
    for row in rows:
        i = int(row["id"][1:])
        n_img = sum(t == 261 for t in row["input_ids"])
        assert (row["images"], n_img) == (([str(tmp_path / "imgs" / f"{i}.png")], 4 if i % 2 else 16) if i % 3
                                          else ([], 0))
        assert not any(m for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if t == 261)
    fp = p.meta["samples_fingerprint"]

    prepare.run(_prep_cfg(tmp_path, target, data))
    assert "reusing prepared data" in capsys.readouterr().out
    image_file(tmp_path / "imgs" / "1.png", 56, seed=99)  # same name, same size, other pixels
    prepare.run(_prep_cfg(tmp_path, target, data))
    assert "reusing prepared data" not in capsys.readouterr().out
    assert load_prepared(tmp_path / "run" / "prepared").meta["samples_fingerprint"] != fp


def test_prepare_for_a_text_only_target_skips_image_records_and_counts_them(tmp_path):
    """The same data for a text-only target: the 8 records with images are skipped as `non_text_part` (prepare's
    summary), the 4 text ones prepared, and no image placeholder is ever trained as text."""
    tok = tmp_path / "tok"
    llama_test_tokenizer(tok, vocab_size=320)
    s = prepare.run(_prep_cfg(tmp_path, tok, _image_data(tmp_path), "data.eval_size=1"))
    assert s["render"]["non_text_part"] == 8 and s["train_samples"] + s["eval_samples"] == 4
    assert "images" not in load_prepared(tmp_path / "run" / "prepared").train.column_names


def test_kimi_specials_hold_k25s_media_ids():
    assert [KIMI_SPECIALS[t] for t in ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")] == [
        163602, 163603, 163604, 163605]


@needs_torchvision
def test_extract_and_train_refuse_image_samples_they_cannot_compute(tmp_path):
    """Until extraction runs the vision tower, a prepared folder with images is refused by the stages that would
    compute their states without the pictures, naming why."""
    from eagle3.data.prepared import PreparedError, check_prepared

    target = tiny_qwen25_vl(tmp_path / "qwen", with_model=False)
    cfg = _prep_cfg(tmp_path, target, _image_data(tmp_path))
    prepare.run(cfg)
    meta = load_prepared(cfg.prepared_dir).meta
    for stage in ("extract", "train"):
        with pytest.raises(PreparedError, match="holds samples with images"):
            check_prepared(cfg.data, cfg.draft, cfg.target, cfg.prepared_dir, meta, stage)


def test_regenerate_leaves_image_conversations_as_recorded_and_counts_them(tmp_path):
    """regenerate sends text prompts: an image conversation is counted and skipped (never sent without its
    picture); with nothing else to answer no backend is built at all."""
    from eagle3.config import Config
    from eagle3.regenerate import load_conversations, run

    data = _image_data(tmp_path, n=6)
    recs = [json.loads(line) for line in data.read_text().splitlines()]
    _jsonl(data, [r for r in recs if not isinstance(r["messages"][0]["content"], str)])  # the 4 with images
    cfg = Config(output_dir=str(tmp_path / "run"), data={"sources": [{"path": str(data)}]},
                 regenerate={"backend": "openai", "endpoints": ["http://127.0.0.1:9"], "model": "m"})
    s = run(cfg, load_conversations(cfg.data))
    assert (s.skipped_images, s.regenerated) == (4, 0) and "4 with images skipped" in s.line()


def test_a_vision_target_whose_processor_cannot_load_is_an_error_not_a_text_target(tmp_path):
    """Without its processor (here: its files removed, as a missing torchvision also leaves it) a target with a
    vision tower is refused by name: counting every image record as `non_text_part` would hide the cause."""
    import shutil

    from eagle3.config import TargetConfig

    target = tmp_path / "vlm"
    llama_test_tokenizer(target, vocab_size=320)
    (target / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {"depth": 1},
                                                    "text_config": {"num_hidden_layers": 4}}))
    with pytest.raises(RuntimeError, match="vision tower"):
        VisionInputs.of(TargetConfig(path=str(target)))
    text_only = tmp_path / "text"
    shutil.copytree(target, text_only)
    (text_only / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4}))
    assert VisionInputs.of(TargetConfig(path=str(text_only))) is None


# ------------------------------------------------------------------------------------------------ extraction
@needs_torchvision
@pytest.mark.parametrize("family", ["qwen2.5-vl", "kimi-k2.5"])
def test_hf_capture_runs_the_vision_tower(tmp_path, family):
    """HFTarget(images=True) captures, for a batch of image and text samples of different lengths, exactly the
    states the vision-language model's own forward computes from its processor's inputs (hidden_states[k] for each
    layer id; the post-norm last one as `final`): the pictures merged at their tokens and, for Qwen2.5-VL, M-RoPE's
    3-D positions. The same ids without the pictures give other states."""
    import torch
    from transformers import AutoModelForImageTextToText

    from eagle3.config import ExtractConfig, TargetConfig
    from eagle3.targets.hf import HFTarget, MetaPositions

    build, tpl = (tiny_qwen25_vl, "auto") if family == "qwen2.5-vl" else (tiny_kimi_k25_vl, "kimi-k2.5")
    path = build(tmp_path / family, with_model=True)
    proc = processor(path)
    vision = VisionInputs.from_processor(proc)
    refs = [str(image_file(tmp_path / "a.png", 56)), str(image_file(tmp_path / "b.png", 112, seed=1))]
    convs = [Conversation("two", [Turn("user", f"See {IMAGE_MARK}{IMAGE_MARK}?", images=tuple(refs)),
                                  Turn("assistant", "Two.")]),
             Conversation("text", [Turn("user", "No picture here, a longer question?"), Turn("assistant", "Fine.")]),
             Conversation("one", [Turn("user", f"{IMAGE_MARK} this?", images=(refs[1],)), Turn("assistant", "Yes.")])]
    seqs = [render(c, proc.tokenizer, tpl, thinking=False, vision=vision)[0] for c in convs]
    target = TargetConfig(path=str(path), aux_layer_ids=[1, 2, 3], dtype="float32")
    backend = HFTarget(target, ExtractConfig(batch_tokens=4096), images=True)
    caps = backend.capture(seqs, [list(c.images) for c in convs])

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    meta = MetaPositions(path, vision) if family == "qwen2.5-vl" else None  # M-RoPE's positions without the weights
    for conv, ids, cap in zip(convs, seqs, caps, strict=True):
        text, _ = answer_spans(conv, proc.tokenizer, tpl, thinking=False)
        enc = proc(text=[text], images=[load_image(r) for r in conv.images] or None, return_tensors="pt")
        assert enc["input_ids"][0].tolist() == ids
        if hasattr(model.model, "rope_deltas"):
            model.model.rope_deltas = None
        with torch.no_grad():
            hs = model(**enc, output_hidden_states=True).hidden_states
        torch.testing.assert_close(cap.aux, torch.cat([hs[k][0] for k in (1, 2, 3)], -1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cap.final, hs[-1][0], atol=1e-5, rtol=1e-5)
        at = torch.tensor(ids) == vision.image_token_id
        assert cap.image_embeds.shape == (int(at.sum()), hs[0].shape[-1])
        torch.testing.assert_close(cap.image_embeds, hs[0][0][at], atol=1e-6, rtol=1e-6)  # the merged pictures
        if at.any():
            plain = model.get_input_embeddings()(torch.tensor(ids)[at])
            assert not torch.allclose(cap.image_embeds, plain, atol=1e-3)
        if meta is None:  # Kimi-K2.5's positions are 1-D: the token index, none kept
            assert cap.positions is None
            continue
        # the temporal row of the positions the model itself used: vLLM's draft positions
        want = model.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"],
                                          image_grid_thw=enc.get("image_grid_thw"))[0][0, 0]
        if conv.images:
            assert torch.equal(cap.positions, want)
            assert cap.positions[-1] < len(ids) - 1  # a picture moves the text after it off the token index
            assert torch.equal(meta(ids, list(conv.images)), want)  # computed without the weights (SGLang's)
        else:  # a text sample's positions are the index: none kept
            assert cap.positions is None and torch.equal(want, torch.arange(len(ids))) and meta(ids, []) is None
    with pytest.raises(ValueError, match="image tokens in a batch without images"):
        backend.capture([seqs[0]], [[]])
    with torch.no_grad():  # the LLM alone on the same ids (the pictures' tokens as plain embeddings) differs
        blind = model.model.language_model(input_ids=torch.tensor([seqs[0]])).last_hidden_state[0]
    assert not torch.allclose(blind, caps[0].final, atol=1e-3)


@needs_torchvision
def test_image_samples_extract_and_train_with_the_placeholder_convention(tmp_path):
    """prepare -> extract -> train on a tiny Qwen2.5-VL with image and text samples, draft.image_inputs=placeholder
    (vLLM's inputs): the cache holds, for an image sample, the states the vision-language model computes for it
    alone, and a few training steps stay finite. Without draft.image_inputs, each stage refuses by name."""
    import torch

    from eagle3.cache import HiddenStateDataset, expected_fingerprint
    from eagle3.data.prepared import PreparedError
    from eagle3.extract import run as extract
    from eagle3.targets.hf import HFTarget
    from eagle3.trainer import run as train

    target = tiny_qwen25_vl(tmp_path / "qwen", with_model=True)
    data = _image_data(tmp_path)
    more = ("target.dtype=float32", "extract.shard_samples=4", "extract.batch_tokens=512", "train.batch_tokens=512",
            "train.max_steps=2", "train.eval_every=2", "draft.vocab_size=320")
    prepare.run(_prep_cfg(tmp_path, target, data, *more))
    with pytest.raises(PreparedError, match="set draft.image_inputs"):
        extract(_prep_cfg(tmp_path, target, data, *more))
    cfg = _prep_cfg(tmp_path, target, data, *more, "draft.image_inputs=placeholder")
    assert extract(cfg)["samples"] == 12  # both splits

    ds = HiddenStateDataset(cfg.cache_dir, "train", expected=expected_fingerprint(cfg.target, cfg.extract.storage,
                                                                                  cfg.prepared_dir))
    prepared = load_prepared(cfg.prepared_dir)
    backend = HFTarget(cfg.target, cfg.extract, images=True)
    item = next(ds[i] for i in range(len(ds)) if 261 in ds[i]["input_ids"].tolist())
    row = prepared.train[prepared.train["id"].index(item["sample_id"])]
    c = backend.capture([row["input_ids"]], [row["images"]])[0]
    torch.testing.assert_close(item["aux"], c.aux, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(item["final"], c.final, rtol=1e-5, atol=1e-5)
    # Qwen2.5-VL's M-RoPE: the cache keeps the positions vLLM gives the draft (the temporal row), off the index
    assert ds.fingerprint["positions"] == "mrope-temporal"
    assert torch.equal(item["positions"], c.positions) and not torch.equal(item["positions"], torch.arange(len(c.aux)))
    assert all("positions" not in ds[i] or 261 in ds[i]["input_ids"].tolist() for i in range(len(ds)))

    m = train(cfg)
    assert m["step"] == 2 and np.isfinite(m["loss"]) and m["loss"] > 0
    # the convention travels with the head: into vLLM's export and its card; SGLang's export refuses it
    from eagle3.export import ExportError, export

    step = Path(cfg.output_dir) / "checkpoints" / "best"
    out = cfg.paths.export_dir / "vllm"  # the trainer's own export of its best head: for the engine it serves
    assert json.loads((out / "config.json").read_text())["eagle3"]["image_inputs"] == "placeholder"
    assert "with `placeholder` inputs at image tokens" in (out / "README.md").read_text()
    with pytest.raises(ExportError, match="trained with draft.image_inputs='placeholder'"):
        export(step, tmp_path / "sglang-head", to="sglang")


@needs_torchvision
def test_target_embeddings_cache_the_pictures_and_feed_them_to_the_head(tmp_path):
    """draft.image_inputs=target-embeddings (SGLang's inputs): the cache keeps, for each image sample, its image
    token positions and the target's merged input embeddings there (the projector's outputs, equal to the HF
    capture's), nothing for text samples; in training the head reads those embeddings one position early (the ids'
    shift) and the pictures change the loss, where `placeholder` drops them; the head is exported for SGLang with
    its convention."""
    import torch

    from eagle3.batching import collate
    from eagle3.cache import HiddenStateDataset
    from eagle3.extract import run as extract
    from eagle3.loss import Teacher
    from eagle3.model import Eagle3Draft, Eagle3DraftConfig
    from eagle3.objective import Objective
    from eagle3.targets.hf import HFTarget
    from eagle3.trainer import run as train

    target = tiny_qwen25_vl(tmp_path / "qwen", with_model=True)
    data = _image_data(tmp_path)
    cfg = _prep_cfg(tmp_path, target, data, "target.dtype=float32", "extract.shard_samples=4",
                    "extract.batch_tokens=512", "train.batch_tokens=512", "train.max_steps=2", "train.eval_every=2",
                    "draft.vocab_size=320", "draft.image_inputs=target-embeddings")
    prepare.run(cfg)
    assert extract(cfg)["samples"] == 12
    ds = HiddenStateDataset(cfg.cache_dir, "train")
    assert ds.fingerprint["image_embeds"] is True
    prepared = load_prepared(cfg.prepared_dir)
    backend = HFTarget(cfg.target, cfg.extract, images=True)
    items = [ds[i] for i in range(len(ds))]
    with_images = [it for it in items if len(it["image_positions"])]
    assert with_images and any(len(it["image_positions"]) == 0 for it in items)
    for it in items:
        ids = it["input_ids"]
        assert it["image_positions"].tolist() == torch.nonzero(ids == 261).flatten().tolist()
        assert it["image_embeds"].shape == (len(it["image_positions"]), 64)
    item = with_images[0]
    row = prepared.train[prepared.train["id"].index(item["sample_id"])]
    c = backend.capture([row["input_ids"]], [row["images"]])[0]
    torch.testing.assert_close(item["image_embeds"], c.image_embeds)

    text = next(it for it in items if not len(it["image_positions"]))
    mixed = collate([text, with_images[0]])  # a text sample beside an image one: its positions are the index
    t = mixed["input_ids"].shape[1]
    assert "positions" not in text and torch.equal(mixed["position_ids"][0], torch.arange(t))
    assert torch.equal(mixed["position_ids"][1, :len(with_images[0]["positions"])], with_images[0]["positions"])
    batch = collate(with_images[:2])
    torch.manual_seed(0)
    dc = Eagle3DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           intermediate_size=128, vocab_size=320, draft_vocab_size=320, target_hidden_size=64)
    model = Eagle3Draft(dc)
    lm_head = backend.lm_head_weight.detach()
    model.init_from_target(lm_head, backend.model.get_input_embeddings().weight.detach())
    model.set_vocab(torch.zeros(320, dtype=torch.long), torch.ones(320, dtype=torch.bool))
    teacher = Teacher(lm_head, torch.zeros(320, dtype=torch.long), torch.ones(320, dtype=torch.bool))
    losses = {}
    for convention in ("target-embeddings", "placeholder"):
        objective = Objective(teacher, cfg.train, image_inputs=convention)
        planned = objective.plan(batch)
        if convention == "target-embeddings":
            b = planned.batch
            fed = model.embed(b["draft_ids"], b["image_embeds"])
            at = b["draft_ids"] >= 320
            assert torch.equal(at, batch["input_ids"] == 261)
            torch.testing.assert_close(fed[at], torch.cat([it["image_embeds"] for it in with_images[:2]]))
            assert "position_ids" not in b  # SGLang gives its draft the token index
        else:
            assert "draft_ids" not in planned.batch and "image_embeds" not in planned.batch
            # vLLM's positions: the M-RoPE temporal row the cache keeps, which the loss feeds the head
            assert torch.equal(planned.batch["position_ids"][0, :len(with_images[0]["positions"])],
                               with_images[0]["positions"])
            at_index = dataclasses.replace(planned, batch={k: v for k, v in planned.batch.items()
                                                           if k != "position_ids"})
            with torch.no_grad():
                losses["placeholder at the index"] = float(objective.loss(model, at_index)[0])
        with torch.no_grad():
            losses[convention] = float(objective.loss(model, planned)[0])
    assert abs(losses["target-embeddings"] - losses["placeholder"]) > 1e-6, losses
    assert abs(losses["placeholder at the index"] - losses["placeholder"]) > 1e-6, losses

    m = train(cfg)
    assert m["step"] == 2 and np.isfinite(m["loss"]) and m["loss"] > 0
    out = cfg.paths.export_dir / "sglang"
    assert json.loads((out / "config.json").read_text())["eagle3"]["image_inputs"] == "target-embeddings"


@needs_torchvision
def test_online_training_captures_image_samples_as_extraction_caches_them(tmp_path):
    """extract.mode=online with image samples: the items the target computes while the head trains are the cache's
    items (states, image positions, the merged image embeddings; a text sample has none), and a few online steps
    train under target-embeddings (the SGLang backend's: tests/test_sglang_images.py)."""
    import torch

    from eagle3.cache import HiddenStateDataset
    from eagle3.extract import run as extract
    from eagle3.online import capture_items
    from eagle3.targets.argmax import ArgmaxHead
    from eagle3.targets.hf import HFTarget
    from eagle3.trainer import run as train

    target = tiny_qwen25_vl(tmp_path / "qwen", with_model=True)
    data = _image_data(tmp_path)
    more = ("target.dtype=float32", "extract.shard_samples=4", "extract.batch_tokens=512", "train.batch_tokens=512",
            "train.max_steps=2", "train.eval_every=2", "draft.vocab_size=320", "draft.image_inputs=target-embeddings")
    cfg = _prep_cfg(tmp_path, target, data, *more)
    prepare.run(cfg)
    extract(cfg)
    ds = HiddenStateDataset(cfg.cache_dir, "train")
    prepared = load_prepared(cfg.prepared_dir).train
    backend = HFTarget(cfg.target, cfg.extract, images=True)
    argmax = ArgmaxHead.for_backend(backend, cfg.target, cfg.extract.teacher_chunk)
    cached = {it["sample_id"]: it for it in (ds[i] for i in range(len(ds)))}
    online = capture_items(backend, prepared, list(range(len(prepared))), argmax)
    assert {len(it["image_positions"]) > 0 for it in online} == {True, False}
    for it in online:
        ref = cached[it["sample_id"]]
        assert set(it) == set(ref), (set(it) ^ set(ref))
        for k in ("input_ids", "loss_mask", "target_argmax", "image_positions"):
            assert torch.equal(it[k].long(), ref[k].long()), k
        for k in ("aux", "final", "image_embeds"):
            torch.testing.assert_close(it[k], ref[k], rtol=1e-5, atol=1e-5)

    run = _prep_cfg(tmp_path, target, data, *more, "extract.mode=online", f"output_dir={tmp_path / 'online'}",
                    f"data.output_dir={cfg.prepared_dir}")
    m = train(run)
    assert m["step"] == 2 and np.isfinite(m["loss"]) and m["loss"] > 0
