"""Unit tests of the pure-PyTorch `sgl_kernel` stand-in (tests/sglang_cpu/sgl_kernel): torch only, no SGLang.

Expected values follow the Triton / CUDA kernels each function mirrors (see the function docstrings); the chain
inputs are the ones SGLang 0.5.23 builds for `topk 1` (srt/speculative/base_spec_worker.py
`_topk1_parents_prealloc` / `_topk1_score_indices_prealloc`, srt/speculative/eagle_utils.py
`build_tree_kernel_efficient`, which pre-fills the link tensors with -1 and a QLEN_ONLY mask with True).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def sk():
    spec = importlib.util.spec_from_file_location("sgl_kernel_standin", HERE / "sgl_kernel" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_req_to_token_roundtrip(sk):
    req_to_token = torch.zeros((5, 32), dtype=torch.int32)
    rows = torch.tensor([2, 4, 1], dtype=torch.int64)
    start = torch.tensor([0, 3, 8], dtype=torch.int32)
    end = torch.tensor([6, 3, 15], dtype=torch.int32)
    locs = torch.randperm(4096)[:13].to(torch.int64)
    sk.assign_req_to_token_pool_cpu(rows, req_to_token, start, end, locs, 32)
    assert req_to_token[2, :6].tolist() == locs[:6].tolist()
    assert req_to_token[1, 8:15].tolist() == locs[6:].tolist()
    assert int(req_to_token[4].abs().sum()) == 0
    out = torch.full((20,), -7, dtype=torch.int64)  # larger than needed: the tail stays untouched
    sk.assign_extend_cache_locs_cpu(rows, req_to_token, start, end, out, 32)
    assert out[:13].tolist() == locs.tolist() and out[13:].eq(-7).all()
    with pytest.raises(RuntimeError, match="int32"):
        sk.assign_req_to_token_pool_cpu(rows, req_to_token.long(), start, end, locs, 32)


def test_draft_cache_locs_contiguous(sk):
    req_to_token = torch.arange(3 * 20, dtype=torch.int32).view(3, 20)
    out = torch.empty(2 * 1 * 3, dtype=torch.int64)
    sk.assign_draft_cache_locs_contiguous_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([5, 9]), out, 20, 1, 3)
    assert out.tolist() == [45, 46, 47, 9, 10, 11]


def test_copy_all_layer_kv_cache_in_place(sk):
    bufs = [torch.arange(10 * 6, dtype=torch.float32).view(10, 6), torch.arange(10 * 3, dtype=torch.int64).view(10, 3)]
    want = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    tgt, src = torch.tensor([1, 2, 7]), torch.tensor([2, 1, 1])  # a swap plus a copy: reads happen before writes
    sk.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, w in zip(bufs, want):
        w[tgt] = w[src].clone()
        assert torch.equal(b, w)


def test_bonus_and_accept_out_cache_loc(sk):
    accept_tokens = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]], dtype=torch.int32)
    bonus = torch.empty(2, dtype=torch.int32)
    sk.fill_bonus_tokens_cpu(accept_tokens, torch.tensor([3, 1], dtype=torch.int32), bonus, 4)
    assert bonus.tolist() == [13, 21]
    accept_index = torch.tensor([0, 1, -1, -1, 4, -1, -1, -1], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 108, dtype=torch.int64)
    acc = torch.full((8,), -1, dtype=torch.int64)
    sk.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, acc)
    assert acc.tolist() == [100, 101, 104, -1, -1, -1, -1, -1]


def _chain_tree(sk, bs=2, steps=3, mode=1, seq_lens=(7, 3)):
    n = steps + 1
    parents = torch.arange(-1, steps - 1, dtype=torch.long).repeat(bs, 1)
    selected = torch.arange(steps, dtype=torch.long).repeat(bs, 1)
    seq = torch.tensor(seq_lens[:bs], dtype=torch.long)
    size = n * n * bs if mode == 1 else int(seq.sum()) * n + n * n * bs
    mask = torch.full((size,), True)
    pos = torch.empty(bs * n, dtype=torch.long)
    links = torch.full((3, bs, n), -1, dtype=torch.long)
    sk.build_tree_kernel_efficient_cpu(parents, selected, seq, mask, pos, links[0], links[1], links[2],
                                       1, steps, n, mode)
    return mask, pos, links, seq


def test_build_tree_chain_qlen_only(sk):
    mask, pos, (idx, nxt, sib), seq = _chain_tree(sk)
    n = 4
    assert idx.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert nxt.tolist() == [[1, 2, 3, -1]] * 2
    assert sib.tolist() == [[-1] * n] * 2
    assert pos.tolist() == [7, 8, 9, 10, 3, 4, 5, 6]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    assert torch.equal(mask.view(2, n, n), causal.expand(2, n, n))


def test_build_tree_chain_full_mask(sk):
    mask, pos, _, seq = _chain_tree(sk, mode=0)
    n = 4
    first = mask[: n * (7 + n)].view(n, 7 + n)
    second = mask[n * (7 + n):].view(n, 3 + n)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    assert first[:, :7].all() and torch.equal(first[:, 7:], causal)
    assert second[:, :3].all() and torch.equal(second[:, 3:], causal)


def test_build_tree_rejects_bitpacking(sk):
    with pytest.raises(NotImplementedError):
        _chain_tree(sk, mode=2)


def test_verify_tree_greedy_chain(sk):
    _, _, (idx, nxt, sib), _ = _chain_tree(sk)
    # request 0: drafts 5, 6 match the target, 9 does not (target says 8); request 1: nothing matches.
    candidates = torch.tensor([[4, 5, 6, 9], [4, 1, 2, 3]], dtype=torch.long)
    target = torch.tensor([[5, 6, 8, 0], [7, 1, 2, 3]], dtype=torch.long)
    predicts = torch.zeros(8, dtype=torch.int32)
    accept_index = torch.full((2, 4), -1, dtype=torch.int32)
    accept_num = torch.zeros(2, dtype=torch.int32)
    sk.verify_tree_greedy_cpu(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
                              candidates=candidates, retrive_index=idx, retrive_next_token=nxt,
                              retrive_next_sibling=sib, target_predict=target)
    assert accept_num.tolist() == [2, 0]
    assert accept_index.tolist() == [[0, 1, 2, -1], [4, -1, -1, -1]]
    assert predicts.tolist() == [5, 6, 8, 0, 7, 0, 0, 0]


def test_unknown_names_raise_when_called(sk):
    from_import = sk.rotate_input_ids_cpu  # what `from sgl_kernel import rotate_input_ids_cpu` does
    with pytest.raises(NotImplementedError, match="rotate_input_ids_cpu"):
        from_import()
    with pytest.raises(AttributeError):
        sk.__some_dunder__  # noqa: B018


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
