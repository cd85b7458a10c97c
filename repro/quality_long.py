"""Paper claim 2's deciding run: the runtime quality table's pre-registered long profile (table ``quality-long``).

    python -m repro.quality_long            # 8 seeds x 480 steps: ~20-40 min on 2 cores (make repro-long)

The same runtime as ``python -m repro.quality`` (HF rollout and the GRPO trainer through the Handoff; arms
colocated, train-batch at budget P, KnitTrans at P and at its throughput-matched budget), sized so that the
colocated/train-batch gap rises above seed noise. Configuration: ``repro/conf/quality_long.yaml``; metric, bound and
decision rule: ``repro/spec/quality.py`` (``quality_gap_narrowed``), both committed before the deciding run. Its
rows are committed under docs/results/quality-long (``python -m repro.report --snapshot docs/results`` copies them
with the rest when the run wrote to results/).
"""

from __future__ import annotations

import hydra

from repro.quality import cli


@hydra.main(config_path="conf", config_name="quality_long", version_base=None)
def main(cfg) -> None:  # noqa: ANN001
    cli(cfg)


if __name__ == "__main__":
    main()
