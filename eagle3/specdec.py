"""Real EAGLE-3 speculative decoding with an HF target and an eagle3 draft head, on CPU or GPU.

The evaluator measures what an engine would measure, so the loop does what engines do:

1. **Prefill**: the target reads the prompt `x_0..x_{n-1}` (KV cache: `transformers.DynamicCache`), returns the
   logits and, through forward pre-hooks on the decoder layers at the aux ids, the low/mid/high residual streams
   `f_i` of every new token. The first new token (the *root* of the first round) comes from the last logits.
2. **Draft extend**: the draft reads the pairs `(fc(f_i), x_{i+1})` at position `i` (EAGLE-3's alignment: the
   feature of token i with the embedding of token i+1 predicts token i+2). Only target features of *accepted*
   tokens ever enter the draft's KV cache, as in SGLang/vLLM.
3. **Draft**: chain (topk 1) or tree (EAGLE-2/SGLang): from the root, expand `topk` children per frontier node for
   `num_steps` steps, feeding the draft's own output hidden back; keep the `topk` best frontier nodes by cumulative
   log-probability at each step; finally keep the `num_draft_tokens - 1` best nodes of all candidates plus the
   root. The draft's tree steps use a bool attention mask over (its real KV + ancestors' speculative KV).
4. **Verify**: ONE target forward over `[root, nodes...]` with per-node position ids (`m + depth`) and a 4D
   additive mask (each node sees the cached prefix, its ancestors and itself). Greedy: walk down from the root
   while a child equals the target's argmax. Temperature > 0: lossless rejection sampling (below).
5. **Commit**: the target KV cache is re-gathered to the accepted path (the accepted nodes' KV rows are selected
   with `index_select` from the verification forward, no recomputation); the draft KV cache is cropped back to
   its real part and extended with the accepted tokens' target features. The bonus token is the next root.

Sampling (temperature T > 0) is lossless, i.e. the output is distributed exactly as the target's own sampling:
- draft_sampling `greedy` (the default; chains and trees alike): children are the draft's deterministic top-k,
  i.e. point-mass proposals; siblings are tried in order, child c accepted with probability p_res(c), and on
  rejection c's mass is removed from the residual (recursive rejection sampling with one-hot proposals: SGLang's
  `tree_speculative_sampling_target_only`, vLLM's default `draft_sample_method=greedy`);
- draft_sampling `probabilistic`, chain (topk 1) only: draft tokens are *sampled* from the draft's distribution q
  (at temperature T, mapped from the draft vocab into the target vocab); a token x is accepted with probability
  min(1, p(x)/q(x)), and on rejection the bonus is drawn from norm(max(p - q, 0)) (speculative sampling,
  Leviathan et al. 2023 / Chen et al. 2023; vLLM's `draft_sample_method=probabilistic`).
Both are the same rule `accept w.p. min(1, p/q), residual norm(max(p - q, 0))`, with q one-hot in the greedy case.
Their τ differ (a greedy draft is accepted with probability p(argmax q)), so τ at T > 0 is compared between engines
at the same draft_sampling (tests/test_vllm_engine.py).

Counting (engines' definitions): one *verify step* yields `accepted + 1` tokens (the bonus counts);
τ = mean over steps of (accepted + 1). Acceptance rate at draft position j = share of steps whose accepted
length is >= j. The first token (from prefill) is not a speculative step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from eagle3.engines.hybrid_rule import ngram_match
from eagle3.targets.decoding import HFTargetDecoder, keep_cache_positions

if TYPE_CHECKING:
    from eagle3.config import ImageInputs
    from eagle3.model import KVCache


# ---------------------------------------------------------------------------------------------------- draft API
class DraftHead(Protocol):
    """What the decoder needs from a draft (eagle3.model.Eagle3Draft provides exactly this)."""

    def project(self, aux: torch.Tensor) -> torch.Tensor: ...

    def decode(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        past_kv: KVCache | None,
        attn_mask: torch.Tensor | None = None,
        extra: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, KVCache]: ...

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor: ...


@dataclass
class SpecSettings:
    """Drafting shape and sampling; mirrors `eval.*` (and SGLang's --speculative-* flags)."""

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    temperature: float = 0.0
    max_new_tokens: int = 128
    draft_sampling: str = "greedy"

    def __post_init__(self) -> None:
        if self.draft_sampling not in ("greedy", "probabilistic"):
            raise ValueError(f"draft_sampling must be greedy or probabilistic, got {self.draft_sampling!r}")
        if self.num_steps < 1 or self.topk < 1 or self.num_draft_tokens < 2:
            raise ValueError(f"need num_steps >= 1, topk >= 1, num_draft_tokens >= 2, got {self}")
        if self.num_draft_tokens > 1 + self.topk * self.num_steps:
            raise ValueError(
                f"num_draft_tokens={self.num_draft_tokens} exceeds 1 + topk * num_steps = "
                f"{1 + self.topk * self.num_steps}: the tree cannot hold that many tokens"
            )


# -------------------------------------------------------------------------------------------------- results
@dataclass
class Generation:
    """One prompt's output and the counters engines report."""

    tokens: list[int]
    seconds: float
    accept_lengths: list[int] = field(default_factory=list)
    """Per verify step: accepted draft tokens + 1 (the bonus), engines' definition."""
    target_forwards: int = 0
    positions: list[int] = field(default_factory=list)
    """Per verify step: the position of its root, i.e. the context length it drafts after (the card's context
    buckets: a head trained on short samples drafts worse deep into a long context)."""

    @property
    def num_steps(self) -> int:
        return len(self.accept_lengths)


@dataclass
class AcceptanceStats:
    """Aggregate of many generations: τ, per-position acceptance, tokens per target forward."""

    steps: int = 0
    accepted_tokens: int = 0
    """Sum over verify steps of accepted draft tokens (bonus excluded)."""
    accepted_per_pos: list[int] = field(default_factory=list)
    generated: int = 0
    target_forwards: int = 0
    seconds: float = 0.0

    def add(self, accept_lengths: Iterable[int], generated: int = 0, target_forwards: int = 0,
            seconds: float = 0.0) -> None:
        for length in accept_lengths:
            if length < 1:
                raise ValueError(f"an accept length counts the bonus token, so it is >= 1, got {length}")
            acc = length - 1
            self.steps += 1
            self.accepted_tokens += acc
            if len(self.accepted_per_pos) < acc:
                self.accepted_per_pos.extend([0] * (acc - len(self.accepted_per_pos)))
            for j in range(acc):
                self.accepted_per_pos[j] += 1
        self.generated += generated
        self.target_forwards += target_forwards
        self.seconds += seconds

    @property
    def tau(self) -> float:
        """Mean acceptance length: (accepted + bonus) per verify step (SGLang spec_accept_length, vLLM's)."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else float("nan")

    def acceptance_rate(self, num_positions: int) -> list[float]:
        """Share of verify steps that accepted at least j+1 draft tokens, for j < num_positions."""
        counts = self.accepted_per_pos + [0] * max(0, num_positions - len(self.accepted_per_pos))
        return [c / self.steps if self.steps else float("nan") for c in counts[:num_positions]]

    @property
    def tokens_per_forward(self) -> float:
        return self.generated / self.target_forwards if self.target_forwards else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds if self.seconds else float("nan")


def ngram_proposal(tokens: list[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """vLLM's prompt-lookup rule (v1/spec_decode/ngram_proposer.py): the longest n-gram, min_n <= n <= max_n,
    ending the context that also occurs earlier in it (the earliest such occurrence where several do), and up to
    k tokens that followed it; [] where none matches."""
    return ngram_match(tokens, k, min_n, max_n)[1]


# ---------------------------------------------------------------------------------------------------- target
def probs_at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sampling distribution at `temperature`, on the CPU (where the seeded generator and the coin flips live)."""
    return torch.softmax(logits.detach().float().cpu() / temperature, dim=-1)


def sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator).item())


def accept_among(p: torch.Tensor, candidates: list[int], proposals: list[torch.Tensor | None],
                 generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """Lossless rejection over sibling candidates: return (index of the accepted one or -1, residual p).

    proposals[i] is the distribution candidate i was drawn from (None = a deterministic pick, i.e. one-hot).
    Rule (Leviathan/Chen; recursive over siblings as SpecInfer/EAGLE): accept x w.p. min(1, p(x)/q(x)); else
    p <- norm(max(p - q, 0)). When every candidate is rejected the caller samples from the returned residual.
    """
    p = p.clone()
    for i, (x, q) in enumerate(zip(candidates, proposals, strict=True)):
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        if q is None:
            if u < float(p[x]):
                return i, p
            residual = p.clone()
            residual[x] = 0.0
        else:
            qx = float(q[x])
            if qx <= 0 or u < min(1.0, float(p[x]) / qx):
                return i, p
            residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        if total <= 0:  # p was (numerically) q itself: nothing left to reject into; keep p
            continue
        p = residual / total
    return -1, p


# ------------------------------------------------------------------------------------------------------ tree
@dataclass
class DraftTree:
    """Nodes of one round; node 0 is the root (the last committed token, not yet seen by the target)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    proposals: list[torch.Tensor | None]
    """Per node: the target-vocab distribution it was sampled from (chain sampling), None = deterministic."""

    def children(self, node: int) -> list[int]:
        return [i for i, par in enumerate(self.parents) if par == node]

    def ancestor_mask(self) -> torch.Tensor:
        """bool [N, N]: node i may attend to node j iff j is i or an ancestor of i."""
        n = len(self.tokens)
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                m[i, j] = True
                j = self.parents[j]
        return m


@dataclass
class _Candidates:
    """A round's draft candidates in creation order (parents before children); parent -1 is the root."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    """Cumulative draft log-prob from the root."""
    proposals: list[torch.Tensor | None] = field(default_factory=list)
    kv_row: dict[int, int] = field(default_factory=dict)
    """Candidate -> its row in the draft's KV cache, once fed."""

    def add(self, token: int, parent: int, depth: int, score: float, proposal: torch.Tensor | None) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(depth)
        self.scores.append(score)
        self.proposals.append(proposal)
        return len(self.tokens) - 1

    def feed(self, frontier: list[int], rows: int, real: int) -> torch.Tensor:
        """bool [1, k, rows + k]: the frontier's attention over the committed context (the first `real` rows), its
        fed ancestors and itself, appended as KV rows rows..rows+k-1 (recorded)."""
        k = len(frontier)
        mask = torch.zeros(1, k, rows + k, dtype=torch.bool)
        mask[0, :, :real] = True
        for r, node in enumerate(frontier):
            mask[0, r, rows + r] = True
            a = self.parents[node]
            while a >= 0:
                mask[0, r, self.kv_row[a]] = True
                a = self.parents[a]
            self.kv_row[node] = rows + r
        return mask

    def kept(self, root: int, n: int) -> DraftTree:
        """The best n candidates under the root. A stable sort on the score ranks every parent before its
        children (a child's log-prob score is <= its parent's and its index is larger), so the tree stays closed."""
        order = torch.sort(torch.tensor(self.scores), descending=True, stable=True).indices[:n]
        kept = sorted(order.tolist())
        remap = {-1: 0} | {c: i + 1 for i, c in enumerate(kept)}
        tree = DraftTree([root], [-1], [0], [None])
        for c in kept:
            tree.tokens.append(self.tokens[c])
            tree.parents.append(remap[self.parents[c]])
            tree.depths.append(self.depths[c])
            tree.proposals.append(self.proposals[c])
        return tree


class SpeculativeDecoder:
    """EAGLE-3 decoding with an HF target (`HFTargetDecoder`) and a draft head; see the module docstring."""

    def __init__(self, target: HFTargetDecoder, draft: DraftHead, settings: SpecSettings,
                 eos_token_ids: Iterable[int] = (), image_inputs: ImageInputs = "placeholder"):
        """`image_inputs`: what the draft reads at a prompt's image tokens, as the engine it serves in feeds it
        (eagle3.config.DraftConfig.image_inputs): `placeholder` (vLLM) the image token's own embedding,
        `target-embeddings` (SGLang) the target's merged input embedding there. The engine's positions come with it:
        vLLM 0.32 gives the draft the temporal row of an M-RoPE target's positions (`llm_base_proposer.py`
        `_set_positions`: after a Qwen2.5-VL picture, smaller than the token's index), SGLang the token index."""
        self.target, self.draft, self.s = target, draft, settings
        self.image_inputs = image_inputs
        self._shift = 0
        """What the current generation adds to a draft position past the prompt (`_positions`)."""
        self.eos = set(int(e) for e in eos_token_ids)
        self.draft_dtype = next(iter(draft.parameters())).dtype if isinstance(draft, nn.Module) else target.dtype
        self.device = target.device

    # ----------------------------------------------------------------------------------------- baseline
    @torch.inference_mode()
    def generate_baseline(self, prompt: list[int], generator: torch.Generator | None = None,
                          images: Sequence[str] = ()) -> Generation:
        """Plain decoding with the target's KV cache, one token per forward (the no-speculation reference).
        `images`: the prompt's, in the order of its image tokens (every generate method takes them)."""
        t0 = time.perf_counter()
        cache = self.target.new_cache()
        ids = torch.tensor(prompt, dtype=torch.long)
        logits, _ = self.target.forward(ids, torch.arange(len(prompt)), cache, aux=False, images=list(images))
        out: list[int] = []
        forwards = 1
        while True:
            tok = self._pick(logits[-1], generator)
            out.append(tok)
            if tok in self.eos or len(out) >= self.s.max_new_tokens:
                break
            pos = len(prompt) + len(out) - 1
            logits, _ = self.target.forward(torch.tensor([tok]), torch.tensor([pos]), cache, aux=False)
            forwards += 1
        return Generation(out, time.perf_counter() - t0, target_forwards=forwards)

    @torch.inference_mode()
    def generate_ngram(self, prompt: list[int], generator: torch.Generator | None = None, min_n: int = 2,
                       max_n: int = 4, images: Sequence[str] = ()) -> Generation:
        """Prompt-lookup (n-gram) drafting with the same target, verification and counting: the method that
        needs no training, measured beside the head on the same turns. Each round drafts up to `num_steps`
        tokens by `ngram_proposal`; a round that finds no match decodes its root alone, which costs a target
        forward but is no verify step (vLLM counts only steps that drafted: its τ looks better than the tokens per
        target forward, which count every forward)."""
        t0 = time.perf_counter()
        n = len(prompt)
        cache = self.target.new_cache()
        logits, _ = self.target.forward(torch.tensor(prompt, dtype=torch.long), torch.arange(n), cache, aux=False,
                                        images=list(images))
        out = [self._pick(logits[-1], generator)]
        gen = Generation(out, 0.0, target_forwards=1)
        m = n
        while out[-1] not in self.eos and len(out) < self.s.max_new_tokens:
            draft = ngram_proposal(prompt + out, self.s.num_steps, min_n, max_n)
            tree = DraftTree([out[-1], *draft], list(range(-1, len(draft))), list(range(len(draft) + 1)),
                             [None] * (len(draft) + 1))
            vlogits, _ = self.target.forward(torch.tensor(tree.tokens), m + torch.tensor(tree.depths), cache,
                                             tree_mask=tree.ancestor_mask(), aux=False)
            gen.target_forwards += 1
            path, bonus = self._verify(tree, vlogits, generator)
            if draft:
                gen.accept_lengths.append(len(path) + 1)
                gen.positions.append(m)
            keep_cache_positions(cache, torch.cat([torch.arange(m), m + torch.tensor([0] + path)]))
            new_tokens = [tree.tokens[i] for i in path] + [bonus]
            m += len(new_tokens)
            for tok in new_tokens:
                out.append(tok)
                if tok in self.eos or len(out) >= self.s.max_new_tokens:
                    break
        gen.seconds = time.perf_counter() - t0
        return gen

    @torch.inference_mode()
    def top2(self, prompt: list[int], tokens: list[int], images: Sequence[str] = ()) -> tuple[float, float]:
        """The target's two largest next-token logits after `prompt` + `tokens`, from one fresh forward: what the
        plain path chose between where a speculative output first parts from it (eagle3.evaluate.Divergence)."""
        ids = prompt + tokens
        logits, _ = self.target.forward(torch.tensor(ids, dtype=torch.long), torch.arange(len(ids)),
                                        self.target.new_cache(), aux=False, images=list(images))
        top = torch.topk(logits[-1].float(), 2).values
        return float(top[0]), float(top[1])

    def _pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        if self.s.temperature <= 0:
            return int(torch.argmax(logits).item())
        return sample(probs_at(logits, self.s.temperature), generator)

    # -------------------------------------------------------------------------------------- speculative
    @torch.inference_mode()
    def generate(self, prompt: list[int], generator: torch.Generator | None = None,
                 images: Sequence[str] = ()) -> Generation:
        t0 = time.perf_counter()
        n = len(prompt)
        cache = self.target.new_cache()
        logits, aux = self.target.forward(torch.tensor(prompt, dtype=torch.long), torch.arange(n), cache,
                                          images=list(images))
        root = self._pick(logits[-1], generator)
        out = [root]
        gen = Generation(out, 0.0, target_forwards=1)
        # The draft reads (f_i, x_{i+1}) at position i: features of the prompt with the prompt shifted by one.
        fed, extra = self._prompt_inputs(prompt, root, bool(images))
        over_prompt = self._positions(bool(images))
        kv, h_last, logits_last = self._extend(None, aux, fed, start=0, extra=extra, positions=over_prompt)
        m = n  # target position of the root; the target cache holds 0..m-1, the draft's real KV as well
        while root not in self.eos and len(out) < self.s.max_new_tokens:
            tree, kv = self._draft_tree(kv, m, h_last, logits_last, root, generator)
            mask = tree.ancestor_mask()
            positions = m + torch.tensor(tree.depths)
            vlogits, vaux = self.target.forward(torch.tensor(tree.tokens), positions, cache, tree_mask=mask)
            gen.target_forwards += 1
            path, bonus = self._verify(tree, vlogits, generator)
            gen.accept_lengths.append(len(path) + 1)  # accepted draft tokens + the bonus
            gen.positions.append(m)
            # Commit: target KV keeps the prefix and the root + accepted nodes; the draft re-reads their features.
            keep = torch.cat([torch.arange(m), m + torch.tensor([0] + path)])
            keep_cache_positions(cache, keep)
            new_tokens = [tree.tokens[i] for i in path] + [bonus]
            kv = tuple((k[:, :, :m], v[:, :, :m]) for k, v in kv)
            kv, h_last, logits_last = self._extend(kv, vaux[[0] + path], new_tokens, start=m)
            m += len(new_tokens)
            for tok in new_tokens:
                out.append(tok)
                if tok in self.eos or len(out) >= self.s.max_new_tokens:
                    break
            root = out[-1]
        gen.seconds = time.perf_counter() - t0
        return gen

    def _positions(self, images: bool) -> torch.Tensor | None:
        """The draft's positions over a prompt just prefilled, as the head's engine gives them: None for the token
        index; with `placeholder` (vLLM) and an M-RoPE target's picture, the temporal row of the target's positions,
        and the target's offset added to every later one (`_shift`)."""
        prompt = getattr(self.target, "prompt_positions", None)
        if not images or self.image_inputs != "placeholder" or prompt is None:
            self._shift = 0
            return None
        self._shift = int(self.target.offset)
        return prompt

    def _prompt_inputs(self, prompt: list[int], root: int, images: bool) -> tuple[list[int], torch.Tensor | None]:
        """The ids the draft reads over the prompt (shifted by one, the root last), and the embeddings of those past
        its vocab: with `target-embeddings`, the prompt's k-th image token becomes `vocab + k` and embeds as the
        target's merged input there (eagle3.model.Eagle3Draft.embed), as SGLang feeds its draft at a prefill;
        with `placeholder`, the ids as they are (vLLM)."""
        fed = prompt[1:] + [root]
        if not images or self.image_inputs != "target-embeddings":
            return fed, None
        token_id = self.target.vision.image_token_id  # type: ignore[union-attr]
        vocab = self.draft.embed_tokens.weight.shape[0]  # type: ignore[attr-defined]
        k = int(prompt[0] == token_id)
        for i, t in enumerate(prompt[1:]):
            if t == token_id:
                fed[i] = vocab + k
                k += 1
        return fed, self.target.image_embeds

    def _extend(self, kv: KVCache | None, aux: torch.Tensor, tokens: list[int], start: int,
                extra: torch.Tensor | None = None, positions: torch.Tensor | None = None
                ) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
        """Feed target features of accepted tokens into the draft at `positions` (default: their indices from
        `start`, shifted as `_positions` says); return its KV and the last hidden/logits."""
        s = len(tokens)
        feats = self.draft.project(aux.to(self.draft_dtype)[None])
        if positions is None:
            positions = torch.arange(start, start + s) + self._shift
        pos = positions.to(self.device)[None]
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[None]
        hidden, logits, kv = self.draft.decode(ids, feats, pos, kv, None, extra=extra)
        return kv, hidden[0, -1], logits[0, -1].float()

    def _draft_tree(self, kv: KVCache, m: int, h_root: torch.Tensor,
                    logits_root: torch.Tensor, root: int, generator: torch.Generator | None
                    ) -> tuple[DraftTree, KVCache]:
        """Expand the draft tree from the root (see module docstring); return the kept tree and the draft KV."""
        s = self.s
        sampled_chain = s.topk == 1 and s.temperature > 0 and s.draft_sampling == "probabilistic"
        real = kv[0][0].shape[2]
        c = _Candidates()
        frontier = self._expand(c, logits_root, -1, 1, sampled_chain, generator)
        parent_hidden = {-1: h_root}
        for step in range(1, s.num_steps):
            mask = c.feed(frontier, kv[0][0].shape[2], real).to(self.device)
            ids = torch.tensor([c.tokens[f] for f in frontier], device=self.device)[None]
            hid = torch.stack([parent_hidden[c.parents[f]] for f in frontier])[None]
            pos = torch.full((1, len(frontier)), m - 1 + step + self._shift, device=self.device)
            out_h, out_logits, kv = self.draft.decode(ids, hid, pos, kv, mask)
            children: list[int] = []
            for r, node in enumerate(frontier):
                parent_hidden[node] = out_h[0, r]
                children += self._expand(c, out_logits[0, r].float(), node, step + 1, sampled_chain, generator)
            if sampled_chain:
                frontier = children
            else:
                sc = torch.tensor([c.scores[ch] for ch in children])
                order = torch.sort(sc, descending=True, stable=True).indices[: s.topk]
                frontier = [children[i] for i in order.tolist()]
        return c.kept(root, s.num_draft_tokens - 1), kv

    def _expand(self, c: _Candidates, logits: torch.Tensor, parent: int, depth: int, sampled_chain: bool,
                generator: torch.Generator | None) -> list[int]:
        """Add a node's children to the candidates (its topk, or one sample in a sampled chain); their indices."""
        base = c.scores[parent] if parent >= 0 else 0.0
        if sampled_chain:
            q = probs_at(logits, self.s.temperature)
            d = torch.multinomial(q, 1, generator=generator)
            picks = [(int(d.item()), float(torch.log(q[d]).item()), self._to_target_dist(q))]
        else:
            val, idx = torch.topk(torch.log_softmax(logits, dim=-1), self.s.topk)
            picks = [(int(i), float(v), None) for v, i in zip(val.tolist(), idx.tolist(), strict=True)]
        to_target = self.draft.draft_to_target
        return [c.add(int(to_target(torch.tensor([d], device=self.device)).item()), parent, depth, base + lp, prop)
                for d, lp, prop in picks]

    def _to_target_dist(self, q_draft: torch.Tensor) -> torch.Tensor:
        """A draft-vocab distribution as a target-vocab one (zero outside the draft vocab)."""
        ids = self.draft.draft_to_target(torch.arange(q_draft.shape[-1], device=self.device)).cpu()
        v = self.target.model.config.get_text_config().vocab_size
        q = torch.zeros(v, dtype=torch.float32)
        q[ids] = q_draft.float().cpu()
        return q

    def _verify(self, tree: DraftTree, logits: torch.Tensor, generator: torch.Generator | None
                ) -> tuple[list[int], int]:
        """Walk the tree with the target's logits; return (accepted node indices in path order, bonus token)."""
        node, path = 0, []
        while True:
            kids = tree.children(node)
            if self.s.temperature <= 0:
                want = int(torch.argmax(logits[node]).item())
                nxt = next((c for c in kids if tree.tokens[c] == want), None)
                if nxt is None:
                    return path, want
                node = nxt
            else:
                p = probs_at(logits[node], self.s.temperature)
                i, residual = accept_among(p, [tree.tokens[c] for c in kids], [tree.proposals[c] for c in kids],
                                           generator)
                if i < 0:
                    return path, sample(residual, generator)
                node = kids[i]
            path.append(node)
