"""A pure-PyTorch stand-in for the `sgl_kernel` module that SGLang 0.5.23 imports on its CPU path.

Test support only (tests/sglang_cpu is put on PYTHONPATH for the SGLang server processes): the PyPI
`sglang-kernel` wheel is CUDA-only and SGLang's CPU build of it needs Intel AMX, so on a plain x86 CPU
`import sgl_kernel` fails and, with SGLANG_USE_CPU_ENGINE=1, so does SGLang (`ModuleNotFoundError: sgl_kernel`
from the module-level imports in sglang/srt/mem_cache/allocation.py, kernels/ops/kvcache/cache_move.py and
kernels/ops/speculative/{eagle,cache_locs,spec_tree}.py).

Each function here has the signature of the CPU op of the same name that those call sites use, and the
semantics of the Triton / CUDA kernel it stands in for (named in its docstring; paths are relative to the
installed `sglang` package). They are plain loops over tensors: correctness over speed. Inputs are checked the
way the real CPU ops check them (dtypes, shapes), so a caller bug fails loudly instead of corrupting a pool.

Every other public name resolves to a function that raises NotImplementedError naming itself when called, so
`from sgl_kernel import X` at import time works, but nothing silently does nothing at run time.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = [
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
]

__version__ = "0.0.0+eagle3-cpu-standin"
IS_EAGLE3_CPU_STANDIN = True

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check(cond: bool, fn: str, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"sgl_kernel stand-in {fn}: {msg}")


def _check_cpu(fn: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        _check(isinstance(t, torch.Tensor), fn, f"{name} must be a tensor, got {type(t).__name__}")
        _check(t.device.type == "cpu", fn, f"{name} must be a CPU tensor, got {t.device}")


def _ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


# ---------------------------------------------------------------------------------------------------------------
# KV-slot bookkeeping (plain decoding needs these two)
# ---------------------------------------------------------------------------------------------------------------


def _segments(fn: str, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor,
              end_offset: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int) -> tuple[list, list, list]:
    """The CPU ops' checks shared by the two req_to_token <-> out_cache_loc copies; (rows, starts, ends)."""
    _check_cpu(fn, req_pool_indices=req_pool_indices, req_to_token=req_to_token, start_offset=start_offset,
               end_offset=end_offset, out_cache_loc=out_cache_loc)
    _check(req_to_token.dim() == 2 and req_to_token.dtype == torch.int32, fn, "req_to_token must be 2-D int32")
    _check(out_cache_loc.dtype == torch.int64, fn, f"out_cache_loc must be int64, got {out_cache_loc.dtype}")
    _check(req_to_token.shape[1] == pool_len, fn, f"pool_len {pool_len} != req_to_token.shape[1]")
    rows, starts, ends = _ints(req_pool_indices), _ints(start_offset), _ints(end_offset)
    _check(len(starts) == len(rows) == len(ends), fn, "req_pool_indices/start_offset/end_offset lengths differ")
    total = sum(e - s for s, e in zip(starts, ends))
    _check(total <= out_cache_loc.numel(), fn,
           f"out_cache_loc has {out_cache_loc.numel()} entries but offsets require {total}")
    return rows, starts, ends


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = out_cache_loc[p_i : p_i + len_i], with
    p_i the exclusive prefix sum of the lengths (end - start).

    Mirrors the Triton kernel `assign_req_to_token_pool` (srt/mem_cache/allocation.py, called through
    `assign_req_to_token_pool_func`): program i copies its slice of out_cache_loc, at offset
    sum_{j<i}(end_j - start_j), into row req_pool_indices[i] from column start_offset[i] on.
    """
    fn = "assign_req_to_token_pool_cpu"
    rows, starts, ends = _segments(fn, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                   pool_len)
    pt = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[pt:pt + n].to(torch.int32)
        pt += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For every KV buffer b (base address data_ptrs[b], row size strides[b] bytes): copy row src_loc[j] onto
    row tgt_loc[j] for all j, reading every source row before writing any target (safe in place).

    Mirrors the Triton kernel `copy_all_layer_kv_cache_tiled` (kernels/ops/kvcache/cache_move.py, called through
    `copy_all_layer_kv_cache_func`, which passes tgt_loc/src_loc already cut to num_locs): one program per
    (buffer, byte tile) loads the tile of all source rows, then stores it to all target rows. data_ptrs/strides
    are built in srt/mem_cache/memory_pool.py (`data_ptrs`, `data_strides` = stride(0) * itemsize).
    """
    fn = "copy_all_layer_kv_cache_cpu"
    _check_cpu(fn, data_ptrs=data_ptrs, strides=strides, tgt_loc=tgt_loc, src_loc=src_loc)
    _check(data_ptrs.numel() == strides.numel(), fn, "data_ptrs and strides differ in length")
    _check(tgt_loc.numel() == src_loc.numel(), fn, "tgt_loc and src_loc differ in length")
    tgt, src = _ints(tgt_loc), _ints(src_loc)
    if not tgt:
        return
    _check(min(tgt + src) >= 0, fn, "negative KV slot index")
    n_rows = max(tgt + src) + 1
    for base, row_bytes in zip(_ints(data_ptrs.view(torch.int64) if data_ptrs.dtype == torch.uint64
                                    else data_ptrs), _ints(strides)):
        # A uint8 [n_rows, row_bytes] view of the buffer's first n_rows rows (no copy).
        raw = (ctypes.c_uint8 * (n_rows * row_bytes)).from_address(base)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(n_rows, row_bytes)
        rows = buf[src].clone()
        buf[tgt] = rows


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """out_cache_loc[p_i : p_i + len_i] = req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]], p_i the
    exclusive prefix sum of the lengths; entries past the total are left untouched.

    Mirrors the Triton kernel `assign_extend_cache_locs` (kernels/ops/speculative/cache_locs.py; called by
    `assign_extend_cache_locs_func` and `fill_front_out_cache_loc_func`).
    """
    fn = "assign_extend_cache_locs_cpu"
    rows, starts, ends = _segments(fn, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                   pool_len)
    pt = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            out_cache_loc[pt:pt + n] = req_to_token[row, s:e].to(torch.int64)
        pt += n


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                           seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int,
                                           topk: int, num_steps: int) -> None:
    """out_cache_loc[i*topk*num_steps : (i+1)*topk*num_steps] = req_to_token[req_pool_indices[i],
    seq_lens[i] : seq_lens[i] + topk*num_steps]: read back the draft KV slots the allocator reserved.

    Mirrors the Triton kernel `assign_draft_cache_locs_contiguous` (kernels/ops/speculative/cache_locs.py) with
    WRITE_POSITIONS off (`assign_draft_cache_locs_contiguous_func` asserts the CPU path writes no positions).
    """
    fn = "assign_draft_cache_locs_contiguous_cpu"
    _check_cpu(fn, req_pool_indices=req_pool_indices, req_to_token=req_to_token, seq_lens=seq_lens,
               out_cache_loc=out_cache_loc)
    _check(req_to_token.dim() == 2 and req_to_token.dtype == torch.int32, fn, "req_to_token must be 2-D int32")
    _check(out_cache_loc.dtype == torch.int64, fn, f"out_cache_loc must be int64, got {out_cache_loc.dtype}")
    _check(req_to_token.shape[1] == pool_len, fn, f"pool_len {pool_len} != req_to_token.shape[1]")
    copy_len = topk * num_steps
    rows, lens = _ints(req_pool_indices), _ints(seq_lens)
    _check(len(rows) == len(lens), fn, "req_pool_indices and seq_lens differ in length")
    _check(out_cache_loc.numel() == len(rows) * copy_len, fn,
           f"out_cache_loc has {out_cache_loc.numel()} entries, expected bs*topk*num_steps = {len(rows) * copy_len}")
    for i, (row, start) in enumerate(zip(rows, lens)):
        out_cache_loc[i * copy_len:(i + 1) * copy_len] = req_to_token[row, start:start + copy_len].to(torch.int64)


# ---------------------------------------------------------------------------------------------------------------
# EAGLE verify / accept
# ---------------------------------------------------------------------------------------------------------------


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor,
                          accept_stride: int) -> None:
    """bonus_tokens[i] = accept_tokens.flat[accept_stride * i + accept_lens[i] - 1]: the last accepted token of each
    request (accept_lens counts the bonus token).

    Mirrors the Triton kernel `fill_bonus_tokens` (kernels/ops/speculative/eagle.py).
    """
    fn = "fill_bonus_tokens_cpu"
    _check_cpu(fn, accept_tokens=accept_tokens, accept_lens=accept_lens, bonus_tokens=bonus_tokens)
    bs = accept_lens.numel()
    _check(accept_tokens.numel() >= bs * accept_stride, fn, "accept_tokens smaller than bs * accept_stride")
    _check(bonus_tokens.numel() == bs, fn, "bonus_tokens must have one entry per request")
    flat_in, flat_out = accept_tokens.reshape(-1), bonus_tokens.view(-1)
    for i, n in enumerate(_ints(accept_lens)):
        flat_out[i] = flat_in[accept_stride * i + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor) -> None:
    """Compact the accepted tokens' KV slots: for each j with accept_index[j] != -1, in order,
    accept_out_cache_loc[#accepted before j] = out_cache_loc[accept_index[j]].

    Mirrors the Triton kernel `fill_accept_out_cache_loc` (kernels/ops/speculative/eagle.py): program j writes to
    dst = number of entries before j that are not -1, and only when its own src > -1.
    """
    fn = "fill_accept_out_cache_loc_cpu"
    _check_cpu(fn, accept_index=accept_index, out_cache_loc=out_cache_loc,
               accept_out_cache_loc=accept_out_cache_loc)
    dst = 0
    n_locs = out_cache_loc.numel()
    flat_loc, flat_out = out_cache_loc.reshape(-1), accept_out_cache_loc.view(-1)
    for src in _ints(accept_index):
        if src > -1:
            _check(src < n_locs, fn, f"accept_index {src} out of range ({n_locs} cache locations)")
            flat_out[dst] = flat_loc[src]
            dst += 1


def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                    verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
                                    positions: torch.Tensor, retrive_index: torch.Tensor,
                                    retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                                    topk: int, depth: int, draft_token_num: int, tree_mask_mode: int) -> None:
    """Build the EAGLE draft tree: attention mask rows, per-token positions, and the retrieval links
    (retrive_index / first child retrive_next_token / next sibling retrive_next_sibling; the caller pre-fills
    both link tensors with -1).

    Mirrors the CUDA kernel `build_tree_efficient` (kernels/jit/include/sgl_kernel/speculative/eagle.cuh; its
    Triton port `sgl_build_tree_kernel_efficient_triton` is in kernels/ops/speculative/spec_tree.py), one
    (batch, token) program at a time. tree_mask_mode 0 = FULL_MASK (rows of seq_len + draft_token_num, the prefix
    columns left as the caller filled them), 1 = QLEN_ONLY (rows of draft_token_num). 2 (bit-packed) is not
    supported, as in SGLang's CPU op; on CPU SGLang uses QLEN_ONLY (`default_tree_mask_mode` in
    srt/speculative/eagle_utils.py).
    """
    fn = "build_tree_kernel_efficient_cpu"
    _check_cpu(fn, parent_list=parent_list, selected_index=selected_index, verified_seq_len=verified_seq_len,
               tree_mask=tree_mask, positions=positions, retrive_index=retrive_index,
               retrive_next_token=retrive_next_token, retrive_next_sibling=retrive_next_sibling)
    mode = int(tree_mask_mode)
    if mode not in (0, 1):
        raise NotImplementedError(f"sgl_kernel stand-in {fn}: tree_mask_mode {mode} (only FULL_MASK=0 and "
                                  "QLEN_ONLY=1, as in SGLang's CPU op)")
    _check(topk > 0 and depth > 0 and draft_token_num > 0, fn, "topk, depth and draft_token_num must be > 0")
    _check(tree_mask.dtype in (torch.bool, torch.uint8), fn, f"tree_mask must be bool/uint8, got {tree_mask.dtype}")
    bs = verified_seq_len.numel()
    n = draft_token_num
    parent_stride = topk * (depth - 1) + 1
    seq_lens = _ints(verified_seq_len)
    sel = selected_index.reshape(bs, n - 1).tolist() if n > 1 else [[] for _ in range(bs)]
    par = parent_list.reshape(bs, -1).tolist() if parent_list.numel() else [[] for _ in range(bs)]
    if depth > 1:
        _check(all(len(p) == parent_stride for p in par), fn, f"parent_list rows must have {parent_stride} entries")
    mask = tree_mask.view(-1)
    pos = positions.view(-1)
    r_idx = retrive_index.view(-1)
    r_next = retrive_next_token.view(-1)
    r_sib = retrive_next_sibling.view(-1)

    def find(row: list[int], token_idx: int) -> int:
        # CUDA scans `cur_position < draft_token_num`, i.e. one past the row; a miss ends at draft_token_num.
        for k, v in enumerate(row):
            if v == token_idx:
                return k
        return n

    seq_tree_idx = 0  # FULL_MASK: start of this request's mask block
    for bid in range(bs):
        seq_len = seq_lens[bid]
        s, p = sel[bid], par[bid]
        if mode == 0:
            block = seq_tree_idx + n * n * bid
        for tid in range(n):
            if mode == 0:
                row_start = block + (seq_len + n) * tid + seq_len  # CUDA: token_tree_idx - 1
            else:
                row_start = n * n * bid + n * tid
            mask[row_start] = True
            mask[row_start + 1:row_start + n] = False
            if tid == 0:
                continue
            # Walk from this token to the root, marking every ancestor.
            # A valid root-ward walk has at most `depth` steps (the bound SGLang's CPU op uses too); a node whose
            # ancestor is missing (the CUDA kernel would read past the row) ends the walk.
            position = 0
            cur = tid - 1
            while position < depth:
                position += 1
                mask[row_start + cur + 1] = True
                parent_tb_idx = s[cur] // topk
                if parent_tb_idx == 0:
                    break
                cur = find(s, p[parent_tb_idx])
                if cur >= n - 1:
                    print(f"WARNING: {fn}: invalid eagle tree, ancestor of node {tid} not found")
                    break
            pos[bid * n + tid] = position + seq_len

        # tid == 0 of the CUDA kernel: positions[root], retrieval links (children pushed in reverse order, so the
        # first child ends up the lowest index and siblings chain upwards).
        pos[bid * n] = seq_len
        off = bid * n
        for i in range(n - 1, 0, -1):
            r_idx[off + i] = off + i
            parent_tb_idx = s[i - 1] // topk
            parent_position = 0
            if parent_tb_idx > 0:
                parent_position = find(s, p[parent_tb_idx])
                parent_position = parent_position + 1 if parent_position < n else n
            if parent_position == n:
                print("WARNING: invalid eagle tree!!! Detected a token with no parent token selected. "
                      "Please check if the logprob has nan. The token will be ignored to keep proceeding.")
                continue
            origin = int(r_next[off + parent_position])
            r_next[off + parent_position] = i
            if origin != -1:
                r_sib[off + i] = origin
        r_idx[off] = off
        seq_tree_idx += seq_len * n


def verify_tree_greedy_cpu(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                           candidates: torch.Tensor, retrive_index: torch.Tensor,
                           retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                           target_predict: torch.Tensor) -> None:
    """Greedy tree verification: from the root, repeatedly move to the first child (then its siblings) whose draft
    token equals the target's argmax at the last accepted node; record accepted nodes in accept_index (slot 0 =
    root), their count (bonus excluded) in accept_token_num, and the target tokens in predicts.

    Mirrors the CUDA kernel `VerifyTreeGreedy` (kernels/jit/include/sgl_kernel/speculative/eagle.cuh; Triton port
    `verify_tree_greedy_kernel_triton` in kernels/ops/speculative/spec_tree.py). target_predict is indexed by the
    flat node index, as in the kernel.
    """
    fn = "verify_tree_greedy_cpu"
    _check_cpu(fn, predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
               candidates=candidates, retrive_index=retrive_index, retrive_next_token=retrive_next_token,
               retrive_next_sibling=retrive_next_sibling, target_predict=target_predict)
    _check(candidates.dim() == 2 and accept_index.dim() == 2, fn, "candidates and accept_index must be 2-D")
    bs, n = candidates.shape
    num_spec = accept_index.shape[1]
    _check(predicts.numel() == bs * n, fn, "predicts must have bs * num_draft_tokens entries")
    cand = candidates.reshape(-1).tolist()
    r_idx = retrive_index.reshape(-1).tolist()
    r_next = retrive_next_token.reshape(-1).tolist()
    r_sib = retrive_next_sibling.reshape(-1).tolist()
    target = target_predict.reshape(-1).tolist()
    pred = predicts.view(-1)
    acc = accept_index.view(-1)
    acc_num = accept_token_num.view(-1)
    for bx in range(bs):
        off = bx * n
        last = r_idx[off]
        acc[bx * num_spec] = last
        num_accepted = 0
        cur = 0
        for _ in range(1, num_spec):
            cur = r_next[off + cur]
            while cur != -1:
                draft_index = r_idx[off + cur]
                if cand[off + cur] == target[last]:
                    pred[last] = target[last]
                    num_accepted += 1
                    acc[bx * num_spec + num_accepted] = draft_index
                    last = draft_index
                    break
                cur = r_sib[off + cur]
            if cur == -1:
                break
        acc_num[bx] = num_accepted
        pred[last] = target[last]


# ---------------------------------------------------------------------------------------------------------------
# Everything else: importable, but raises when called.
# ---------------------------------------------------------------------------------------------------------------


def _not_implemented(name: str):
    def stub(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: not provided by the eagle3 CPU stand-in (tests/sglang_cpu/sgl_kernel); "
            "add a pure-PyTorch version there if this path is needed")

    stub.__name__ = stub.__qualname__ = name
    stub.__doc__ = f"Placeholder for sgl_kernel.{name}: raises NotImplementedError when called."
    return stub


def __getattr__(name: str):
    # Dunder / private look-ups (__path__, __wrapped__, _foo ...) must stay AttributeErrors, or the import
    # machinery and introspection tools are misled.
    if name.startswith("_"):
        raise AttributeError(name)
    stub = _not_implemented(name)
    globals()[name] = stub
    return stub
