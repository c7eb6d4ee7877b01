"""`eagle3` console script: one subcommand per stage, all driven by the same config file.

    eagle3 config show --config configs/smollm2-135m.yaml train.lr=3e-4
    eagle3 prepare --config configs/smollm2-135m.yaml
    eagle3 data show --config configs/smollm2-135m.yaml --index 3   # one prepared sample, trained spans marked
    eagle3 vocab coverage --config configs/smollm2-135m.yaml       # greedy output the draft vocab cannot propose
    eagle3 extract --config configs/smollm2-135m.yaml
    eagle3 train --config configs/smollm2-135m.yaml        # or: accelerate launch train.py --config ...
    eagle3 eval --config configs/smollm2-135m.yaml
    eagle3 export --to sglang runs/smollm2/checkpoints/best runs/smollm2/export/sglang
    eagle3 sglang serve --config configs/kimi-k2.5.yaml     # the capturing SGLang server for extraction
    eagle3 mooncake master --config configs/kimi-k2.5.yaml  # the store that carries states between machines
    eagle3 cache convert runs/smollm2/cache runs/smollm2/cache-fp8 --storage fp8

Each stage's work lives in its module; this file only parses arguments and hands over a validated Config.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, get_args

from eagle3 import threads
from eagle3.config import Config, ConfigError, EvalEngine, Storage, load_config
from eagle3.config_docs import config_docs
from eagle3.layer_ids import ArchFamily, Engine
from eagle3.logs import setup_logging


def _with_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", required=True, help="the YAML config (one schema for every stage)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=3e-4")


def _cfg(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config, args.overrides)
    threads.configure(cfg.cpu_threads)
    return cfg


def cmd_config(args: argparse.Namespace) -> int:
    print(_cfg(args).to_yaml(), end="")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from eagle3.prepare import run

    run(_cfg(args))
    return 0


def cmd_data_show(args: argparse.Namespace) -> int:
    from eagle3.data.show import show

    color = {"auto": None, "always": True, "never": False}[args.color]
    print(show(_cfg(args), index=args.index, sample_id=args.id, split=args.split, color=color))
    return 0


def cmd_vocab_coverage(args: argparse.Namespace) -> int:
    from eagle3.coverage import run

    run(_cfg(args))
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    from eagle3.regenerate import run

    run(_cfg(args))
    return 0


def cmd_extract(args: argparse.Namespace) -> int:
    from eagle3.extract import run

    run(_cfg(args))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from eagle3.locks import writing

    cfg = _cfg(args)
    # The trainer's own lock (eagle3.trainer.run), taken here too before its 4 s of imports: a second run is refused
    # at once.
    with writing(cfg.checkpoint_dir, "train", per_rank=True):
        from eagle3.trainer import run

        run(cfg)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from eagle3.evaluate import run

    cfg = _cfg(args)
    if args.engine:
        cfg.eval.engine = args.engine
    run(cfg)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from eagle3.export import export

    hybrid = None
    if args.hybrid:
        from eagle3.engines.hybrid_rule import parse_rule

        hybrid = parse_rule(args.hybrid, "--hybrid")
    export(args.checkpoint, args.out, to=args.to, target_family=args.target_family, hybrid=hybrid)
    return 0


def cmd_cache_info(args: argparse.Namespace) -> int:
    from eagle3.cache import print_info

    return print_info(args.dir, verify=args.verify)


def cmd_cache_upgrade(args: argparse.Namespace) -> int:
    from eagle3.cache import expected_fingerprint, print_info, upgrade
    from eagle3.targets.argmax import ArgmaxHead

    cfg = _cfg(args)
    n = upgrade(args.dir, ArgmaxHead.for_backend(None, cfg.target, cfg.extract.teacher_chunk),
                expected_fingerprint(cfg.target, cfg.extract.storage, cfg.prepared_dir))
    print(f"upgraded {args.dir}: {n} shard(s) rewritten with the target's argmax and checksums")
    return print_info(args.dir)


def cmd_cache_convert(args: argparse.Namespace) -> int:
    from eagle3.cache import convert, payload_bytes_per_token, print_info, read_meta

    fp = read_meta(args.src)["fingerprint"]
    out = convert(args.src, args.dst, args.storage)
    exact = payload_bytes_per_token(fp["hidden_size"], fp["dtype"])
    print(f"converted {out['tokens']} tokens to {args.storage}: {out['bytes'] / max(out['tokens'], 1):.1f} bytes/token "
          f"(exact {fp['dtype']} payload {exact}); train with extract.cache_dir={args.dst} extract.storage={args.storage}")
    print_info(args.dst)
    return 0


def cmd_verify_extraction(args: argparse.Namespace) -> int:
    from eagle3.verify_extraction import run

    return run(_cfg(args), source=args.source, num_samples=args.num_samples)


def cmd_sglang(args: argparse.Namespace) -> int:
    import os

    from eagle3.targets.sglang import serve
    from eagle3.targets.sglang_store import request_shape

    cfg = _cfg(args)
    if args.mooncake_host:
        from eagle3.targets.mooncake import ENV_HOSTNAME

        os.environ[ENV_HOSTNAME] = args.mooncake_host
    return serve(cfg.target, cfg.data.max_length, args.port, args.host, dry_run=args.action == "command",
                 local_rank=args.local_rank, request=request_shape(cfg.extract, cfg.train),
                 images=cfg.draft.image_inputs is not None)  # set once the data holds images


def cmd_mooncake(args: argparse.Namespace) -> int:
    from eagle3.targets.mooncake import StoreAddress, run_master

    cfg = _cfg(args)
    if args.action == "check":
        from eagle3.targets import make_backend
        from eagle3.targets.sglang_store import request_shape

        if cfg.target.backend != "sglang" or cfg.target.sglang.transport != "mooncake":
            raise ConfigError("eagle3 mooncake check: the config's target is not served through the store (set "
                              "target.backend=sglang and target.sglang.transport=mooncake)")
        backend = make_backend(cfg.target, cfg.extract, cfg.data.max_length, cfg.paths.logs_dir,
                               request=request_shape(cfg.extract, cfg.train), preflight=True)
        backend.close()
        print("ok: every server of target.sglang.url hands states over through the Mooncake Store")
        return 0
    return run_master(StoreAddress.of(cfg.target.sglang.mooncake), dry_run=args.action == "command",
                      log_file=args.log)


def _add_vocab(sub: Any) -> None:
    vocab_p = sub.add_parser("vocab", help="inspect the prepared draft vocabulary")
    vocab_sub = vocab_p.add_subparsers(dest="action", required=True)
    what = ("per prompt set of eval.prompt_sets: the share of the target's plain greedy output the draft vocab cannot "
            "propose, and of it the share also in the prompt (copyable)")
    vc = vocab_sub.add_parser("coverage", help=what, description=what)
    _with_config(vc)
    vc.set_defaults(fn=cmd_vocab_coverage)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description="Train EAGLE-3 draft heads for SGLang and vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str, config: bool = True):
        p = sub.add_parser(name, help=help, description=help)
        if config:
            _with_config(p)
        p.set_defaults(fn=fn)
        return p

    _add_config(sub)
    add("prepare", cmd_prepare, "conversations -> chat template -> input_ids + loss_mask, and the draft vocab")
    _add_data(sub)
    _add_vocab(sub)
    add("regenerate", cmd_regenerate, "self-distillation: re-answer every conversation with the target")
    add("extract", cmd_extract, "target hidden states -> the on-disk cache (offline mode)")
    add("train", cmd_train, "train the EAGLE-3 head (single process; use accelerate launch train.py for more)")
    ev = add("eval", cmd_eval, "acceptance length under real speculative decoding")
    ev.add_argument("--engine", choices=get_args(EvalEngine), default=None, help="overrides eval.engine")
    vp = add("verify-extraction", cmd_verify_extraction, "compare extracted states with an HF reference forward")
    vp.add_argument("--source", default="backend", help="'backend' (the configured target backend) or a cache dir")
    vp.add_argument("--num-samples", type=int, default=4)

    ex = add("export", cmd_export, "write a checkpoint as SGLang or vLLM load it", config=False)
    ex.add_argument("--to", choices=get_args(Engine), required=True)
    ex.add_argument("--target-family", choices=get_args(ArchFamily), default=None,
                    help="SGLang's layer-id spelling for a target architecture outside eagle3's table "
                         "(eagle3/layer_ids.py); refused without it")
    ex.add_argument("--hybrid", metavar="RULE", default=None,
                    help="eagle3's hybrid drafter rule, JSON or a JSON file (benchmarks/bench_hybrid.py's "
                         "router.json), written beside the head for EAGLE3_HYBRID=auto (the vLLM and SGLang plugins, "
                         "eagle3.engines.hybrid_rule)")
    ex.add_argument("checkpoint", help="a training checkpoint folder (or an eagle3 export)")
    ex.add_argument("out", help="output folder")
    _add_sglang(sub)
    _add_mooncake(sub)
    _add_cache(sub)
    return parser


def _add_config(sub: Any) -> None:
    """`eagle3 config show|docs`."""
    cfg_p = sub.add_parser("config", help="inspect the resolved config")
    cfg_sub = cfg_p.add_subparsers(dest="action", required=True)
    show = cfg_sub.add_parser("show", help="print the resolved, validated config")
    _with_config(show)
    show.set_defaults(fn=cmd_config)
    docs = cfg_sub.add_parser("docs", help="print the reference of every config key (Markdown)")
    docs.set_defaults(fn=lambda _args: print(config_docs(), end="") or 0)


def _add_data(sub: Any) -> None:
    """`eagle3 data show`."""
    data_p = sub.add_parser("data", help="inspect the prepared data")
    data_sub = data_p.add_subparsers(dest="action", required=True)
    what = "print one prepared sample as the target sees it: the trained spans marked, token counts, its source record"
    ds = data_sub.add_parser("show", help=what, description=what)
    _with_config(ds)
    pick = ds.add_mutually_exclusive_group()
    pick.add_argument("--index", type=int, default=None, help="the sample's index in --split (default 0)")
    pick.add_argument("--id", default=None, help="the sample's id (either split)")
    ds.add_argument("--split", choices=["train", "eval"], default="train")
    ds.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                    help="mark trained spans in colour (auto: on a terminal) or between [[ and ]]")
    ds.set_defaults(fn=cmd_data_show)


def _add_sglang(sub: Any) -> None:
    """`eagle3 sglang serve|command`."""
    sg = sub.add_parser("sglang", help="the SGLang server that extraction captures hidden states from")
    sg_sub = sg.add_subparsers(dest="action", required=True)
    for action, what in (("serve", "start eagle3's capturing SGLang server for a config (in this terminal)"),
                         ("command", "print that server's environment and command line only")):
        a = sg_sub.add_parser(action, help=what, description=what)
        _with_config(a)
        a.add_argument("--port", type=int, default=None, help="default: the port of target.sglang.url, else 30000")
        a.add_argument("--host", default="127.0.0.1")
        a.add_argument("--local-rank", type=int, default=None,
                       help="which entry of a target.sglang.url list this server is (default: LOCAL_RANK, else 0)")
        a.add_argument("--mooncake-host", default=None,
                       help="this machine's address as the trainers reach it, for the Mooncake Store (default: "
                            "$EAGLE3_MOONCAKE_HOSTNAME, else the address that routes to the master)")
        a.set_defaults(fn=cmd_sglang)


def _add_mooncake(sub: Any) -> None:
    """`eagle3 mooncake master|command|check`."""
    mc = sub.add_parser("mooncake", help="the Mooncake Store that carries states between machines (online training "
                        "across nodes: target.sglang.transport=mooncake)")
    mc_sub = mc.add_subparsers(dest="action", required=True)
    for action, what in (("master", "start the store's master at target.sglang.mooncake.master, health-check it "
                                    "with a real put and get, and stay in the foreground"),
                         ("command", "print the master's command line only"),
                         ("check", "round-trip one probe through every server of target.sglang.url and the store "
                                   "(the preflight every run does), from this machine")):
        a = mc_sub.add_parser(action, help=what, description=what)
        _with_config(a)
        if action == "master":
            from pathlib import Path

            a.add_argument("--log", type=Path, default=None, help="the master's own log file (default: this terminal)")
        else:
            a.set_defaults(log=None)
        a.set_defaults(fn=cmd_mooncake)


def _add_cache(sub: Any) -> None:
    """`eagle3 cache info|upgrade|convert`."""
    cache_p = sub.add_parser("cache", help="inspect or convert a hidden-state cache")
    cache_sub = cache_p.add_subparsers(dest="action", required=True)
    info = cache_sub.add_parser("info", help="samples, tokens, bytes per token, layer ids, fingerprint")
    info.add_argument("dir")
    info.add_argument("--verify", action="store_true", help="also check every shard's SHA-256 (reads the whole cache)")
    info.set_defaults(fn=cmd_cache_info)
    up = cache_sub.add_parser("upgrade", help="upgrade a format-1 cache in place (adds the target's argmax and "
                              "checksums; reads the target's lm_head, not the whole target)")
    up.add_argument("dir")
    _with_config(up)
    up.set_defaults(fn=cmd_cache_upgrade)
    conv = cache_sub.add_parser("convert", help="re-store an exact cache as fp8 into a new folder (no target run)")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--storage", required=True, choices=[s for s in get_args(Storage) if s != "exact"])
    conv.set_defaults(fn=cmd_cache_convert)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; `key=value` overrides may follow a positional and `--config` in any order (argparse
    alone drops those after an option once the positionals are taken: `eagle3 cache upgrade DIR --config X k=v`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = parse(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        return _config_error(e)


def _config_error(e: ConfigError) -> int:
    """A config error's one line and its exit status (2), the same from `eagle3` and the entry scripts."""
    print(f"config error: {e}", file=sys.stderr)
    return 2


def stage_config(stage: str, argv: list[str]) -> Config:
    """`eagle3 <stage>`'s command line (`--config FILE [key=value ...]`) as the validated config, for the entry
    scripts (train.py, extract.py): the same parser, and a config error exits 2 as `eagle3 <stage>` does."""
    setup_logging()
    try:
        return _cfg(parse([stage, *argv]))
    except ConfigError as e:
        raise SystemExit(_config_error(e)) from None


if __name__ == "__main__":
    sys.exit(main())
