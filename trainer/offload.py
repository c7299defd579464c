"""`offload(model, daemons=..., optimizer=...)`: an optimizer whose state lives on the daemons.

    opt = trainer.offload(model, daemons=["127.0.0.1:50051"], optimizer=trainer.AdamW(lr=3e-4))
    loss.backward(); opt.step(); opt.zero_grad()

The model's parameters and gradients are re-pointed into two flat fp32 buffers laid out as
the shard plan (trainer/flat.py; spec order = `named_parameters()` order, which is the
forward order for sequential models). A push sends a slice of the gradient buffer as is, and a pull writes
straight into the parameter buffer, so neither side copies per parameter.

`step()` pushes every shard's gradient and returns once the daemons have acknowledged them;
the pulls of the new parameters run on in the background, in forward order, and each
module's forward pre-hook waits only for the shards its own parameters live in, so the next
forward starts while later shards are still arriving. When the pulls are in, each daemon is
told which of its shards the next step pushes first (`ClientConfig.prefetch_hints`), so a
daemon whose state exceeds its RAM reads them back while the trainer computes.

`OffloadConfig(staleness=1)` is the delayed parameter update of the ZeRO-Offload paper: the daemons apply
step t's gradients while the trainer computes step t+1 on the parameters it already has, so
the optimizer, the pushes and the pulls leave the critical path. Step t+1's gradients are
then taken at the parameters of step t-1 (one step stale; the first step is exact) and are
applied to those of step t. It costs a second parameter buffer (the next values land there
while the forward reads the current ones) and a second gradient buffer (the pushes read it
while backward writes the next gradients).

`CompressionConfig(method=...)` sends each shard's gradient as bf16, fp16, 1-bit signs with a
scale per 1024 elements, or the top `topk_ratio` of each 1024 elements, with error feedback
(trainer/push_compression.py), after `warmup_steps` uncompressed steps. Under
AdamW "onebit" is 1-bit Adam: the trainer keeps the momentum and sends it as signs, the
daemons freeze the variance and apply the signs with a fused kernel.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch
from torch import nn

from ps_offload.proto import ps_pb2
from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.client import ShardedClient
from ps_offload.trainer.config import (
    AdamW,
    ClientConfig,
    CompressionConfig,
    OffloadConfig,
    OptimizerConfig,
    expect_config,
)
from ps_offload.trainer.flat import FlatParams
from ps_offload.trainer.push_compression import PushCompressor, check_compression

log = logging.getLogger(__name__)


def offload(
    model: nn.Module,
    *,
    daemons: list[str],
    optimizer: OptimizerConfig,
    no_weight_decay: Callable[[str, nn.Parameter], bool] | None = None,
    config: OffloadConfig | None = None,
    compression: CompressionConfig | None = None,
    client: ClientConfig | None = None,
) -> OffloadOptimizer:
    """Registers `model` with the daemons and returns its optimizer.

    daemons: the ordered daemon list (part of the shard plan; see `daemon_addresses()`).
    optimizer: AdamW or SGD, run by the daemons.
    no_weight_decay: (name, param) -> True for parameters that get no weight decay
        (nanoGPT's rule is `param.dim() < 2`).
    config: model name, shard size, staleness (delayed update), push share.
    compression: how the gradients travel; `opt.bytes_pushed` counts what was sent.
    client: timeouts, retries, transport, TLS and token.
    """
    return OffloadOptimizer(
        model,
        daemons=daemons,
        optimizer=optimizer,
        no_weight_decay=no_weight_decay,
        config=config,
        compression=compression,
        client=client,
    )


class OffloadOptimizer:
    """A StepOptimizer (trainer/optim.py) whose state and update live on the daemons."""

    def __init__(
        self,
        model: nn.Module,
        *,
        daemons: list[str],
        optimizer: OptimizerConfig,
        no_weight_decay: Callable[[str, nn.Parameter], bool] | None = None,
        config: OffloadConfig | None = None,
        compression: CompressionConfig | None = None,
        client: ClientConfig | None = None,
        before_push: Callable[[], None] | None = None,
    ) -> None:
        """`before_push`: called on every step just before the pushes (see below)."""
        config = expect_config(config, OffloadConfig, "config")
        compression = expect_config(compression, CompressionConfig, "compression")
        client = expect_config(client, ClientConfig, "client")
        adam = isinstance(optimizer, AdamW)
        check_compression(compression.method, compression.warmup_steps, compression.topk_ratio, adam=adam)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        for name, p in named:
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise ValueError(
                    f"parameter {name!r} is {p.dtype} on {p.device}; this release offloads float32 CPU parameters only"
                )
        share, of = config.push_share
        self.config = config
        self.optimizer = optimizer
        self.lr = optimizer.lr  # set it between steps to follow a schedule
        self.client = ShardedClient(daemons, config=client)

        spec = ps_pb2.ModelSpec(model=config.model_name, optimizer=optimizer.to_proto(), shard_bytes=config.shard_bytes)
        for name, p in named:
            param = spec.params.add(name=name, shape=list(p.shape), dtype=ps_pb2.FLOAT32)
            if no_weight_decay is not None and no_weight_decay(name, p):
                param.weight_decay = 0.0
        self.plan: list[ShardSlice] = self.client.register(spec)
        self._pushes = {s.shard_id for i, s in enumerate(self.plan) if i % of == share}
        self._hints = share == 0

        self.flat = FlatParams(named)
        if self.flat.numel != self.plan[-1].end:
            raise RuntimeError(
                f"the flat buffers hold {self.flat.numel} elements, the shard plan {self.plan[-1].end}: "
                "trainer/flat.py and ps_proto/plan.py disagree on the layout"
            )
        self.params = self.flat.params
        self._param_bytes = _byte_view(self.flat.values)
        self.staleness = config.staleness
        # Each shard's gradient payload (compressed with error feedback, or the raw slice).
        self._compressor = PushCompressor(
            compression.method,
            self.flat.numel,
            warmup_steps=compression.warmup_steps,
            topk_ratio=compression.topk_ratio,
            adam_beta1=optimizer.betas[0] if adam else None,
        )
        # Payload bytes of this process's gradient pushes that the daemons applied: each
        # (shard, step) once, headers and resent attempts not counted.
        self.bytes_pushed = 0
        self._bytes_lock = threading.Lock()
        # Data-parallel replicas that share a stage's pushes pass a barrier over their
        # group here: under staleness=1 no replica may push step t+1 before every replica
        # has pulled the parameters of step t.
        self._before_push = before_push
        if self.staleness:
            self._next_params = torch.empty_like(self.flat.values)
            self._sent_grads = torch.empty_like(self.flat.grads)
            self._next_param_bytes = _byte_view(self._next_params)
        # staleness=1: the step whose pushes and pulls are under way, (step, lr, their
        # futures); futures None means they failed and are to be submitted again.
        self._delayed: tuple[int, float, list[Future] | None] | None = None

        workers = max(2, self.client.config.streams_per_daemon * len(daemons))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ps-io")
        self._pending_pulls: dict[int, Future] = {}
        self._hooks = self._install_forward_hooks(model)
        self.step_count = self._attach()

    # -- start-up ------------------------------------------------------------------------

    def _attach(self) -> int:
        """Fresh model: pushes this process's initial values. Known model: resumes from the
        daemons' values (every shard must be at the same version)."""
        created = self.client.created
        if all(created):
            initial = ps_pb2.PARAMETERS
            self._run_all(lambda s: self.client.push(s, step=0, kind=initial, data=self._params_of(s), lr=None))
            return 0
        if any(created):
            fresh = [self.client.daemons[i] for i, c in enumerate(created) if c]
            raise RuntimeError(
                f"daemons {fresh} did not know model {self.client.model!r} while the others did: "
                "their state was lost (restarted without persistence?). Re-register under a new name."
            )
        versions = self._run_all(lambda s: self._pull(s, 0, self._params_of(s)))
        if len(set(versions)) != 1:
            raise RuntimeError(f"shards are at different versions {sorted(set(versions))}; cannot resume")
        momentum = self._compressor.momentum
        if momentum is not None:  # 1-bit Adam goes on from the daemons' exp_avg
            into = _byte_view(momentum)
            self._run_all(
                lambda s: (
                    self.client.pull(s, min_version=0, out=_shard_bytes(into, s), tensor=ps_pb2.EXP_AVG)
                    if s.shard_id in self._pushes
                    else None
                )
            )
        log.info("resumed model %r at step %d", self.client.model, versions[0])
        return versions[0]

    def _params_of(self, shard: ShardSlice) -> memoryview:
        return _shard_bytes(self._param_bytes, shard)

    def _run_all(self, fn: Callable[[ShardSlice], object]) -> list:
        futures = [self._pool.submit(fn, s) for s in self.plan]
        return [f.result() for f in futures]

    def _install_forward_hooks(self, model: nn.Module) -> list:
        """A pre-hook on every module that owns parameters: wait for their shards' pulls."""
        position = {id(p): i for i, p in enumerate(self.params)}
        hooks = []
        for module in model.modules():
            owned = [position[id(p)] for p in module.parameters(recurse=False) if id(p) in position]
            if not owned:
                continue
            shard_ids = sorted({s.shard_id for i in owned for s in self._shards_of(i)})
            hooks.append(module.register_forward_pre_hook(lambda _m, _a, ids=shard_ids: self._wait_for(ids)))
        return hooks

    def _shards_of(self, param_index: int) -> list[ShardSlice]:
        start, end = self.flat.param_range(param_index)
        return [s for s in self.plan if s.offset < end and start < s.end] if end > start else []

    # -- the training loop ---------------------------------------------------------------

    def _wait_for(self, shard_ids: list[int]) -> None:
        for shard_id in shard_ids:
            future = self._pending_pulls.pop(shard_id, None)
            if future is not None:
                future.result()

    def synchronize(self) -> None:
        """Waits until every pull of the last step has landed in the parameters. Call it
        before reading parameters outside a forward pass (evaluation, saving). Under
        staleness=1 this also brings in the last step's update, so the parameters are the
        daemons' newest, and the next step computes on them."""
        self._wait_for(list(self._pending_pulls))
        self._settle_delayed()

    def zero_grad(self) -> None:
        self.flat.zero_grads()

    def step(self) -> None:
        """Pushes all gradients of this step (returns when the daemons acknowledged them)
        and starts pulling the updated parameters in forward order. Under staleness=1 it
        returns at once: the pushes and pulls run during the next forward and backward."""
        if self.staleness:
            self._step_delayed()
            return
        self.synchronize()
        self.flat.adopt_grads()
        if self._before_push is not None:
            self._before_push()
        step, lr = self.step_count, float(self.lr)
        pushes, pulls = self._submit(step, lr, grads=self.flat.grads, params=self._param_bytes)
        self._pending_pulls.update(pulls)
        wait(pushes)
        error = _first_error(pushes)
        if error is not None:
            # The step did not happen as a whole: drop its pulls (they fail with their push)
            # so the error is raised once, here, and the caller may retry step().
            wait(self._pending_pulls.values())
            self._pending_pulls.clear()
            raise error
        self.step_count = step + 1
        self._hint_after(list(pulls.values()))

    def _step_delayed(self) -> None:
        # The previous step's update must be in before this step's gradients go out: a
        # daemon applies step t only at version t.
        self._settle_delayed()
        self.flat.adopt_grads()
        if self._before_push is not None:
            self._before_push()
        # Backward writes the next step's gradients while these are on the wire.
        self._sent_grads.copy_(self.flat.grads)
        step, lr = self.step_count, float(self.lr)
        _, pulls = self._submit(step, lr, grads=self._sent_grads, params=self._next_param_bytes)
        self._delayed = (step, lr, list(pulls.values()))
        self.step_count = step + 1
        self._hint_after(self._delayed[2])

    def _settle_delayed(self) -> None:
        """Waits for the delayed step's pushes and pulls and moves its parameters in. If
        any failed, raises, and the next call submits that step again (a push is applied
        at most once per (shard, step), so resubmitting all of them is safe)."""
        if self._delayed is None:
            return
        step, lr, tasks = self._delayed
        if tasks is None:
            _, pulls = self._submit(step, lr, grads=self._sent_grads, params=self._next_param_bytes)
            tasks = list(pulls.values())
        wait(tasks)
        error = _first_error(tasks)
        if error is not None:
            self._delayed = (step, lr, None)
            raise error
        self._delayed = None
        self.flat.values.copy_(self._next_params)

    def _submit(
        self, step: int, lr: float, *, grads: torch.Tensor, params: memoryview
    ) -> tuple[list[Future], dict[int, Future]]:
        """One task per shard, in forward order: push its gradient (this process's share)
        and then pull its new version, or only pull the version another process pushes.
        Returns the push acknowledgements and, per shard, the pull.

        Push and pull share a task because, on a daemon whose state exceeds its RAM, the
        shard is still resident right after its push; pulled later, it would be read back
        from disk (measured: twice the state read per step instead of once)."""
        pushes: list[Future] = []
        pulls: dict[int, Future] = {}
        # Once one shard's call has failed (after its retries), the step has failed: the
        # shards still queued give up at once instead of each waiting out its own retries
        # against a daemon that is down.
        failed = threading.Event()
        for shard in self.plan:
            into = _shard_bytes(params, shard)
            if shard.shard_id in self._pushes:
                pushed = Future()
                pushes.append(pushed)
                task = self._pool.submit(self._push_then_pull, shard, step, lr, grads, into, pushed, failed)
            else:
                task = self._pool.submit(self._pull, shard, step + 1, into, failed)
            pulls[shard.shard_id] = task
        return pushes, pulls

    def _hint_after(self, pulls: list[Future]) -> None:
        if self.client.config.prefetch_hints and self._hints and self.client.nvme_daemons:
            # Submitted after the pulls, so they have all left the queue (FIFO) when this
            # task starts waiting on them: it cannot hold up a pull it waits for.
            self._pool.submit(self._hint_next_step, pulls)

    def _hint_next_step(self, pulls: list[Future]) -> None:
        """Once this step's pulls are in, the daemons are idle until the next step's
        pushes: hint those, in push order (plan order)."""
        wait(pulls)
        if all(f.exception() is None for f in pulls):
            self.client.hint([s.shard_id for s in self.plan])

    def _push_then_pull(
        self,
        shard: ShardSlice,
        step: int,
        lr: float,
        grads: torch.Tensor,
        into: memoryview,
        pushed: Future,
        failed: threading.Event,
    ) -> int:
        try:
            if failed.is_set():
                raise StepAbandoned(f"push of shard {shard.shard_id} step {step} not sent: another shard failed")
            # Compressed here, in the pool: shard i is compressed while shard i-1 is on the wire.
            payload = self._compressor.payload(shard, step, grads)
            ack = self.client.push(
                shard, step=step, kind=payload.kind, data=payload.data, lr=lr, encoding=payload.encoding,
                variance_frozen_at=payload.variance_frozen_at,
            )  # fmt: skip
            if ack.applied:
                with self._bytes_lock:
                    self.bytes_pushed += len(payload.data)
        except BaseException as exc:
            failed.set()
            pushed.set_exception(exc)
            raise
        pushed.set_result(ack)
        return self._pull(shard, step + 1, into, failed)

    def _pull(self, shard: ShardSlice, version: int, into: memoryview, failed: threading.Event | None = None) -> int:
        if failed is not None and failed.is_set():
            raise StepAbandoned(f"pull of shard {shard.shard_id} version {version} not sent: another shard failed")
        try:
            return self.client.pull(shard, min_version=version, out=into)
        except BaseException:
            if failed is not None:
                failed.set()
            raise

    def close(self) -> None:
        try:
            self.synchronize()
        finally:
            for hook in self._hooks:
                hook.remove()
            self._pool.shutdown(wait=True)
            self.client.close()

    def __enter__(self) -> OffloadOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StepAbandoned(RuntimeError):
    """A shard's call not made because another shard of the same step had failed."""


def _first_error(futures: list[Future]) -> BaseException | None:
    """The error that failed the step (not the calls abandoned because of it)."""
    errors = [f.exception() for f in futures if f.exception() is not None]
    return next((e for e in errors if not isinstance(e, StepAbandoned)), errors[0] if errors else None)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.numpy()).cast("B")


def _shard_bytes(view: memoryview, shard: ShardSlice) -> memoryview:
    return view[shard.offset * 4 : shard.end * 4]
