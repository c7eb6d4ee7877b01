#!/usr/bin/env bash
# bash recipes/smollm2-135m/quickstart.sh [key=value ...]     (4-6 minutes on an idle 2-core CPU: BENCHMARKS.md "Quickstart")
# Every stage of the bundled SmolLM2-135M recipe at a smoke-test budget (configs/smollm2-135m-quickstart.yaml):
# prepare -> extract -> train -> export (SGLang, vLLM) -> eval on MT-bench; prints τ and where the report and the
# exported drafts are. Same pipeline as run.sh (the full CPU run); key=value overrides go to every stage.
set -euo pipefail
CONFIG=configs/smollm2-135m-quickstart.yaml STAGES="${STAGES:-prepare extract train export eval}" exec bash "$(dirname "$0")/run.sh" "$@"
