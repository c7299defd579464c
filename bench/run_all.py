"""`make bench`: runs every benchmark, then rewrites the results table in docs/benchmarks.md
from bench/results/*.json (between the two marker lines)."""

from __future__ import annotations

import json
import re
import shutil

from bench import (
    compress_cpu,
    compress_gpu,
    compression_convergence,
    fused_decompress_adamw,
    nvme_io,
    nvme_train_step,
    optimizer_step,
    pipeline_efficiency,
    ps_overhead_pp_dp,
    staleness_convergence,
    train_step_overhead,
    transport,
)
from bench.common import REPO, RESULTS

DOC = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def table() -> str:
    rows = [
        "| benchmark | ours | peer | unit | ratio | target | met | date |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(RESULTS.glob("*.json")):
        r = json.loads(path.read_text())
        target = f"{'≥' if r['higher_is_better'] else '≤'} {r['target']}"
        rows.append(
            f"| `{r['name']}` | {r['ours']} | {r['peer']} | {r['unit']} | **{r['ratio']}** | {target} | "
            f"{'yes' if r['target_met'] else 'no'} | {r['date']} |"
        )
    return "\n".join(rows)


def update_doc() -> None:
    text = DOC.read_text()
    new = re.sub(f"{re.escape(BEGIN)}.*?{re.escape(END)}", f"{BEGIN}\n{table()}\n{END}", text, flags=re.S)
    DOC.write_text(new)


def main() -> None:
    optimizer_step.main()
    transport.main()
    train_step_overhead.main()
    pipeline_efficiency.main([])
    ps_overhead_pp_dp.main([])
    staleness_convergence.main()
    compress_cpu.main()
    compress_gpu.main()  # says so and records nothing without CUDA
    fused_decompress_adamw.main()
    compression_convergence.main()
    if shutil.which("fio"):
        nvme_io.main()
        nvme_train_step.main()
    else:
        print("nvme_io, nvme_train_step: skipped, fio is not installed (apt-get install fio); their results were kept")
    update_doc()
    print(f"results in {RESULTS.relative_to(REPO)}/, table in {DOC.relative_to(REPO)}")


if __name__ == "__main__":
    main()
