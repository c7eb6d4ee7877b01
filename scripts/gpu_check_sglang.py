"""GPU check: SGLang backend states == HF backend states, token for token.

    python scripts/gpu_check_sglang.py --model "$(python -c 'from eagle3.bundled import materialise_smollm2; print(materialise_smollm2())')"
    (normally through: bash scripts/gpu_check_sglang.sh [MODEL_PATH])

NOT YET RUN ON A GPU (written in a task without a device). Exits 0 and prints PASS only when, for every prompt,
the token counts are equal and the mean per-token cosine of each aux layer and of the final state is >= 0.99.
It also prints the cosine against the *neighbouring* HF layers, which shows the layer-id convention is the
intended one (input of layer k), not merely close.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eagle3.config import load_config  # noqa: E402
from eagle3.layer_ids import default_layer_ids  # noqa: E402
from eagle3.logs import setup_logging  # noqa: E402

THRESHOLD = 0.99


def prompts(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = [
        "The capital of France is",
        "Write a short poem about the sea, then explain its rhyme scheme line by line.",
        " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(120)),  # ~1.5K tokens
    ]
    seqs = [tok(t)["input_ids"] for t in texts]
    return seqs + [seqs[1]]  # a repeated prompt: must come back whole (no radix-cache reuse)


def cos_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default="runs/gpu-check-sglang")
    ap.add_argument("--mem-fraction-static", default="0.5")
    a = ap.parse_args()
    setup_logging()
    torch.set_num_threads(4)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n_layers = json.loads((Path(a.model) / "config.json").read_text())["num_hidden_layers"]
    ids = default_layer_ids(n_layers)
    data = {
        "output_dir": str(out),
        "target": {"path": a.model, "dtype": "bfloat16", "device": "cuda", "backend": "sglang",
                   "aux_layer_ids": ids,
                   "sglang": {"tp_size": 1, "dump_dir": tempfile.mkdtemp(prefix="eagle3-check-", dir="/dev/shm"),
                              "launch_args": ["--mem-fraction-static", a.mem_fraction_static]}},
    }
    cfg_path = out / "gpu-check.yaml"
    cfg_path.write_text("# python scripts/gpu_check_sglang.py (written by it)\n" + yaml.safe_dump(data, sort_keys=False))
    cfg = load_config(cfg_path)

    seqs = prompts(a.model)
    from eagle3.targets.sglang import SGLangTarget

    with SGLangTarget(cfg) as sg:
        got = sg.capture(seqs, names=[f"prompt{i}" for i in range(len(seqs))])

    from eagle3.targets.hf import HFTarget

    hf_cfg = load_config(cfg_path, ["target.backend=hf", "target.dtype=float32"])
    hf = HFTarget(hf_cfg)
    ok = True
    H = hf.hidden_size
    for i, (s, g) in enumerate(zip(seqs, got, strict=True)):
        ref = hf.capture([s])[0]
        if g.aux.shape[0] != len(s) or ref.aux.shape[0] != len(s):
            print(f"prompt{i}: token counts differ: prompt {len(s)}, sglang {g.aux.shape[0]}, hf {ref.aux.shape[0]}")
            ok = False
            continue
        cols = {f"aux[{k}]": (g.aux[:, j * H:(j + 1) * H], ref.aux[:, j * H:(j + 1) * H]) for j, k in enumerate(ids)}
        cols["final"] = (g.final, ref.final)
        parts = []
        for name, (x, y) in cols.items():
            c = cos_rows(x.cpu(), y.cpu())
            ok &= bool(c.mean() >= THRESHOLD)
            parts.append(f"{name} mean {c.mean():.4f} min {c.min():.4f}")
        print(f"prompt{i} ({len(s)} tokens): " + "; ".join(parts))
    # The convention check: SGLang's low state against HF hidden_states[k-1], [k], [k+1].
    with torch.no_grad():
        hs = hf.model(torch.tensor([seqs[1]], device=hf.device), output_hidden_states=True).hidden_states
    k = ids[0]
    near = {j: float(cos_rows(got[1].aux[:, :H].cpu(), hs[j][0].cpu()).mean()) for j in (k - 1, k, k + 1)}
    print(f"layer-id convention: sglang aux low vs HF hidden_states[j]: {near} (expected best at j={k})")
    ok &= max(near, key=near.get) == k

    verify = REPO / "eagle3" / "verify.py"
    if verify.is_file():
        r = subprocess.run([shutil.which("eagle3") or "eagle3", "verify-extraction", "--config", str(cfg_path),
                            "--source", "backend"], cwd=REPO)
        print(f"eagle3 verify-extraction --source backend: exit {r.returncode}")
        ok &= r.returncode == 0
    else:
        print("SKIP eagle3 verify-extraction: eagle3/verify.py is not in this checkout")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
