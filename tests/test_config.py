from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.config import Config, ConfigError, load_config
from eagle3.layer_ids import default_layer_ids, from_engine_ids, to_engine_ids

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # The first line says how to run it.
    assert path.read_text().startswith("# ")


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_typo_names_dotted_path_and_suggests(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "train:\n  lrr: 1e-3\n"))
    msg = str(e.value)
    assert "train.lrr: unknown key" in msg
    assert "did you mean 'train.lr'" in msg
    assert "allowed here:" in msg and "ttt_steps" in msg


def test_a_moved_key_says_where_it_went(tmp_path: Path) -> None:
    """train.teacher_chunk became extract.teacher_chunk (set where the target's argmax is computed)."""
    with pytest.raises(ConfigError, match=r"train.teacher_chunk is now extract.teacher_chunk"):
        load_config(_write(tmp_path, "train:\n  teacher_chunk: 4096\n"))
    assert load_config(_write(tmp_path, "extract:\n  teacher_chunk: 4096\n")).extract.teacher_chunk == 4096


def test_wrong_type_names_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "train:\n  ttt_steps: many\n"))
    assert "train.ttt_steps" in str(e.value) and "integer" in str(e.value)


def test_bad_literal_lists_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "extract:\n  mode: sometimes\n"))
    assert "extract.mode" in str(e.value) and "'offline'" in str(e.value) and "'online'" in str(e.value)


def test_sampled_drafts_are_refused_for_sglang(tmp_path: Path) -> None:
    """SGLang only verifies its draft's top-k: a τ at draft_sampling=probabilistic could not be measured there."""
    text = "eval:\n  engine: sglang\n  temperature: 0.7\n  draft_sampling: probabilistic\n"
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, text))
    assert "eval" in str(e.value) and "draft_sampling=greedy" in str(e.value)
    assert load_config(_write(tmp_path, text.replace("sglang", "vllm"))).eval.draft_sampling == "probabilistic"


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "train:\n  lr: 1e-3\n  lr: 2e-3\n"))
    assert "duplicate key 'lr' at line 3 (first set at line 2)" in str(e.value)


def test_layer_id_beyond_depth(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "target:\n  num_layers: 30\n  aux_layer_ids: [2, 15, 40]\n"))
    msg = str(e.value)
    assert "target.aux_layer_ids" in msg and "[40]" in msg and "0..29" in msg


def test_layer_ids_must_be_increasing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "target:\n  aux_layer_ids: [15, 2, 27]\n"))
    assert "target.aux_layer_ids" in str(e.value)


def test_bundled_target_depth_is_known_without_loading(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "target:\n  aux_layer_ids: [2, 15, 30]\n"))
    assert "30 decoder layers" in str(e.value)


def test_depth_read_from_local_config_json_including_text_config(tmp_path: Path) -> None:
    model = tmp_path / "kimi"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["KimiK25ForConditionalGeneration"], '
                                       '"text_config": {"num_hidden_layers": 61}}')
    cfg = load_config(None, [f"target.path={model}"])
    from eagle3.targets.info import target_num_layers

    assert target_num_layers(cfg.target.path, cfg.target.num_layers) == 61 and cfg.target.layer_ids(61) == [2, 30, 58]
    with pytest.raises(ConfigError):
        load_config(None, [f"target.path={model}", "target.aux_layer_ids=[2, 30, 61]"])


def test_overrides_parse_yaml_values() -> None:
    cfg = load_config(None, ["train.lr=3e-4", "target.aux_layer_ids=[2, 15, 27]", "draft.hidden_size=null",
                             "output_dir=/tmp/x"])
    assert cfg.train.lr == 3e-4 and cfg.target.aux_layer_ids == [2, 15, 27] and cfg.output_dir == "/tmp/x"


def test_override_typo_is_caught() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trian.lr=1"])
    assert "trian: unknown key" in str(e.value)


def test_override_without_equals() -> None:
    with pytest.raises(ConfigError, match="expected dotted key=value"):
        load_config(None, ["train.lr"])


def test_cross_field_tree_size() -> None:
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        load_config(None, ["eval.num_steps=2", "eval.topk=1", "eval.num_draft_tokens=8"])


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "smollm2-135m.yaml", ["train.lr=1e-3"])
    again = load_config(_write(tmp_path, cfg.to_yaml()))
    assert again == cfg


def test_default_ids_and_engine_spellings() -> None:
    assert default_layer_ids(61) == [2, 30, 58]
    assert default_layer_ids(30) == [2, 15, 27]
    # vLLM: as-is.  SGLang Llama: every explicit id +1, so write k-1.  SGLang DeepSeek/Kimi 0.5.23: +1 only when the
    # first id is 1 (earlier releases: always), so ids starting at 2 are written k-1, the one spelling both read
    # alike; others as-is (0.5.23's spelling).
    assert to_engine_ids([2, 30, 58], "vllm", "deepseek") == [2, 30, 58]
    assert to_engine_ids([2, 15, 27], "sglang", "llama") == [1, 14, 26]
    assert to_engine_ids([2, 30, 58], "sglang", "deepseek") == [1, 29, 57]
    assert to_engine_ids([3, 30, 58], "sglang", "deepseek") == [3, 30, 58]
    assert from_engine_ids([3, 30, 58], "sglang", "deepseek") == [3, 30, 58]
    with pytest.raises(ValueError):
        to_engine_ids([1, 30, 58], "sglang", "deepseek")
    for fam in ("llama", "deepseek"):
        assert from_engine_ids(to_engine_ids([2, 30, 58], "sglang", fam), "sglang", fam) == [2, 30, 58]


def test_cli_config_show(capsys: pytest.CaptureFixture[str]) -> None:
    from eagle3.cli import main

    assert main(["config", "show", "--config", str(REPO / "configs" / "smollm2-135m.yaml"), "train.lr=5e-4"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.0005" in out and "aux_layer_ids:" in out
    assert main(["config", "show", "--config", str(REPO / "configs" / "smollm2-135m.yaml"), "train.nope=1"]) == 2
    assert "train.nope: unknown key" in capsys.readouterr().err


def test_mixed_precision_no_is_the_word_in_yaml_and_overrides(tmp_path: Path) -> None:
    assert load_config(None, ["train.mixed_precision=no"]).train.mixed_precision == "no"
    assert load_config(_write(tmp_path, "train:\n  mixed_precision: no\n")).train.mixed_precision == "no"
    assert load_config(None, ["train.resume=false"]).train.resume is False


@pytest.mark.parametrize("n", range(3, 70))
def test_default_ids_are_valid_for_every_depth(n: int) -> None:
    from eagle3.layer_ids import validate_layer_ids

    validate_layer_ids(default_layer_ids(n), n)


def test_config_reference_doc_matches_the_schema() -> None:
    from eagle3.config_docs import config_docs

    doc = (REPO / "docs" / "config.md").read_text()
    assert doc == config_docs(), "docs/config.md is stale: regenerate it with `eagle3 config docs > docs/config.md`"
    assert "| `train.ttt_steps` |" in doc and "| `data.sources[].path` | `str` | required |" in doc
