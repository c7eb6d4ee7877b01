"""Evaluation on image prompts (issue 61, item 4): the built-in evaluator decodes them with the vision-language target
and gives the draft what the chosen engine feeds at image tokens; the bundled image prompt set is a card of its own.

Tiny random VLMs built in code (tests/vlm_models.py); their processors need torchvision (`vision` marker)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from test_images import needs_torchvision
from vlm_models import image_file, processor, tiny_kimi_k25_vl, tiny_qwen25_vl

from eagle3.data.images import IMAGE_MARK, VisionInputs, load_image
from eagle3.data.templates import render_prompt
from eagle3.data.types import Turn

FAMILIES = {"qwen2.5-vl": (tiny_qwen25_vl, "auto"), "kimi-k2.5": (tiny_kimi_k25_vl, "kimi-k2.5")}


def _head(model: torch.nn.Module, vocab: int, seed: int = 0):
    """A random head for the VLM's LLM (hidden 64, 4 layers), every token in its draft vocab."""
    from eagle3.model import Eagle3Draft, Eagle3DraftConfig

    dc = Eagle3DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           intermediate_size=128, vocab_size=vocab, draft_vocab_size=vocab, target_hidden_size=64,
                           aux_layer_ids=[1, 2, 3])
    torch.manual_seed(seed)
    draft = Eagle3Draft(dc)
    draft.set_vocab(torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool))
    draft.init_from_target(model.get_output_embeddings().weight.detach(), model.get_input_embeddings().weight.detach())
    return draft.eval()


def _processor_inputs(proc, vision: VisionInputs, ids: list[int], refs: list[str]) -> dict:
    """What the processor makes of the prompt's text with each image's placeholder written once."""
    tok = re.escape(vision.image_token)
    text = re.sub(f"({tok})+", vision.image_token, proc.tokenizer.decode(ids))
    enc = proc(text=[text], images=[load_image(r) for r in refs], return_tensors="pt")
    assert enc["input_ids"][0].tolist() == ids
    return enc


def _decoder(tmp_path: Path, family: str, image_inputs: str = "placeholder", max_new_tokens: int = 12):
    from eagle3.specdec import HFTargetDecoder, SpecSettings, SpeculativeDecoder
    from eagle3.targets.hf import load_vision_lm

    build, tpl = FAMILIES[family]
    path = build(tmp_path / family, with_model=True)
    proc = processor(path)
    vision = VisionInputs.from_processor(proc)
    model = load_vision_lm(str(path), torch.float32)
    vocab = model.config.get_text_config().vocab_size
    target = HFTargetDecoder(model, [1, 2, 3], vision)
    dec = SpeculativeDecoder(target, _head(model, vocab), SpecSettings(num_steps=3, max_new_tokens=max_new_tokens),
                             image_inputs=image_inputs)
    return dec, proc, vision, tpl, model


@needs_torchvision
@pytest.mark.parametrize("family", list(FAMILIES))
def test_speculative_decoding_on_an_image_prompt_is_the_vlms_own_greedy_decoding(tmp_path, family):
    """Speculative (both conventions), plain and n-gram decoding of an image prompt give the tokens the VLM's own
    `generate` gives from its processor's inputs (Qwen2.5-VL: every verify step at M-RoPE's positions after the
    picture, rope_deltas; Kimi: 1-D), and a text prompt decoded next starts from plain positions again."""
    dec, proc, vision, tpl, model = _decoder(tmp_path, family)
    refs = [str(image_file(tmp_path / "a.png", 112)), str(image_file(tmp_path / "b.png", 56, seed=1))]
    turns = [Turn("user", f"Look {IMAGE_MARK} and {IMAGE_MARK}: what?", images=tuple(refs))]
    ids = render_prompt(turns, proc.tokenizer, tpl, False, vision=vision)
    assert sum(t == vision.image_token_id for t in ids) > 8

    enc = _processor_inputs(proc, vision, ids, refs)
    if hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=12, do_sample=False, eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True)
    want = gen.sequences[0, len(ids):].tolist()
    cache = dec.target.new_cache()  # the logits themselves, after the prompt (a random model's argmax barely moves)
    first, _ = dec.target.forward(torch.tensor(ids), torch.arange(len(ids)), cache, aux=False, images=refs)
    second, _ = dec.target.forward(torch.tensor(want[:1]), torch.tensor([len(ids)]), cache, aux=False)
    torch.testing.assert_close(first[-1], gen.logits[0][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second[-1], gen.logits[1][0], rtol=1e-4, atol=1e-4)
    assert dec.generate_baseline(ids, None, refs).tokens == want
    for convention in ("placeholder", "target-embeddings"):
        dec.image_inputs = convention
        out = dec.generate(ids, None, refs)
        assert out.tokens == want and out.num_steps > 0, convention
    assert dec.generate_ngram(ids, None, images=refs).tokens == want
    assert dec.target.offset != 0 or family == "kimi-k2.5"  # M-RoPE's offset after the pictures

    text = render_prompt([Turn("user", "No picture: count to five.")], proc.tokenizer, tpl, False)
    with torch.no_grad():
        plain = model.generate(torch.tensor([text]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None)[0, len(text):].tolist()
    assert dec.generate(text).tokens == plain and dec.target.offset == 0


@needs_torchvision
def test_the_draft_reads_what_each_engine_feeds_at_image_tokens(tmp_path):
    """At draft position i the head reads token i+1: with `target-embeddings` (SGLang) the target's merged input
    embedding there, i.e. the vision projector's output at an image token and the token's own embedding
    elsewhere; with `placeholder` (vLLM) the image token's embedding. The two conventions draft differently."""
    dec, proc, vision, tpl, model = _decoder(tmp_path, "qwen2.5-vl", "target-embeddings")
    ref = str(image_file(tmp_path / "a.png", 112))
    ids = render_prompt([Turn("user", f"{IMAGE_MARK} what is it?", images=(ref,))], proc.tokenizer, tpl, False,
                        vision=vision)
    enc = _processor_inputs(proc, vision, ids, [ref])
    merged = {}
    hook = dec.target.llm.register_forward_pre_hook(lambda _m, _a, kw: merged.__setitem__("x", kw["inputs_embeds"][0]),
                                                    with_kwargs=True)
    with torch.no_grad():
        model.model.rope_deltas = None
        model(**enc)
    hook.remove()
    dec.target.forward(torch.tensor(ids), torch.arange(len(ids)), dec.target.new_cache(), images=[ref])
    root = 7
    fed, extra = dec._prompt_inputs(ids, root, True)
    seen = dec.draft.embed(torch.tensor(fed), extra)
    torch.testing.assert_close(seen[:-1], merged["x"][1:])  # shifted by one, like the ids
    assert fed[-1] == root
    image_at = torch.tensor(ids[1:]) == vision.image_token_id
    own = model.get_input_embeddings()(torch.tensor(ids[1:]))
    assert not torch.allclose(seen[:-1][image_at], own[image_at], atol=1e-3)
    torch.testing.assert_close(seen[:-1][~image_at], own[~image_at])

    dec.image_inputs = "placeholder"
    fed_p, extra_p = dec._prompt_inputs(ids, root, True)
    assert fed_p == ids[1:] + [root] and extra_p is None
    a = dec.draft.decode(torch.tensor([fed]), torch.zeros(1, len(fed), 64), torch.arange(len(fed))[None], None,
                         extra=extra)[1]
    b = dec.draft.decode(torch.tensor([fed_p]), torch.zeros(1, len(fed), 64), torch.arange(len(fed))[None], None)[1]
    assert not torch.allclose(a, b, atol=1e-4)


@needs_torchvision
def test_eval_measures_the_bundled_image_prompts_as_a_card_of_their_own(tmp_path, monkeypatch):
    """`eagle3 eval` with prompt_sets [images, a text set] on a tiny Qwen2.5-VL: the image set's four kinds are its
    card's categories, every greedy answer is the target's own, the report names the inputs the head read (the
    head's recorded convention, else the engine's; SGLang's for the built-in alone), and a head trained for vLLM is
    refused for SGLang. A text-only target asked the image set is refused by name."""
    from eagle3.config import Config
    from eagle3.evaluate import run
    from eagle3.formats import save_draft
    from eagle3.logs import UserError

    monkeypatch.setenv("EAGLE3_HOME", str(tmp_path / "home"))
    path = tiny_qwen25_vl(tmp_path / "qwen", with_model=True)
    from eagle3.targets.hf import load_vision_lm

    model = load_vision_lm(str(path), torch.float32)
    cfg = Config(output_dir=str(tmp_path / "run"))
    cfg.target.path, cfg.target.dtype = str(path), "float32"
    prompts = tmp_path / "text.jsonl"
    prompts.write_text('{"id": "t", "prompt": "Hello there"}\n')
    cfg.eval.prompt_sets, cfg.eval.max_prompts, cfg.eval.max_new_tokens = ["images", str(prompts)], 1, 6
    head = _head(model, 320)
    save_draft(head, cfg.checkpoint_dir / "best")
    report = run(cfg)
    images = report["sets"]["images"]
    assert set(images["categories"]) == {"chart", "code", "shapes", "text"} and images["turns"] == 4
    assert images["greedy_mismatches"] == 0 and report["sets"]["text"]["greedy_mismatches"] == 0
    assert report["image_inputs"] == "target-embeddings"
    assert all(len(t["images"]) == 1 for t in images["per_turn"])
    assert all(Path(t["images"][0]).is_file() for t in images["per_turn"])
    assert json.loads((cfg.eval_dir / "report.json").read_text())["sets"]["images"]["turns"] == 4

    head.config.image_inputs = "placeholder"
    save_draft(head, cfg.checkpoint_dir / "best")
    cfg.eval.engine = "sglang"
    with pytest.raises(UserError, match="trained with draft.image_inputs='placeholder', and sglang feeds"):
        run(cfg)


def test_a_text_only_target_is_not_asked_image_prompts(tmp_path):
    from tokenizer_builders import llama_test_tokenizer

    from eagle3.config import TargetConfig
    from eagle3.evaluate import vision_of
    from eagle3.logs import UserError
    from eagle3.prompts import load_prompt_set

    tok = tmp_path / "tok"
    llama_test_tokenizer(tok, vocab_size=320)
    sets = [load_prompt_set("images", max_prompts=1)]
    with pytest.raises(UserError, match="prompt set\\(s\\) images hold images, and target.path=.* takes none"):
        vision_of(TargetConfig(path=str(tok)), sets)
    assert vision_of(TargetConfig(path=str(tok)), []) is None


@needs_torchvision
def test_vllm_alone_is_not_asked_image_prompts(tmp_path, monkeypatch):
    """eval.builtin false: SGLang sends each turn's pictures (tests/test_sglang_images.py); vLLM's engine-only
    dialogues do not, so image sets are refused by name before any head or engine is looked for."""
    from eagle3.config import Config
    from eagle3.evaluate import run
    from eagle3.logs import UserError

    monkeypatch.setenv("EAGLE3_HOME", str(tmp_path / "home"))
    cfg = Config(output_dir=str(tmp_path / "run"))
    cfg.target.path = str(tiny_qwen25_vl(tmp_path / "qwen", with_model=False))
    cfg.eval.builtin, cfg.eval.engine, cfg.eval.prompt_sets, cfg.eval.max_prompts = False, "vllm", ["images"], 1
    with pytest.raises(UserError, match="images hold images: vllm alone \\(eval.builtin false\\) sends none"):
        run(cfg)


def test_the_bundled_image_set_draws_the_same_pictures_once(tmp_path):
    """12 prompts, 3 per kind, each a 448x448 picture before its question; drawn once, the same bytes when drawn
    again elsewhere."""
    from eagle3.data.images import image_digest
    from eagle3.image_prompts import image_prompt_rows

    rows = image_prompt_rows(tmp_path / "a")
    assert len(rows) == 12 and {c for _, c, _ in rows} == {"chart", "shapes", "text", "code"}
    for _, _, turn in rows:
        assert turn.content.startswith(IMAGE_MARK) and load_image(turn.images[0]).size == (448, 448)
    again = image_prompt_rows(tmp_path / "b")
    assert [image_digest(t.images[0]) for *_, t in rows] == [image_digest(t.images[0]) for *_, t in again]
    assert len({image_digest(t.images[0]) for *_, t in rows}) == 12


def test_vllm_gets_every_image_reference_as_a_file(tmp_path):
    """vLLM's child opens files (it cannot import eagle3): a `data:` URL reaches it as a file of the same bytes, a
    path as itself, and a text prompt as no image."""
    import base64

    from eagle3.data.images import as_files, image_bytes

    png = image_file(tmp_path / "a.png", 56)
    url = "data:image/png;base64," + base64.b64encode(image_file(tmp_path / "b.png", 56, seed=1).read_bytes()).decode()
    files = as_files([[str(png), url], [], [url]], tmp_path / "out")
    assert files[0][0] == str(png.resolve()) and files[1] == []
    for f in (files[0][1], files[2][0]):
        assert Path(f).is_file() and Path(f).read_bytes() == image_bytes(url)
    assert load_image(files[0][1]).size == (56, 56)
