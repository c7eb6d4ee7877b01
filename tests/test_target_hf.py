"""HF backend: hook captures equal HF's own output_hidden_states, padding never leaks, Kimi wrapper loads."""

from __future__ import annotations

import pytest
import torch
from models import kimi_wrapped, tiny_deepseek_v3, tiny_llama, tiny_target_cfg

from eagle3.batching import plan_batches
from eagle3.targets.hf import HFTarget
from eagle3.targets.info import weights_id


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {"llama": tiny_llama(root / "llama"), "deepseek": tiny_deepseek_v3(root / "ds"),
            "kimi": kimi_wrapped(root / "kimi")}


def _seqs(vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (17, 5, 33, 9, 33, 1)]


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_hooks_equal_output_hidden_states(targets, tmp_path, kind):
    cfg = tiny_target_cfg(targets[kind], tmp_path, tmp_path, batch_tokens=64, max_batch_size=4)
    t = HFTarget(cfg.target, cfg.extract)
    L = t.num_layers
    assert t.layer_ids == cfg.target.layer_ids(L)
    seqs = _seqs()
    batched = t.capture(seqs)
    for s, c in zip(seqs, batched, strict=True):
        with torch.no_grad():
            ref = t.model(torch.tensor([s]), output_hidden_states=True).hidden_states
        assert len(ref) == L + 1
        want_aux = torch.cat([ref[k][0] for k in t.layer_ids], dim=-1)
        assert c.aux.shape == (len(s), 3 * t.hidden_size) and c.final.shape == (len(s), t.hidden_size)
        torch.testing.assert_close(c.aux, want_aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c.final, ref[L][0], rtol=1e-5, atol=1e-5)  # last entry: post-norm
        # and not the neighbouring layers (the convention is really "input of layer k")
        assert not torch.allclose(c.aux[:, : t.hidden_size], ref[t.layer_ids[0] + 1][0], atol=1e-3)
    # batched with padding == one by one
    for s, c in zip(seqs, batched, strict=True):
        one = t.capture([s])[0]
        torch.testing.assert_close(c.aux, one.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c.final, one.final, rtol=1e-5, atol=1e-5)
    t.close()


def test_bf16_capture_dtype(targets, tmp_path):
    cfg = tiny_target_cfg(targets["llama"], tmp_path, tmp_path)
    cfg.target.dtype = "bfloat16"
    t = HFTarget(cfg.target, cfg.extract)
    c = t.capture([[5, 6, 7, 8]])[0]
    assert c.aux.dtype == torch.bfloat16 and c.final.dtype == torch.bfloat16
    assert c.aux.shape == (4, 3 * 64)


def test_kimi_wrapper_loads_through_text_config(targets, tmp_path):
    kimi_cfg = tiny_target_cfg(targets["kimi"], tmp_path, tmp_path)
    plain_cfg = tiny_target_cfg(targets["deepseek"], tmp_path, tmp_path)
    kimi, plain = HFTarget(kimi_cfg.target, kimi_cfg.extract), HFTarget(plain_cfg.target, plain_cfg.extract)
    assert kimi.architectures == ["KimiK25ForConditionalGeneration"] and kimi.model_type == "kimi_k25"
    assert type(kimi.model).__name__ == "DeepseekV3ForCausalLM"
    assert kimi.num_layers == 4 and kimi.hidden_size == 64 and kimi.vocab_size == 256
    a, b = kimi.model.state_dict(), plain.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    s = _seqs()[:2]
    for x, y in zip(kimi.capture(s), plain.capture(s), strict=True):
        assert torch.equal(x.aux, y.aux) and torch.equal(x.final, y.final)
    assert weights_id(kimi.path) != weights_id(plain.path)


def test_layer_ids_validated(targets, tmp_path):
    cfg = tiny_target_cfg(targets["llama"], tmp_path, tmp_path)
    cfg.target.aux_layer_ids = [1, 3, 8]  # 8 layers: ids 0..7
    with pytest.raises(ValueError, match="outside the target's depth"):
        HFTarget(cfg.target, cfg.extract)


def test_plan_batches_budget_and_cover():
    lengths = [10, 3, 50, 7, 7, 20, 100, 1]
    batches = plan_batches(lengths, batch_tokens=60, max_batch_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 60
    assert [6] in batches  # longer than the budget: alone


def test_concurrent_captures_on_one_backend(targets, tmp_path):
    """Online training captures from two prefetch threads at once (the train batches and, at an eval step, the
    eval batches) on the one backend: its layer hooks must never hand one thread's states to the other or clear
    them under it."""
    import threading

    llama_cfg = tiny_target_cfg(targets["llama"], tmp_path, tmp_path)
    hf = HFTarget(llama_cfg.target, llama_cfg.extract)
    seqs = _seqs()
    want = [hf.capture([s])[0] for s in seqs]  # one at a time, as the threads ask
    errors: list[BaseException] = []

    def hammer(order: list[int]) -> None:
        try:
            for _ in range(15):
                for i in order:
                    got = hf.capture([seqs[i]])[0]
                    assert torch.equal(got.aux, want[i].aux) and torch.equal(got.final, want[i].final)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(o,)) for o in (list(range(len(seqs))), list(range(len(seqs)))[::-1])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_the_argmax_head_says_when_its_gpu_has_no_room_left():
    """Beside an SGLang server, the extraction's lm_head and its working memory share a GPU with one of the server's
    ranks: counted (working_bytes) and refused in one line naming the fix when it does not fit."""
    from eagle3.targets.argmax import LOGITS_PER_BLOCK, room_problem, working_bytes

    need = working_bytes(32768, 7168, 2)
    assert need == 32768 * 7168 * 2 + 2 * LOGITS_PER_BLOCK * 4 + 32768 * 16  # Kimi at 32K: 0.74 GB
    assert room_problem(need + (1 << 30), need, "cuda:0", 2_348_810_240) is None
    msg = room_problem(need // 2, need, "cuda:0", 2_348_810_240)
    assert "needs 0.74 GB on cuda:0 beside its lm_head (2.35 GB, loaded)" in msg and "--mem-fraction-static" in msg
