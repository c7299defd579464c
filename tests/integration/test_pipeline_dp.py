"""2 pipeline stages x 2 data-parallel replicas (4 gloo processes under torchrun) over 2
daemons end with the parameters of single-process training on the whole batch, for GPipe and
for 1F1B, each rank running the compute order torch plans for its stage."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch

from ps_offload.daemon.local import LocalDaemon
from ps_offload.trainer.pipeline.schedule_check import check_schedule
from tests.helpers import pipeline_mlp
from tests.helpers.pipeline_mlp import DP, MICROBATCHES, PP, STEPS, torchrun


def _reference(*, staleness: int = 0, max_grad_norm: float | None = None) -> dict[str, torch.Tensor]:
    """Single-process AdamW on the whole batch; with staleness=1 each step's gradients are
    taken at the parameters of the step before the last (the delayed update spelled out)."""
    model = torch.nn.Sequential(*pipeline_mlp.layers())
    compute = copy.deepcopy(model) if staleness else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    clipped = 0
    for x, y in pipeline_mlp.batches(STEPS):
        compute.zero_grad()
        pipeline_mlp.loss_fn(compute(x), y).backward()
        if max_grad_norm is not None:
            clipped += float(torch.nn.utils.clip_grad_norm_(compute.parameters(), max_grad_norm)) > max_grad_norm
        before = [p.detach().clone() for p in model.parameters()]
        for master, used in zip(model.parameters(), compute.parameters(), strict=True):
            master.grad = used.grad
        opt.step()
        if staleness:
            with torch.no_grad():
                for used, value in zip(compute.parameters(), before, strict=True):
                    used.copy_(value)
    assert max_grad_norm is None or clipped >= 2, "the reference should clip for the clipping to be tested"
    return model.state_dict()


def _assert_close(out: Path, **reference_kwargs) -> None:
    got = {**torch.load(out / "stage0.pt"), **torch.load(out / "stage1.pt")}
    reference = _reference(**reference_kwargs)
    assert sorted(got) == sorted(reference)
    for name, expected in reference.items():
        # Float reassociation only: micro-batch and replica sums in another order.
        err = (got[name] - expected).norm() / expected.norm()
        assert err <= 1e-5, (name, float(err))


def _assert_ran_as_planned(out: Path, schedule: str) -> None:
    traces = [json.loads((out / f"trace{rank}.json").read_text()) for rank in range(PP * DP)]
    for rank, trace in enumerate(traces):
        planned = [tuple(action) for action in trace["planned"]]
        if schedule == "1f1b" and trace["stage"] == PP - 1:
            # torch 2.13 plans the last 1F1B stage's forwards one micro-batch ahead of what it
            # runs (tests/trainer/pipeline/test_schedule_check.py pins it); what runs is F0 B0 F1 B1 ...
            planned = [(kind, mb - 1 if kind == "F" else mb) for kind, mb in planned]
        ran = [[tuple(action) for action in step] for step in trace["steps"]]
        assert ran == [planned] * STEPS, (rank, ran, planned)
    for replica in range(DP):
        for step in range(STEPS):
            order = {t["stage"]: [tuple(a) for a in t["steps"][step]] for t in traces if t["replica"] == replica}
            check_schedule(order, stages=PP, microbatches=MICROBATCHES, schedule=schedule)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_two_replicas_over_two_daemons_match_single_process(tmp_path, schedule):
    daemons = [LocalDaemon(tmp_path / f"d{i}") for i in range(2)]
    try:
        addresses = ",".join(d.address for d in daemons)
        result = torchrun(tmp_path, "--schedule", schedule, "--daemons", addresses, "--trace")
        assert result.returncode == 0, result.stderr[-4000:]
        _assert_close(tmp_path)
        _assert_ran_as_planned(tmp_path, schedule)
    finally:
        for daemon in daemons:
            daemon.kill()


@pytest.mark.slow
def test_delayed_update_with_clipping_matches_its_single_process_spelling(tmp_path):
    """staleness=1 across replicas (the barrier keeps a replica from pushing before the
    others pulled) and the gradient norm clipped over both stages."""
    daemons = [LocalDaemon(tmp_path / f"d{i}") for i in range(2)]
    try:
        addresses = ",".join(d.address for d in daemons)
        result = torchrun(tmp_path, "--daemons", addresses, "--staleness", "1", "--max-grad-norm", "0.35")
        assert result.returncode == 0, result.stderr[-4000:]
        _assert_close(tmp_path, staleness=1, max_grad_norm=0.35)
    finally:
        for daemon in daemons:
            daemon.kill()


def _reference_half(dtype: torch.dtype, *, overflow_at: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Single-process mixed precision: the model in `dtype`, fp32 masters with fused AdamW,
    cast back each step, the gradients summed in `dtype` as the pp x dp job sums them; fp16
    with GradScaler's rules (scaled loss, a step with an inf or NaN gradient skipped, the
    scale halved), with an inf put into the gradients at `overflow_at`. Returns the
    parameters and what the loss scaler did."""
    model = torch.nn.Sequential(*(layer.to(dtype) for layer in pipeline_mlp.layers()))
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    scaled = dtype == torch.float16
    scale, skipped, updates = 2.0**16 if scaled else 1.0, 0, 0
    for step, (x, y) in enumerate(pipeline_mlp.batches(STEPS)):
        # As the job accumulates: each replica sums its micro-batches' gradients in `dtype`,
        # the replicas' sums are added (the all-reduce), and the total divided by dp x m.
        sums = []
        for replica_x, replica_y in zip(x.chunk(DP), y.chunk(DP), strict=True):
            model.zero_grad()
            for mx, my in zip(replica_x.chunk(MICROBATCHES), replica_y.chunk(MICROBATCHES), strict=True):
                loss = pipeline_mlp.loss_fn(model(mx.to(dtype)), my)
                (loss * torch.tensor(scale, dtype=torch.float32)).backward()
            sums.append([p.grad.clone() for p in params])
        for p, *parts in zip(params, *sums, strict=True):
            p.grad = sum(parts[1:], parts[0]).div_(DP * MICROBATCHES)
        if step == overflow_at:
            params[0].grad.view(-1)[0] = float("inf")
        if scaled and not all(torch.isfinite(p.grad).all() for p in params):
            scale, skipped = scale / 2, skipped + 1
            continue
        inverse = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
        for master, p in zip(masters, params, strict=True):
            master.grad = p.grad.float() * inverse
        opt.step()
        updates += 1
        with torch.no_grad():
            for master, p in zip(masters, params, strict=True):
                p.copy_(master)
    return model.state_dict(), {"skipped": skipped, "scale": scale, "version": updates}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_stages_over_daemons_match_mixed_precision_in_one_process(tmp_path, dtype):
    """bf16 and fp16 stages (gloo moves the half-precision activations and all-reduces the
    half-precision gradients); fp16 with an inf injected into rank 3's gradients at step 2:
    every rank skips that step (no daemon version moves), every rank's loss scale backs off,
    and the run ends, bit for bit, where single-process mixed precision ends when it sums the
    micro-batch and replica gradients in half precision in the same order."""
    daemons = [LocalDaemon(tmp_path / f"d{i}") for i in range(2)]
    try:
        addresses = ",".join(d.address for d in daemons)
        overflow = ["--overflow", "3@2"] if dtype == "float16" else []
        result = torchrun(tmp_path, "--daemons", addresses, "--dtype", dtype, *overflow)
        assert result.returncode == 0, result.stderr[-4000:]
        got = {**torch.load(tmp_path / "stage0.pt"), **torch.load(tmp_path / "stage1.pt")}
        reference, scaler = _reference_half(getattr(torch, dtype), overflow_at=2 if overflow else None)
        for name, expected in reference.items():
            assert got[name].dtype == expected.dtype
            assert torch.equal(got[name], expected), name  # bit for bit: the same sums in the same order
        if overflow:
            scalers = [json.loads((tmp_path / f"scaler{rank}.json").read_text()) for rank in range(PP * DP)]
            assert scalers == [scaler] * (PP * DP)
            assert scaler["skipped"] >= 1  # the injected overflow at least (fp16 may overflow early on its own)
    finally:
        for daemon in daemons:
            daemon.kill()


@pytest.mark.slow
def test_in_process_optimizer_path_matches_too(tmp_path):
    result = torchrun(tmp_path, "--schedule", "1f1b")
    assert result.returncode == 0, result.stderr[-4000:]
    _assert_close(tmp_path)


@pytest.mark.slow
def test_a_rank_that_dies_mid_run_fails_the_job_with_its_name_instead_of_hanging(tmp_path):
    daemons = [LocalDaemon(tmp_path / f"d{i}") for i in range(2)]
    try:
        started = time.monotonic()
        result = torchrun(tmp_path, "--daemons", ",".join(d.address for d in daemons), "--die", "3@2")
        elapsed = time.monotonic() - started
        assert result.returncode != 0
        assert "exitcode  : 17" in result.stderr and "rank      : 3" in result.stderr, result.stderr[-3000:]
        assert elapsed < 120, elapsed
        assert not list(tmp_path.glob("stage*.pt"))
    finally:
        for daemon in daemons:
            daemon.kill()


@pytest.mark.slow
def test_onebit_compressed_all_reduce_keeps_replicas_identical_and_the_update_on_course(tmp_path):
    """1-bit all-reduce with error feedback after 2 plain steps (in-process AdamW, which
    would let replicas drift apart if their reduced gradients differed in one bit): each
    replica saves its stage, and the parameters move as the exact run's do, not equal."""
    result = torchrun(tmp_path, "--dp-compression", "onebit", "--compression-warmup-steps", "2", "--save-replicas")
    assert result.returncode == 0, result.stderr[-4000:]
    replicas = [{**torch.load(tmp_path / f"stage0.replica{r}.pt"), **torch.load(tmp_path / f"stage1.replica{r}.pt")}
                for r in range(DP)]  # fmt: skip
    assert sorted(replicas[0]) == sorted(replicas[1])
    for name, value in replicas[0].items():
        assert torch.equal(value, replicas[1][name]), name
    initial = torch.nn.Sequential(*pipeline_mlp.layers()).state_dict()
    reference = _reference()
    for name, exact in reference.items():
        got, start = replicas[0][name], initial[name]
        moved, exact_moved = (got - start).flatten(), (exact - start).flatten()
        off = float((moved - exact_moved).norm() / exact_moved.norm())
        assert 1e-4 < off < 0.5, (name, off)  # compressed (not exact), yet close to the exact move
        cosine = float(torch.nn.functional.cosine_similarity(moved, exact_moved, dim=0))
        assert cosine > 0.9, (name, cosine)
