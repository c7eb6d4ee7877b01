"""Auxiliary layer ids: eagle3's one convention, and each engine's spelling of it.

Engines disagree on what layer id `k` means, and a head served under the wrong meaning silently loses most of
its acceptance. eagle3 uses exactly one meaning everywhere inside (config, cache, checkpoint):

    id k = the residual stream *entering* decoder layer k (0-based)
         = the output of decoder layer k-1
         = HF transformers `output_hidden_states[k]`
         = vLLM's `eagle_aux_hidden_state_layer_ids` value k (used as-is).

Only the export translates into an engine's spelling (`to_engine_ids`), and every cache and checkpoint stores
`LAYER_ID_CONVENTION` next to the ids so that a file written under another meaning is refused, not misread.
"""

from __future__ import annotations

from typing import Literal

LAYER_ID_CONVENTION = "input-of-layer"

Engine = Literal["vllm", "sglang"]
ArchFamily = Literal["llama", "deepseek"]


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high default, `[2, L//2, L-3]` (Kimi-K2.5, 61 layers: [2, 30, 58])."""
    if num_layers < 7:
        # Tiny test models: keep three distinct, increasing, valid ids.
        if num_layers < 3:
            raise ValueError(f"a target needs at least 3 decoder layers for low/mid/high features, got {num_layers}")
        return [0, num_layers // 2, num_layers - 1] if num_layers < 4 else [1, num_layers // 2, num_layers - 1]
    return [2, num_layers // 2, num_layers - 3]


def validate_layer_ids(ids: list[int], num_layers: int, where: str = "target.aux_layer_ids") -> None:
    """Raise ValueError naming `where` unless ids are three increasing inputs of existing decoder layers."""
    if len(ids) != 3 or any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"{where}: expected three strictly increasing ids (low, mid, high), got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"{where}: id(s) {bad} outside the target's depth; the target has {num_layers} decoder layers, so "
            f"allowed ids are 0..{num_layers - 1} (id k = input of decoder layer k, eagle3's convention); "
            f"default for this target: {default_layer_ids(num_layers)}"
        )


SGLANG_DEEPSEEK_STYLE = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
    "Glm4MoeLiteForCausalLM",
})
"""Targets whose SGLang 0.5.23 model adds 1 to the ids only when the first is 1 (models/deepseek_v2.py and
glm4_moe_lite.py; Kimi-K2.5's wrapper delegates to DeepSeek-V3): eagle3's "deepseek" family."""
SGLANG_PLUS_ONE = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM", "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
    "Gemma3ForCausalLM", "Gemma4ForCausalLM", "GptOssForCausalLM", "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM",
    "ApertusForCausalLM", "BailingMoeForCausalLM", "BailingMoeV2ForCausalLM", "ExaoneMoeForCausalLM",
    "LongcatFlashForCausalLM",
})
"""Targets whose SGLang 0.5.23 model adds 1 to every id (models/llama.py, qwen*.py, gemma*.py, gpt_oss.py,
glm4_moe.py, ...: "we plus 1 here because ... it takes the output of the (i-1)th layer"): the "llama" family."""


def arch_family(architectures: list[str] | None, model_type: str | None = None) -> ArchFamily:
    """Which of SGLang's two layer-id spellings a target has (SGLANG_DEEPSEEK_STYLE, SGLANG_PLUS_ONE); a target in
    neither table falls back to its name (DeepSeek / Kimi: deepseek; anything else: llama; `known_family` says
    whether it was looked up or guessed)."""
    names = set(architectures or [])
    if names & SGLANG_DEEPSEEK_STYLE:
        return "deepseek"
    if names & SGLANG_PLUS_ONE:
        return "llama"
    low = (" ".join(names) + " " + (model_type or "")).lower()
    return "deepseek" if ("deepseek" in low or "kimi" in low) else "llama"


def known_family(architectures: list[str] | None) -> bool:
    """Whether SGLang's id spelling for these architectures is known (read in SGLang 0.5.23), not guessed."""
    return bool(set(architectures or []) & (SGLANG_DEEPSEEK_STYLE | SGLANG_PLUS_ONE))


def sglang_family(architectures: list[str] | None, model_type: str | None, override: ArchFamily | None) -> ArchFamily:
    """The family whose SGLang spelling a head for this target is written in: the table's, or `override`
    (`target.layer_id_family`, `eagle3 export --target-family`) for an architecture outside it.

    An architecture outside the table is refused without an override rather than guessed: a wrong guess serves
    the head on the layers next to the trained ones, which nothing reports but a collapsed acceptance."""
    if override is not None:
        return override
    if known_family(architectures):
        return arch_family(architectures, model_type)
    raise ValueError(
        f"target architectures {architectures} are not in eagle3's table of SGLang's layer-id spellings "
        "(eagle3/layer_ids.py, read in SGLang 0.5.23), and a wrong guess serves the head on the wrong layers "
        "with no error. Read the model's file in sglang/srt/models: if it adds 1 to every id of "
        "eagle_aux_hidden_state_layer_ids (Llama, Qwen, Mistral do), set target.layer_id_family: llama; if it "
        "takes them as-is (DeepSeek-V3, Kimi), deepseek (`eagle3 export --target-family ...` for an export)")


def to_engine_ids(ids: list[int], engine: Engine, family: ArchFamily) -> list[int]:
    """Translate eagle3 ids to the spelling `engine` expects in the draft's config for a `family` target.

    vLLM uses ids as-is. SGLang adds 1 to every explicit id for Llama/Qwen targets, so we write k-1. For
    DeepSeek/Kimi, 0.5.23 adds 1 only when the first id is 1 and takes other lists as-is, while earlier releases
    added 1 to every id: a list starting at 1 means the same layers to both, so ids starting at 2 (Kimi's default
    [2, 30, 58]) are written k-1 ([1, 29, 57]); other ids only have 0.5.23's spelling (as-is).
    """
    if engine == "vllm":
        return list(ids)
    if family == "llama" or ids[0] == 2:
        if ids[0] < 1:
            raise ValueError(f"SGLang cannot express layer id {ids[0]} for a Llama-family target (it would write -1)")
        return [i - 1 for i in ids]
    if ids[0] == 1:
        raise ValueError(
            "SGLang's DeepSeek/Kimi models shift ids whose first value is 1, so eagle3 id 1 (input of layer 1) "
            "cannot be spelled for them; choose a first id other than 1"
        )
    return list(ids)


def from_engine_ids(ids: list[int], engine: Engine, family: ArchFamily) -> list[int]:
    """Inverse of `to_engine_ids`: read an engine's spelling back into eagle3's convention."""
    if engine == "vllm":
        return list(ids)
    if family == "llama":
        return [i + 1 for i in ids]
    return [i + 1 for i in ids] if ids[0] == 1 else list(ids)
