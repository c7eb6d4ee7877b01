"""Chat templates: golden Kimi-K2.5 and SmolLM2 token ids + loss masks, every built-in, prefix-stability errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizer_builders import KIMI_SPECIALS, kimi_test_tokenizer, llama_test_tokenizer

from eagle3.data.templates import (
    BUILTIN,
    TemplateError,
    answer_spans,
    render,
    render_prompt,
    tokenize_with_mask,
)
from eagle3.data.types import Conversation, Turn

S = KIMI_SPECIALS


def b(text: str) -> list[int]:
    """Ids of plain text in the byte-level test tokenizers: the UTF-8 bytes."""
    return list(text.encode())


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    return kimi_test_tokenizer(tmp_path_factory.mktemp("kimi-tok"))


@pytest.fixture(scope="module")
def chatml_tok(tmp_path_factory):
    return llama_test_tokenizer(tmp_path_factory.mktemp("llama-tok"), vocab_size=512)


@pytest.fixture(scope="module")
def smol_tok():
    from transformers import AutoTokenizer

    from eagle3.bundled import materialise_smollm2

    return AutoTokenizer.from_pretrained(materialise_smollm2())


CONV = Conversation("c1", [
    Turn("user", "Hi"),
    Turn("assistant", "Yo", reasoning="hm"),
    Turn("user", "Ok?"),
    Turn("assistant", "Yes", reasoning="sure"),
])


def _masked(ids: list[int], mask: list[int]) -> list[int]:
    return [i for i, m in zip(ids, mask, strict=True) if m]


# ---------------------------------------------------------------------------------------------------- Kimi
def test_kimi_test_tokenizer_has_k25_special_ids(kimi_tok):
    assert len(kimi_tok) == 163840
    assert kimi_tok.convert_tokens_to_ids("<|im_end|>") == 163586
    assert kimi_tok.convert_tokens_to_ids("<|im_middle|>") == 163601
    assert kimi_tok.convert_tokens_to_ids("<think>") == 163606
    assert kimi_tok.convert_tokens_to_ids("</think>") == 163607
    assert kimi_tok.eos_token_id == 163585 and kimi_tok.pad_token_id == 163839
    assert kimi_tok("<|im_user|>x<|im_assistant|>", add_special_tokens=False)["input_ids"] == [163587, 120, 163588]


def test_kimi_golden_thinking_on(kimi_tok):
    ids, mask = render(CONV, kimi_tok, "kimi-k2.5", thinking=True, system_prompt="Be")
    sys_ = [163594, *b("system"), 163601, *b("Be"), 163586]
    u1 = [163587, *b("user"), 163601, *b("Hi"), 163586]
    a1_head = [163588, *b("assistant"), 163601, 163606]               # generation prompt ends with <think>
    a1_body = [163607, *b("Yo"), 163586]                              # past turn: reasoning dropped
    u2 = [163587, *b("user"), 163601, *b("Ok?"), 163586]
    a2_head = [163588, *b("assistant"), 163601, 163606]
    a2_body = [*b("sure"), 163607, *b("Yes"), 163586]                 # last turn: {reasoning}</think>{answer}
    assert ids == sys_ + u1 + a1_head + a1_body + u2 + a2_head + a2_body
    assert mask == ([0] * len(sys_ + u1 + a1_head) + [1] * len(a1_body) + [0] * len(u2 + a2_head)
                    + [1] * len(a2_body))
    # the literal ids, pinned: the second answer is 's','u','r','e',</think>,'Y','e','s',<|im_end|>
    assert ids[-9:] == [115, 117, 114, 101, 163607, 89, 101, 115, 163586] and mask[-10:] == [0] + [1] * 9
    assert len(ids) == 67 and sum(mask) == 13


def test_kimi_golden_thinking_off(kimi_tok):
    ids, mask = render(CONV, kimi_tok, "kimi-k2.5", thinking=False, system_prompt="Be")
    head = [163588, *b("assistant"), 163601, 163606, 163607]          # prompt ends with <think></think>
    expected = ([163594, *b("system"), 163601, *b("Be"), 163586, 163587, *b("user"), 163601, *b("Hi"), 163586]
                + head + [*b("Yo"), 163586]
                + [163587, *b("user"), 163601, *b("Ok?"), 163586] + head + [*b("Yes"), 163586])
    assert ids == expected
    assert _masked(ids, mask) == [*b("Yo"), 163586, *b("Yes"), 163586]
    assert kimi_tok.decode(ids) == (
        "<|im_system|>system<|im_middle|>Be<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Yo<|im_end|><|im_user|>user<|im_middle|>Ok?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Yes<|im_end|>")


def test_kimi_generation_prompt(kimi_tok):
    on = render_prompt(CONV.turns[:3], kimi_tok, "kimi-k2.5", thinking=True)
    off = render_prompt(CONV.turns[:3], kimi_tok, "kimi-k2.5", thinking=False)
    assert on[-4:] == [*b("nt"), 163601, 163606]
    assert off[-3:] == [163601, 163606, 163607]
    # the prompt is exactly what precedes the answer in the rendered training sample
    ids, _ = render(CONV, kimi_tok, "kimi-k2.5", thinking=True)
    assert ids[: len(on)] == on
    assert render_prompt(CONV.turns[:1], kimi_tok, "kimi-k2.5", True, system_prompt="Be")[:2] == [163594, *b("s")]


def test_kimi_tokenizer_own_template_is_kimi(kimi_tok):
    assert render(CONV, kimi_tok, "auto", thinking=True) == render(CONV, kimi_tok, "kimi-k2.5", thinking=True)


# ------------------------------------------------------------------------------------------------- SmolLM2
def test_smollm2_golden(smol_tok):
    conv = Conversation("s", [Turn("user", "Hi!"), Turn("assistant", "Hello there."), Turn("user", "2+2?"),
                              Turn("assistant", "4")])
    ids, mask = render(conv, smol_tok, "auto", thinking=False)
    # <|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n ...
    assert ids == [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                   19712, 8182, 2, 198, 1, 4093, 198, 26843, 17, 2, 198, 1, 520, 9531, 198, 19556, 665, 30, 2, 198,
                   1, 4093, 198, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198, 36, 2, 198]
    assert mask == [0] * 32 + [1, 1, 1, 1] + [0] * 14 + [1, 1, 0]
    assert smol_tok.decode(_masked(ids, mask)) == "Hello there.<|im_end|>4<|im_end|>"
    # an explicit system prompt replaces SmolLM2's default one
    ids2, _ = render(conv, smol_tok, "auto", thinking=False, system_prompt="Be brief.")
    assert smol_tok.decode(ids2).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!")
    assert render_prompt(conv.turns[:3], smol_tok, "auto", False) == ids[:50]


def test_real_sharegpt_ids_equal_full_tokenization(smol_tok):
    from eagle3.config import SourceConfig
    from eagle3.data.sources import read_conversations

    convs = list(read_conversations(SourceConfig(path="bundled:sharegpt", max_records=40)))
    for conv in convs:
        text, spans = answer_spans(conv, smol_tok, "auto", thinking=False)
        ids, mask = render(conv, smol_tok, "auto", thinking=False)
        assert ids == smol_tok(text, add_special_tokens=False)["input_ids"], conv.id
        assert len(mask) == len(ids) and sum(mask) > 0
        # every masked stretch decodes to an assistant answer followed by <|im_end|>
        answers = [t.content for t in conv.turns if t.role == "assistant"]
        assert smol_tok.decode(_masked(ids, mask)).count("<|im_end|>") == len(answers) == len(spans)


# ---------------------------------------------------------------------------------------------- built-ins
EOT = {"kimi-k2.5": "<|im_end|>", "chatml": "<|im_end|>", "chatml-tools": "<|im_end|>", "llama3": "<|eot_id|>",
       "deepseek-v3": "<｜end▁of▁sentence｜>"}


@pytest.mark.parametrize("name", sorted(BUILTIN))
@pytest.mark.parametrize("thinking", [False, True])
def test_every_builtin_renders_and_masks_the_answers(name, thinking, chatml_tok):
    conv = Conversation("b", [Turn("system", "S."), *CONV.turns])
    text, spans = answer_spans(conv, chatml_tok, name, thinking)
    ids, mask = render(conv, chatml_tok, name, thinking)
    assert ids == chatml_tok(text, add_special_tokens=False)["input_ids"]
    answers = [text[s:e] for s, e in spans]
    if name == "kimi-k2.5" and thinking:
        assert answers == ["</think>Yo<|im_end|>", "sure</think>Yes<|im_end|>"]
    else:
        assert answers == [f"Yo{EOT[name]}", f"Yes{EOT[name]}"]
    assert chatml_tok.decode(_masked(ids, mask)) == "".join(answers)
    assert "S." in text and "Ok?" in text
    prompt = render_prompt(conv.turns[:4], chatml_tok, name, thinking)
    assert ids[: len(prompt)] == prompt and mask[len(prompt)] == 1 and mask[len(prompt) - 1] == 0


def test_jinja_file_template(tmp_path, chatml_tok):
    f = tmp_path / "t.jinja"
    f.write_text(BUILTIN["chatml"][0])
    assert render(CONV, chatml_tok, str(f), False) == render(CONV, chatml_tok, "chatml", False)


def test_unknown_template_and_missing_auto(tmp_path, chatml_tok):
    with pytest.raises(TemplateError, match="not a built-in template"):
        render(CONV, chatml_tok, "vicuna", False)
    chatml_tok_no = llama_test_tokenizer(tmp_path / "t")
    chatml_tok_no.chat_template = None
    with pytest.raises(TemplateError, match="has no chat template"):
        render(CONV, chatml_tok_no, "auto", False)


def test_not_prefix_stable_template_fails_clearly(tmp_path, chatml_tok):
    # Announces how many turns follow: every prefix render starts differently from the full render.
    f = tmp_path / "counting.jinja"
    f.write_text("[{{ messages|length }}]{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError) as e:
        render(CONV, chatml_tok, str(f), False)
    msg = str(e.value)
    assert "counting.jinja" in msg and "not prefix-stable at turn 1" in msg and "'c1'" in msg


def test_slow_tokenizer_path_matches_fast(chatml_tok):
    class NoOffsets:
        """A tokenizer without offsets (like Kimi's tiktoken one): segments are tokenized separately."""

        is_fast = False

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": chatml_tok(text, add_special_tokens=add_special_tokens)["input_ids"]}

    text, spans = answer_spans(CONV, chatml_tok, "chatml", False)
    assert tokenize_with_mask(NoOffsets(), text, spans) == tokenize_with_mask(chatml_tok, text, spans)


def test_llama_test_tokenizer_fits_small_vocab(tmp_path: Path):
    tok = llama_test_tokenizer(tmp_path / "t", vocab_size=300)
    assert len(tok) == 300 and tok.eos_token_id == 258
    ids, _ = render(CONV, tok, "auto", False)
    assert max(ids) < 300
