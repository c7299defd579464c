"""pipeline_efficiency: the step time of p = 2 pipeline stages (dp = 1, two gloo processes
under torchrun, one torch thread each) for m = 2, 4, 8 micro-batches under GPipe and 1F1B, vs
the ideal from the per-micro-batch compute measured in the same run.

Model: the GPT of trainer.debug_models.gpt_layers (4 blocks, n_embd 128, 64 tokens; 0.82M
parameters) split by parameters, 8 sequences per micro-batch, torch's fused AdamW in-process
(no daemons: only the pipeline is measured). The timed region is the whole
PipelineTrainer.step(), optimizer included; each rank also times its stage's forward +
backward of one micro-batch alone (no communication) and its optimizer step alone, and

    ideal = (m + p - 1) * max over stages of t_mb + max over stages of t_opt

(the slowest stage sets the pace; the optimizer step comes after the flush). Per (schedule,
m) the result file has the measured step, the ideal, efficiency = ideal / measured, the
measured bubble 1 - m * t_mb_max / (measured - t_opt_max) next to the theoretical
(p - 1) / (m + p - 1), and the compute per micro-batch as the pipeline ran it.

Headline: 1F1B at the largest m, ours = measured, peer = ideal, ratio = ideal / measured
(higher is better; 1.0 is a pipeline that loses nothing but its fill and drain).

    python -m bench.pipeline_efficiency            # ~1 minute; --smoke: a tiny config, nothing recorded
"""

from __future__ import annotations

import argparse

from bench.common import record
from bench.pipeline_worker import launch

PP = 2
MICROBATCHES = (2, 4, 8)
SCHEDULES = ("gpipe", "1f1b")
TARGET = 0.90
FULL = ["--n-layer", "4", "--n-embd", "128", "--block-size", "64", "--mb-size", "8",
        "--rounds", "6", "--steps", "4", "--warmup", "2", "--mb-reps", "20"]  # fmt: skip
SMOKE = ["--n-layer", "2", "--n-embd", "32", "--block-size", "16", "--mb-size", "2",
         "--rounds", "1", "--steps", "1", "--warmup", "1", "--mb-reps", "2"]  # fmt: skip


def run(*, smoke: bool = False) -> dict:
    microbatches = (2,) if smoke else MICROBATCHES
    return launch(
        PP, "efficiency", "--pp", str(PP), "--schedules", ",".join(SCHEDULES),
        "--microbatches", ",".join(map(str, microbatches)), *(SMOKE if smoke else FULL),
    )  # fmt: skip


def report(data: dict) -> None:
    print(
        f"t_mb alone per stage: {', '.join(f'{t:.2f}' for t in data['t_mb_ms'])} ms; "
        f"optimizer step: {', '.join(f'{t:.2f}' for t in data['t_opt_ms'])} ms"
    )
    print(
        "schedule   m  measured ms  ideal ms  efficiency  bubble  (p-1)/(m+p-1)  t_mb in pipeline ms  efficiency vs it"
    )
    for r in data["results"]:
        print(
            f"{r['schedule']:<7} {r['microbatches']:>3}  {r['measured_ms']:>11.1f}  {r['ideal_ms']:>8.1f}  "
            f"{r['efficiency']:>10.3f}  {r['bubble_measured']:>6.3f}  {r['bubble_theory']:>13.3f}  "
            f"{', '.join(f'{t:.2f}' for t in r['t_mb_in_pipeline_ms']):>19}  "
            f"{r['efficiency_vs_in_pipeline_compute']:>16.3f}"
        )


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny configuration, one step; records nothing")
    args = p.parse_args(argv)
    data = run(smoke=args.smoke)
    report(data)
    if args.smoke:
        return None
    results = {(r["schedule"], r["microbatches"]): r for r in data["results"]}
    head = results[("1f1b", max(MICROBATCHES))]
    rows = ", ".join(f"{s} m={m}: {r['efficiency']:.2f}" for (s, m), r in results.items())
    return record(
        "pipeline_efficiency",
        ours=head["measured_ms"],
        peer=head["ideal_ms"],
        ratio=head["efficiency"],
        unit="ms/step",
        target=TARGET,
        higher_is_better=True,
        notes=f"p={PP}, dp=1, 1F1B m={max(MICROBATCHES)}; ratio = ideal/measured, ideal = (m+p-1) x slowest "
        f"stage's fwd+bwd of one micro-batch alone + its optimizer step; efficiency {rows}; "
        f"{data['params'] / 1e6:.2f}M-param GPT, {data['mb_size']} x {data['config']['block_size']} tokens "
        f"per micro-batch, fused AdamW in-process, 1 torch thread per rank; median of "
        f"{data['rounds']} rounds x {data['steps_per_round']} steps (configurations interleaved); against the "
        f"compute per micro-batch as the pipeline ran it ({', '.join(f'{t:.1f}' for t in head['t_mb_in_pipeline_ms'])} "
        f"ms vs {', '.join(f'{t:.1f}' for t in data['t_mb_ms'])} alone) the same step is at "
        f"{head['efficiency_vs_in_pipeline_compute']:.2f} of ideal",
        extra={
            "pp": PP,
            **{k: v for k, v in data.items() if k != "pp"},
        },
    )


if __name__ == "__main__":
    main()
