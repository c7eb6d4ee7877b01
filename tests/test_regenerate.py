"""`eagle3 regenerate`: the HF backend on a tiny random Llama, the OpenAI client against a fake local server
(success, timeouts, 5xx, dropped connections, 429, permanent failures), and resume after SIGKILL.

    pytest -q tests/test_regenerate.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fake_openai_server import FakeOpenAIServer

from eagle3.config import Config
from eagle3.regenerate import Summary, run
from eagle3.regenerate.dialogue import split_reasoning
from eagle3.regenerate.openai import EndpointPool, OpenAIBackend, RequestError
from eagle3.regenerate.output import failed_path, recover

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------- helpers
def write_sharegpt(path: Path, convs: list[tuple[str, list[tuple[str, str]]]]) -> Path:
    with open(path, "w") as f:
        for cid, turns in convs:
            f.write(json.dumps({"id": cid, "conversations": [{"from": r, "value": v} for r, v in turns]}) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def openai_cfg(tmp_path: Path, source: Path, urls: list[str], **regen) -> Config:
    cfg = Config(output_dir=str(tmp_path / "run"), data={"sources": [{"path": str(source)}]},
                 regenerate={"backend": "openai", "endpoints": urls, "model": "fake-model", "timeout_s": 5.0,
                             "max_retries": 3, "concurrency": 2, "max_tokens": 32, **regen})
    return cfg


def fast_backend(cfg: Config) -> OpenAIBackend:
    """The real client with millisecond backoff, so retry tests take no time."""
    return OpenAIBackend(cfg.regenerate, backoff_s=0.01, max_backoff_s=0.05)


def run_openai(cfg: Config) -> Summary:
    from eagle3.regenerate import load_conversations

    return run(cfg, load_conversations(cfg.data), fast_backend(cfg))


TWO_TURN = [
    ("c0", [("system", "be brief"), ("human", "hello"), ("gpt", "old answer"), ("human", "and then?"),
            ("gpt", "old again")]),
    ("c1", [("human", "what is 2+2"), ("gpt", "5")]),
    ("c2", [("human", "tell me LONG"), ("gpt", "...")]),
]


# ---------------------------------------------------------------------------------------------- unit level
@pytest.mark.parametrize(("content", "field", "answer", "reasoning"), [
    ("plain answer", None, "plain answer", None),
    ("answer", "server-parsed thought", "answer", "server-parsed thought"),
    ("<think>thought</think>\n\nanswer", None, "answer", "thought"),
    ("  <think>\nthought\n</think>answer", None, "answer", "thought"),
    ("thought</think>answer", None, "answer", "thought"),  # Kimi thinking mode: the prompt ended with <think>
    ("<think></think>answer", None, "answer", None),  # Kimi with thinking off
    ("<think>still thinking when cut", None, "", "still thinking when cut"),  # truncated at max_tokens
    (None, None, "", None),
])
def test_split_reasoning(content, field, answer, reasoning):
    assert split_reasoning(content, field) == (answer, reasoning)


def test_dialogue_answer_points_and_system_prompt():
    from eagle3.data.types import Conversation, Turn
    from eagle3.regenerate.dialogue import Answer, Dialogue

    conv = Conversation("x", [Turn("assistant", "opening line"), Turn("user", "u1"), Turn("user", "u1b"),
                              Turn("assistant", "a1"), Turn("user", "u2")])
    d = Dialogue(conv, system_prompt="sys")
    prompts = []
    while (h := d.next_prompt()) is not None:
        prompts.append([t.content for t in h])
        d.add_answer(Answer(f"new{len(prompts)}", tokens=2))
    # The leading assistant turn answers nothing (dropped); consecutive user turns get one answer; a trailing
    # user turn gets one too; the system prompt is inserted because the conversation has none.
    assert prompts == [["sys", "u1", "u1b"], ["sys", "u1", "u1b", "new1", "u2"]]
    out = d.outcome()
    assert [(t.role, t.content) for t in out.conversation.turns] == [
        ("system", "sys"), ("user", "u1"), ("user", "u1b"), ("assistant", "new1"), ("user", "u2"),
        ("assistant", "new2")]
    assert out.tokens == 4 and not out.cut_at_max_length
    assert not Dialogue(Conversation("y", [Turn("system", "s"), Turn("assistant", "a")])).has_prompt


def test_dialogue_stops_at_max_length():
    from eagle3.data.types import Conversation, Turn
    from eagle3.regenerate.dialogue import Answer, Dialogue

    conv = Conversation("x", [Turn("user", "u1"), Turn("assistant", "a1"), Turn("user", "u2"),
                              Turn("assistant", "a2")])
    d = Dialogue(conv, max_length=100)
    d.next_prompt()
    d.add_answer(Answer("new1", tokens=40, prompt_tokens=60))  # 60 + 40 tokens: prepare keeps nothing after
    assert d.next_prompt() is None
    out = d.outcome()
    assert [t.content for t in out.conversation.turns] == ["u1", "new1"] and out.cut_at_max_length


def test_recover_cuts_torn_line_and_lists_ids(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text('{"id": "a", "conversations": []}\n{"id": "b", "conversations": []}\n{"id": "c", "conv')
    assert recover(out) == {"a", "b"}
    assert out.read_text().endswith('"b", "conversations": []}\n')
    # A last line that has its newline but is not JSON (garbage after a crash) is cut as well.
    out.write_text('{"id": "a", "conversations": []}\n\x00\x00\x00\n')
    assert recover(out) == {"a"}
    assert out.read_text() == '{"id": "a", "conversations": []}\n'
    # Damage before the last line is not guessed at: the error names the file and line.
    out.write_text('{"id": "a"}\nnot json\n{"id": "c"}\n')
    with pytest.raises(ValueError, match=r"r\.jsonl, line 2"):
        recover(out)


def test_endpoint_pool_least_busy_then_round_robin():
    pool = EndpointPool(["http://a/v1", "http://b/v1", "http://c/v1"])
    first = [pool.acquire().url for _ in range(3)]
    assert first == ["http://a/v1", "http://b/v1", "http://c/v1"]
    b = pool.endpoints[1]
    pool.release(b)
    assert pool.acquire().url == "http://b/v1"  # the only one with nothing in flight
    for ep in pool.endpoints:
        pool.release(ep)
    # A failing endpoint is benched even though it is the least busy; a client error (4xx) does not bench.
    bad = pool.acquire()
    pool.release(bad, RequestError("refused", retryable=True))
    picks = [pool.acquire() for _ in range(4)]
    assert bad not in picks and len({ep.url for ep in picks}) == 2
    for ep in picks:
        pool.release(ep, RequestError("HTTP 400", retryable=False))
    assert bad not in [pool.acquire() for _ in range(4)]


# ----------------------------------------------------------------------------------------- OpenAI backend
def test_openai_multi_turn_success_writes_sharegpt(tmp_path):
    src = write_sharegpt(tmp_path / "convs.jsonl", TWO_TURN)
    with FakeOpenAIServer() as srv:
        cfg = openai_cfg(tmp_path, src, [srv.url], temperature=0.7, top_p=0.9)
        s = run_openai(cfg)
        bodies = srv.chat_bodies()
    assert (s.regenerated, s.failed, s.truncated_turns, s.truncated_conversations) == (3, 0, 1, 1)
    assert s.tokens > 0 and s.total_in_output == 3
    recs = {r["id"]: r for r in read_jsonl(cfg.regenerated_path)}
    assert recs["c0"]["conversations"] == [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": "hello"},
        {"from": "gpt", "value": "A1: hello"}, {"from": "human", "value": "and then?"},
        {"from": "gpt", "value": "A2: and then?"}]
    assert recs["c1"]["conversations"][-1] == {"from": "gpt", "value": "A1: what is 2+2"}
    # The second turn was asked with the regenerated first answer, never the original one.
    second = next(b for b in bodies if b["messages"][-1]["content"] == "and then?")
    assert [m["content"] for m in second["messages"]] == ["be brief", "hello", "A1: hello", "and then?"]
    assert {(b["temperature"], b["top_p"], b["max_tokens"], b["model"]) for b in bodies} == {(0.7, 0.9, 32, "fake-model")}
    assert all(b["chat_template_kwargs"]["thinking"] is False for b in bodies)
    assert not failed_path(cfg.regenerated_path).exists()
    # The file reads back through the sources reader `prepare` uses, turn for turn.
    from eagle3.config import SourceConfig
    from eagle3.data.sources import read_conversations

    back = {c.id: c for c in read_conversations(SourceConfig(path=str(cfg.regenerated_path)))}
    assert [(t.role, t.content) for t in back["c0"].turns] == [
        ("system", "be brief"), ("user", "hello"), ("assistant", "A1: hello"), ("user", "and then?"),
        ("assistant", "A2: and then?")]


def test_openai_stops_conversation_at_max_length(tmp_path):
    src = write_sharegpt(tmp_path / "convs.jsonl", TWO_TURN)
    with FakeOpenAIServer() as srv:  # reports prompt_tokens=10 and a few completion tokens
        cfg = openai_cfg(tmp_path, src, [srv.url])
        cfg.data.max_length = 12
        s = run_openai(cfg)
        assert len(srv.requests) == 3  # c0's second turn is never asked
    recs = {r["id"]: r for r in read_jsonl(cfg.regenerated_path)}
    assert [t["value"] for t in recs["c0"]["conversations"]] == ["be brief", "hello", "A1: hello"]
    assert (s.regenerated, s.cut_at_max_length) == (3, 1)
    assert "1 ended early at data.max_length" in s.line()


@pytest.mark.parametrize("style", ["field", "tags", "open"])
@pytest.mark.parametrize("keep", [True, False])
def test_openai_thinking_keeps_or_drops_reasoning(tmp_path, style, keep):
    src = write_sharegpt(tmp_path / "convs.jsonl", TWO_TURN[:1])
    with FakeOpenAIServer(reasoning_style=style) as srv:
        cfg = openai_cfg(tmp_path, src, [srv.url], thinking=True, keep_reasoning=keep)
        run_openai(cfg)
        bodies = srv.chat_bodies()
    assert all(b["chat_template_kwargs"]["thinking"] is True for b in bodies)
    # History goes back with its thinking as `reasoning_content` (an agent's request; K2.5's template keeps or drops
    # it by its own rule), whether or not the output keeps it.
    assert bodies[1]["messages"][2] == {"role": "assistant", "content": "A1: hello",
                                        "reasoning_content": "thinking about hello"}
    gpt = [t for t in read_jsonl(cfg.regenerated_path)[0]["conversations"] if t["from"] == "gpt"]
    assert [t["value"] for t in gpt] == ["A1: hello", "A2: and then?"]
    if keep:
        assert [t["reasoning"] for t in gpt] == ["thinking about hello", "thinking about and then?"]
    else:
        assert all("reasoning" not in t for t in gpt)


def test_openai_retries_transient_failures(tmp_path):
    src = write_sharegpt(tmp_path / "convs.jsonl", [("c1", [("human", "hi"), ("gpt", "x")])])
    with FakeOpenAIServer(hang_s=1.5) as srv:
        srv.script.extend(["500", "429", "drop", "timeout", "garbage", "503"])
        cfg = openai_cfg(tmp_path, src, [srv.url], timeout_s=0.4, max_retries=6, concurrency=1)
        s = run_openai(cfg)
        actions = [r["action"] for r in srv.requests]
    assert actions == ["500", "429", "drop", "timeout", "garbage", "503", "ok"]
    assert (s.regenerated, s.failed) == (1, 0)
    assert read_jsonl(cfg.regenerated_path)[0]["conversations"][-1]["value"] == "A1: hi"


def test_openai_permanent_failures_are_recorded_and_retried_next_run(tmp_path):
    convs = [("ok1", [("human", "fine"), ("gpt", "x")]),
             ("bad500", [("human", "ALWAYS_500 please"), ("gpt", "x")]),
             ("bad400", [("human", "ALWAYS_400 please"), ("gpt", "x")]),
             ("ok2", [("human", "also fine"), ("gpt", "x")])]
    src = write_sharegpt(tmp_path / "convs.jsonl", convs)
    with FakeOpenAIServer() as srv:
        cfg = openai_cfg(tmp_path, src, [srv.url], max_retries=2)
        s = run_openai(cfg)
        per_conv: dict[str, int] = {}
        for b in srv.chat_bodies():
            key = b["messages"][-1]["content"]
            per_conv[key] = per_conv.get(key, 0) + 1
    assert (s.regenerated, s.failed) == (2, 2)
    assert per_conv["ALWAYS_500 please"] == 3  # 1 + max_retries
    assert per_conv["ALWAYS_400 please"] == 1  # a client error is not retried
    failed = {r["id"]: r for r in read_jsonl(failed_path(cfg.regenerated_path))}
    assert set(failed) == {"bad500", "bad400"}
    assert "HTTP 500" in failed["bad500"]["error"] and failed["bad500"]["attempts"] == 3
    assert "HTTP 400" in failed["bad400"]["error"] and failed["bad400"]["attempts"] == 1
    assert {r["id"] for r in read_jsonl(cfg.regenerated_path)} == {"ok1", "ok2"}
    assert "2 failed" in s.line() and str(failed_path(cfg.regenerated_path)) in s.line()

    # The next run (server fixed: the prompts no longer trigger failures) retries only the failed ones.
    src.write_text(src.read_text().replace("ALWAYS_500", "now").replace("ALWAYS_400", "now"))
    with FakeOpenAIServer() as srv:
        cfg.regenerate.endpoints = [srv.url]
        s2 = run_openai(cfg)
        asked = sorted(b["messages"][-1]["content"] for b in srv.chat_bodies())
    assert asked == ["now please", "now please"]
    assert (s2.regenerated, s2.failed, s2.skipped_done) == (2, 0, 2)
    assert sorted(r["id"] for r in read_jsonl(cfg.regenerated_path)) == ["bad400", "bad500", "ok1", "ok2"]
    assert not failed_path(cfg.regenerated_path).exists()


def test_openai_spreads_over_endpoints_and_survives_a_dead_one(tmp_path):
    convs = [(f"c{i}", [("human", f"q{i}"), ("gpt", "x")]) for i in range(12)]
    src = write_sharegpt(tmp_path / "convs.jsonl", convs)
    dead = FakeOpenAIServer()
    dead_url = dead.url
    dead.httpd.server_close()  # nothing listens there any more: connection refused
    with FakeOpenAIServer(delay_s=0.05) as a, FakeOpenAIServer(delay_s=0.05) as b:
        cfg = openai_cfg(tmp_path, src, [a.url, b.url, dead_url], concurrency=4, max_retries=5)
        s = run_openai(cfg)
        na, nb = len(a.requests), len(b.requests)
    assert (s.regenerated, s.failed) == (12, 0)
    assert na + nb == 12 and min(na, nb) >= 3


def test_openai_discovers_model_and_reports_unreachable(tmp_path):
    src = write_sharegpt(tmp_path / "convs.jsonl", TWO_TURN[1:2])
    with FakeOpenAIServer(model="served-name") as srv:
        cfg = openai_cfg(tmp_path, src, [srv.url], model=None)
        run_openai(cfg)
        assert srv.chat_bodies()[0]["model"] == "served-name"
    dead = FakeOpenAIServer()
    dead.httpd.server_close()
    cfg = openai_cfg(tmp_path, src, [dead.url], model=None, max_retries=1)
    with pytest.raises(RuntimeError, match="no endpoint answered GET /models"):
        fast_backend(cfg)


def test_run_caps_at_max_samples_and_skips_done(tmp_path):
    convs = [(f"c{i}", [("human", f"q{i}"), ("gpt", "x")]) for i in range(6)] + [("c0", [("human", "dup")])]
    src = write_sharegpt(tmp_path / "convs.jsonl", convs)
    with FakeOpenAIServer() as srv:
        cfg = openai_cfg(tmp_path, src, [srv.url])
        cfg.data.max_samples = 4
        s = run(cfg)  # the real entry point: sources reader, real client with default backoff
        assert (s.regenerated, s.skipped_done) == (4, 0)
        cfg.data.max_samples = None
        s = run(cfg)
        # The last record (a prompt without an answer, read as one) reuses c0's id: counted, never regenerated.
        assert (s.regenerated, s.skipped_done, s.skipped_duplicate) == (2, 4, 1)
    ids = [r["id"] for r in read_jsonl(cfg.regenerated_path)]
    assert sorted(ids) == [f"c{i}" for i in range(6)]


# ------------------------------------------------------------------------------------------ kill -9, resume
def test_resume_after_sigkill_no_duplicates(tmp_path):
    n = 30
    convs = [(f"c{i:02d}", [("human", f"question {i}"), ("gpt", "x")]) for i in range(n)]
    src = write_sharegpt(tmp_path / "convs.jsonl", convs)
    out = tmp_path / "run" / "regen.jsonl"
    with FakeOpenAIServer(delay_s=0.1) as srv:
        config = {"output_dir": str(tmp_path / "run"), "data": {"sources": [{"path": str(src)}]},
                  "regenerate": {"backend": "openai", "endpoints": [srv.url], "model": "fake-model",
                                 "concurrency": 2, "timeout_s": 5, "output": str(out)}}
        cfg_file = tmp_path / "regen.yaml"
        cfg_file.write_text(yaml.safe_dump(config))
        cmd = [sys.executable, "-m", "eagle3.cli", "regenerate", "--config", str(cfg_file)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_text().count("\n") >= 5:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()[0].decode()[-2000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        lines = out.read_text().splitlines(keepends=True)
        assert 5 <= len(lines) < n
        # Make the kill land mid-write: the last record is left half written (no newline).
        torn_id = json.loads(lines[-1])["id"]
        out.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
        done_before = len(lines) - 1
        asked_before = len(srv.requests)

        res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        asked_after = len(srv.requests) - asked_before
    recs = read_jsonl(out)  # every line parses: the torn one was cut off
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)) == n
    assert torn_id in ids
    assert asked_after == n - done_before  # the second run asks exactly for what was not finished
    assert "torn last line" in res.stderr
    assert f"{n - done_before} regenerated" in res.stderr and f"{done_before} skipped as already done" in res.stderr


# --------------------------------------------------------------------------------------------- HF backend
@pytest.fixture(scope="module")
def tiny_hf_target(tmp_path_factory) -> Path:
    """A random 2-layer Llama (hidden 64) with the small ChatML test tokenizer (eos <|im_end|> 258, pad 256)."""
    from models import tiny_llama
    from tokenizer_builders import llama_test_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(path, vocab=320, layers=2)
    llama_test_tokenizer(path, vocab_size=320)
    return path


def hf_cfg(tmp_path: Path, target: Path, source: Path, **regen) -> Config:
    return Config(output_dir=str(tmp_path / "run"), target={"path": str(target), "dtype": "float32"},
                  data={"sources": [{"path": str(source)}]},
                  regenerate={"backend": "hf", "max_tokens": 6, "batch_size": 2, **regen})


def test_hf_backend_regenerates_batched_multi_turn(tmp_path, tiny_hf_target):
    src = write_sharegpt(tmp_path / "convs.jsonl", TWO_TURN)
    cfg = hf_cfg(tmp_path, tiny_hf_target, src)
    s = run(cfg)
    recs = {r["id"]: r for r in read_jsonl(cfg.regenerated_path)}
    assert set(recs) == {"c0", "c1", "c2"} and s.regenerated == 3 and s.failed == 0
    roles = [t["from"] for t in recs["c0"]["conversations"]]
    assert roles == ["system", "human", "gpt", "human", "gpt"]
    assert all(t["value"] not in ("old answer", "old again") for t in recs["c0"]["conversations"])
    answers = sum(t["from"] == "gpt" for r in recs.values() for t in r["conversations"])
    assert answers == 4
    # A random model rarely stops by itself: an answer is max_tokens long unless it emitted EOS.
    assert 0 <= s.truncated_turns <= 4 and 6 * s.truncated_turns <= s.tokens <= 6 * 4

    # Greedy decoding is deterministic and left padding must not change an answer: c1 was generated in a
    # batch with the longer c0; generate it alone. c0's second answer followed the regenerated first one.
    from eagle3.data.templates import render_prompt
    from eagle3.data.types import Turn
    from eagle3.regenerate.hf import HFBackend

    backend = HFBackend(cfg.target, cfg.regenerate, cfg.data.chat_template)
    c1 = recs["c1"]["conversations"]
    alone = backend.generate([render_prompt([Turn("user", c1[0]["value"])], backend.tokenizer, "auto", False)])
    assert alone[0].content == c1[1]["value"]
    c0 = recs["c0"]["conversations"]
    hist = [Turn("system", c0[0]["value"]), Turn("user", c0[1]["value"]), Turn("assistant", c0[2]["value"]),
            Turn("user", c0[3]["value"])]
    alone = backend.generate([render_prompt(hist, backend.tokenizer, "auto", False)])
    assert alone[0].content == c0[4]["value"]

    s2 = run(cfg)  # everything done: nothing is generated again
    assert (s2.regenerated, s2.skipped_done) == (0, 3)

    # data.max_length: c0's second prompt is longer than the first prompt + 1 token, so c0 ends after answer 1.
    first = render_prompt([Turn("system", "be brief"), Turn("user", "hello")], backend.tokenizer, "auto", False)
    cfg3 = hf_cfg(tmp_path / "cut", tiny_hf_target, src)
    cfg3.data.max_length = len(first) + 1
    s3 = run(cfg3)
    recs3 = {r["id"]: r for r in read_jsonl(cfg3.regenerated_path)}
    assert [t["from"] for t in recs3["c0"]["conversations"]] == ["system", "human", "gpt"]
    assert recs3["c0"]["conversations"][2]["value"] == c0[2]["value"]
    assert s3.cut_at_max_length == 1 and s3.regenerated == 3


# ------------------------------------------------------------------------------------------------ real vLLM
@pytest.mark.vllm
def test_real_vllm_server(tmp_path):
    """The OpenAI backend against a real vLLM server (on loopback, the vLLM venv of scripts/setup_vllm_cpu.sh or
    $EAGLE3_VLLM_PYTHON) serving a tiny Llama: every conversation comes back with the same structure the in-process
    HF backend gives."""
    from models import tiny_llama
    from test_regenerate_tools import vllm_server
    from test_vllm_engine import _find_vllm_python
    from tokenizer_builders import llama_test_tokenizer

    py = _find_vllm_python()
    if py is None:
        pytest.skip("no vLLM: run scripts/setup_vllm_cpu.sh or set EAGLE3_VLLM_PYTHON to a vLLM virtualenv's python")
    target = tiny_llama(tmp_path / "target", vocab=320, hidden=128, heads=4, kv_heads=2, intermediate=256,
                        layers=2)  # head_dim 32: vLLM's CPU attention has no kernel for 16
    llama_test_tokenizer(target, vocab_size=320)
    with vllm_server(py, target, tmp_path / "vllm.log") as root:
        src = write_sharegpt(tmp_path / "convs.jsonl", TWO_TURN)
        cfg = openai_cfg(tmp_path / "vllm", src, [f"{root}/v1"], model=None, max_tokens=6, timeout_s=120)
        s = run_openai(cfg)
        assert (s.regenerated, s.failed) == (3, 0) and s.tokens > 0
        hf = hf_cfg(tmp_path / "hf", target, src)
        run(hf)
        served = {r["id"]: r for r in read_jsonl(cfg.regenerated_path)}
        local = {r["id"]: r for r in read_jsonl(hf.regenerated_path)}

        def shape(rec: dict) -> list:
            return [(t["from"], t["value"] if t["from"] != "gpt" else "") for t in rec["conversations"]]

        # Greedy text may differ at near-ties of a random model's logits; the structure may not.
        assert {k: shape(v) for k, v in served.items()} == {k: shape(v) for k, v in local.items()}
