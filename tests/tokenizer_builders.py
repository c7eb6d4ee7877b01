"""Small test tokenizers saved as real folders, for tests of every stage.

    from tokenizer_builders import kimi_test_tokenizer, llama_test_tokenizer   # tests/ is on sys.path under pytest
    tok = kimi_test_tokenizer(tmp_path / "kimi-tok")        # Kimi-K2.5's special ids, vocab 163840
    tok = llama_test_tokenizer(tmp_path / "tok", vocab_size=512)   # ChatML, fits a tiny model's vocab

Both are byte-level BPE tokenizers WITHOUT merges: token id b is the byte b (0..255), so expected ids in
golden tests can be read straight off the UTF-8 bytes (`list("Hi".encode())` == [72, 105]). Special tokens are
added tokens at fixed ids; the gap up to the vocab size is filled with unreachable `[unused{i}]` entries
(cheaper than thousands of added tokens). Saved with save_pretrained, so `AutoTokenizer.from_pretrained(path)`
loads them like a real target's tokenizer.

Not named tests/tokenizers.py on purpose: pytest puts tests/ first on sys.path, and a tests/tokenizers.py
shadows the HF `tokenizers` package for every test (transformers imports it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from eagle3.data.templates import CHATML, KIMI_K25

KIMI_VOCAB = 163840
KIMI_SPECIALS: dict[str, int] = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "<think>": 163606,
    "</think>": 163607,
    "[PAD]": 163839,
}
LLAMA_SPECIALS: dict[str, int] = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of the ByteLevel pre-tokenizer)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_level(path: Path, vocab_size: int, specials: dict[str, int], template: str, bos: str | None,
                eos: str, pad: str) -> Any:
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    taken = set(specials.values())
    if max(taken) >= vocab_size or len(vocab) + len(specials) > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} cannot hold 256 bytes and specials at {sorted(taken)}")
    for content, i in specials.items():
        vocab[content] = i
    for i in range(256, vocab_size):
        if i not in taken:
            vocab[f"[unused{i}]"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Already in the vocab, so they keep their ids; marking them special makes them match as whole tokens.
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad)
    fast.chat_template = template
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    loaded = AutoTokenizer.from_pretrained(str(path))
    for content, i in specials.items():
        assert loaded.convert_tokens_to_ids(content) == i, (content, i)
    assert len(loaded) == vocab_size, (len(loaded), vocab_size)
    return loaded


def kimi_test_tokenizer(path: Path) -> Any:
    """A fast tokenizer with Kimi-K2.5's exact special strings and ids (vocab 163840) and the kimi-k2.5 template."""
    return _byte_level(Path(path), KIMI_VOCAB, KIMI_SPECIALS, KIMI_K25, bos="[BOS]", eos="[EOS]", pad="[PAD]")


def llama_test_tokenizer(path: Path, vocab_size: int = 512) -> Any:
    """A small ChatML tokenizer (`<|im_start|>` 257, `<|im_end|>` 258 = eos, `<|endoftext|>` 256 = pad)."""
    return _byte_level(Path(path), vocab_size, LLAMA_SPECIALS, CHATML, bos=None, eos="<|im_end|>",
                       pad="<|endoftext|>")
