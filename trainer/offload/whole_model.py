"""OffloadOptimizer, what `offload(model, daemons=..., optimizer=...)` (ps_offload.trainer.api)
returns for a model held whole on the trainer: a torch optimizer whose state lives on the daemons.

    model = build_model().to("cuda", dtype=torch.bfloat16)      # or fp32, fp16; or the CPU
    opt = ps_offload.offload(model, daemons=["127.0.0.1:50051"], optimizer=ps_offload.AdamW(lr=3e-4))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10_000)
    loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(); sched.step()

The daemons keep the fp32 master values and the optimizer state; the trainer keeps only its
compute copy, in the model's dtype on its device. The model's parameters and gradients are
re-pointed into two flat buffers laid out as the shard plan (trainer/io/flat.py; spec order =
`named_parameters()` order, the forward order for sequential models), and a shard is one
slice of each. Shards travel in the compute dtype (trainer/io/device.py): a bf16 model pushes
bf16 gradients, which the daemon widens exactly, and pulls bf16 values, which the daemon
rounds from its master as `Tensor.to` does. So a bf16 model trained here equals, bit for bit,
one trained in process with an fp32 master copy and torch.optim.AdamW(fused=True).

It is a torch.optim.Optimizer: `param_groups` (lr, betas, eps, weight_decay; SGD's momentum
and dampening) go to the daemons with every step (trainer/offload/param_groups.py), so torch's LR
schedulers and Hugging Face's Trainer drive it as they drive torch.optim.AdamW.
`clip_grad_norm_` on the model works as usual: the gradients are read at `step()`.

`step()` pushes every shard's gradient and returns once the daemons have acknowledged them;
the pulls of the new parameters run on in the background, in forward order, and each
module's forward pre-hook waits only for the shards its own parameters live in, so the next
forward starts while later shards are still arriving. When the pulls are in, each daemon
with an NVMe tier is told which of its shards the next step pushes first
(`ClientConfig.prefetch_hints`), so it reads them back while the trainer computes.

float16 parameters get dynamic loss scaling (`opt.scale_loss(loss).backward()`,
trainer/offload/loss_scale.py): a step with an inf or a NaN in its gradients is skipped, nothing
is pushed and no version moves.

`state_dict()` has torch's shape ("state", "param_groups") and names, under "ps_offload", the
model and the version on the daemons it belongs to; the optimizer state itself stays on the
daemons, which keep their newest version durably. `load_state_dict()` restores the groups
(and the loss scale) and refuses a state dict of another version than the daemons hold.

`OffloadConfig(staleness=1)` is the delayed parameter update of the ZeRO-Offload paper: the
daemons apply step t's gradients while the trainer computes step t+1 on the parameters it
already has, so the optimizer, the pushes and the pulls leave the critical path. Step t+1's
gradients are then taken at the parameters of step t-1 (one step stale; the first step is
exact) and are applied to those of step t. It costs a second parameter buffer and a second
gradient buffer on the trainer's device.

`CompressionConfig(method=...)` sends each shard's gradient (widened to fp32 when the model is
bf16 or fp16, compressed on its device, error feedback there) as bf16, fp16,
1-bit signs with a scale per 1024 elements, or the top `topk_ratio` of each 1024 elements,
with error feedback (trainer/io/push_compression.py), after `warmup_steps` uncompressed steps.
Under AdamW "onebit" is 1-bit Adam: the trainer keeps the momentum and sends it as signs, the
daemons freeze the variance and apply the signs with a fused kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, wait

import torch
from torch import nn

from ps_offload.optimizers import plugin_of
from ps_offload.proto.plan import ShardSlice
from ps_offload.trainer.config import (
    ClientConfig,
    CompressionConfig,
    DeviceConfig,
    LossScaling,
    OffloadConfig,
    OptimizerConfig,
    expect_config,
)
from ps_offload.trainer.io.device import WIRE_DTYPES, ShardMover
from ps_offload.trainer.io.flat import FlatParams
from ps_offload.trainer.io.push_compression import PushCompressor, check_compression
from ps_offload.trainer.io.shard_io import ShardIO, StepSettings, first_error
from ps_offload.trainer.offload.audit import ParityAudit, check_auditable
from ps_offload.trainer.offload.backward_push import BackwardPushes
from ps_offload.trainer.offload.daemon_optimizer import DaemonOptimizer, check_uniform
from ps_offload.trainer.offload.forward_waits import ForwardWaits
from ps_offload.trainer.offload.loss_scale import found_inf
from ps_offload.trainer.offload.param_binding import ParamBinding, ParameterChanged

log = logging.getLogger(__name__)


class OffloadOptimizer(DaemonOptimizer):
    """A torch.optim.Optimizer (trainer/offload/daemon_optimizer.py), and a StepOptimizer
    (trainer/pipeline/local_optimizer.py), whose state and update live on the daemons."""

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
        device: DeviceConfig | None = None,
        loss_scaling: LossScaling | None = None,
        before_push: Callable[[], None] | None = None,
        any_rank: Callable[[bool], bool] | None = None,
    ) -> None:
        """`before_push`: called on every step just before the pushes (see below).
        `any_rank(flag)`: whether `flag` is set on any rank of the job (a PipelineTrainer's
        all-reduce), so an overflow on one rank skips the step on all."""
        config = expect_config(config, OffloadConfig, "config")
        compression = expect_config(compression, CompressionConfig, "compression")
        device = expect_config(device, DeviceConfig, "device")
        adam = plugin_of(optimizer).takes_momentum  # (1-bit Adam's momentum pushes: AdamW)
        check_compression(compression.method, compression.warmup_steps, compression.topk_ratio, adam=adam)
        check_auditable(config, compression, optimizer)
        if config.state_dtype != "float32" and adam and compression.method == "onebit":
            raise ValueError(
                "1-bit Adam (CompressionConfig(method='onebit') with AdamW) keeps the momentum in fp32 on the daemons: "
                "not with OffloadConfig.state_dtype='bfloat16'"
            )
        if config.push_in_backward and compression.method != "none":
            raise ValueError("OffloadConfig.push_in_backward sends gradients as they are: not with compression")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        check_uniform(named)
        super().__init__(
            named, daemons=daemons, optimizer=optimizer, no_weight_decay=no_weight_decay, config=config,
            client=client, loss_scaling=loss_scaling,
        )  # fmt: skip
        share, of = config.push_share

        self.flat = FlatParams(named, shared=self.client.transports.shared_host_tensor)
        if self.flat.numel != self.plan[-1].end:
            raise RuntimeError(
                f"the flat buffers hold {self.flat.numel} elements, the shard plan {self.plan[-1].end}: "
                "trainer/io/flat.py and ps_proto/plan.py disagree on the layout"
            )
        self.params = self.flat.params
        self._device_config = device
        self.mover = ShardMover(
            self.flat.values,
            max(s.numel for s in self.plan),
            config=device,
            shared=self.client.transports.shared_host_tensor,
        )
        self.staleness = config.staleness
        self.io = ShardIO(
            self.client,
            self.mover,
            pushes={s.shard_id for i, s in enumerate(self.plan) if i % of == share},
            hints=share == 0,
            # Each shard's gradient payload, compressed with error feedback on the gradients' device.
            compressor=PushCompressor(
                compression.method, self.flat.numel, warmup_steps=compression.warmup_steps,
                topk_ratio=compression.topk_ratio, adam_beta1=optimizer.betas[0] if adam else None,
                device=self.flat.grads.device,
            ) if compression.method != "none" else None,
        )  # fmt: skip
        # Data-parallel replicas that share a stage's pushes pass a barrier over their
        # group here: under staleness=1 no replica may push step t+1 before every replica
        # has pulled the parameters of step t.
        self._before_push = before_push
        self._any_rank = any_rank
        if self.staleness:  # where the pulls land and the pushes are read: shared with the node's daemon too
            self._next_params, self._sent_grads = (
                FlatParams.buffer_like(self.flat.values, self.client.transports.shared_host_tensor) for _ in range(2)
            )
        # staleness=1: the step whose pushes and pulls are under way, (step, its groups,
        # multiplier, futures); futures None means they failed and are to be submitted again.
        self._delayed: tuple[int, list, float | None, list[Future] | None] | None = None

        self._pending_pulls: dict[int, Future] = {}
        self._model = model
        self._hooks = self._install_forward_hooks(model)
        # Checked at every step: the model still trains with the tensors updated here.
        self._binding = ParamBinding(model, [n for n, _ in named], self.flat)
        self.step_count = self.io.attach(self.flat.values)
        self.audit = ParityAudit(self, config)  # every config.audit_every steps (trainer/offload/audit.py)
        self._clip_coefficient: float | None = None  # from clip_grad_norm_, for the next step
        self._backward_pushes: BackwardPushes | None = None
        if config.push_in_backward:
            self._backward_pushes = BackwardPushes(
                self.flat,
                [s for s in self.plan if s.shard_id in self.io.pushes],
                self._shards_of,
                lambda shard: self.io.push_part(shard, self.step_count, self.flat.grads, self._expected_settings()),
            )
        self.say_if_resumed()

    # -- start-up ------------------------------------------------------------------------

    def _install_forward_hooks(self, model: nn.Module) -> ForwardWaits:
        """Each module's forward waits for the pulls of the shards it reads
        (trainer/offload/forward_waits.py: its own parameters', and those of children it
        reads without calling them)."""
        position = {id(p): i for i, p in enumerate(self.params)}
        own = {}
        for module in model.modules():
            owned = [position[id(p)] for p in module.parameters(recurse=False) if id(p) in position]
            own[module] = sorted({s.shard_id for i in owned for s in self._shards_of(i)})
        return ForwardWaits(model, own, wait=self._wait_for, wait_all=lambda: self._wait_for(list(self._pending_pulls)))

    def _shards_of(self, param_index: int) -> list[ShardSlice]:
        start, end = self.flat.param_range(param_index)
        return [s for s in self.plan if s.offset < end and start < s.end] if end > start else []

    def _expected_settings(self) -> StepSettings | None:
        """During backward: what step() will most likely send, so that the daemons can compute
        the step now (ps_offload.daemon.store.speculation): the param groups as they are (a
        scheduler steps after step()), the loss scale's multiplier, and no clip. If step()
        sends others (a clip that fires, an overflow, a changed lr), the daemons compute it
        again from the part they hold: the result is the same either way. None (the daemons
        wait for step()) where the groups are not what the daemons can follow."""
        try:
            groups = self._groups.hyperparams(self.param_groups)
        except ValueError:
            return None  # step() raises it
        return groups, self.loss_scaler.grad_multiplier if self.loss_scaler is not None else None

    # -- the torch.optim.Optimizer face ----------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's (FlatParams.zero_grads)."""
        self.flat.zero_grads(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over this optimizer's parameters, with the scaling
        left to the daemons: the gradients stay as backward left them (so shards pushed during
        backward stay usable) and the next step() multiplies them by the clip coefficient, in
        fp32, on the daemons. Returns the total norm (of the unscaled gradients under fp16
        loss scaling). For fp32 gradients the update is torch's clip_grad_norm_ and step,
        bit for bit: the same norm, coefficient and fp32 product. For bf16/fp16 gradients the
        product is taken in fp32 on the daemon, where torch's clip rounds it to the gradient's
        dtype."""
        grads = [p.grad for p in self.params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type)
        if self.loss_scaler is not None:
            total = total / self.loss_scaler.scale
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's own expression
        self._clip_coefficient = float(coefficient.float())
        return total

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

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Pushes all gradients of this step (returns when the daemons acknowledged them)
        and starts pulling the updated parameters in forward order. Under staleness=1 it
        returns at once: the pushes and pulls run during the next forward and backward."""
        self.check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow_model()  # before anything is pushed: refuses, or adopts moved parameters
        groups = self._groups.hyperparams(self.param_groups)  # refuses what the daemons cannot follow
        parts: dict[int, Future] = {}
        if self._backward_pushes is not None:  # before adopt_grads, which may write (zeros)
            parts = self._backward_pushes.usable_parts()
            self._backward_pushes.reset()
        if self.staleness:
            self._settle_delayed()  # the daemons apply step t only at version t
        self.flat.adopt_grads()
        multiplier = None
        if self.loss_scaler is not None:
            overflow = found_inf(self.flat.grads)
            if self._any_rank is not None:
                overflow = self._any_rank(overflow)
            if overflow:
                self.loss_scaler.update(True)
                self._clip_coefficient = None
                if self._backward_pushes is not None:
                    self._backward_pushes.skipped()
                log.info("step %d skipped: inf or NaN in the gradients; loss scale now %g",
                         self.step_count, self.loss_scaler.scale)  # fmt: skip
                return loss
            multiplier = self.loss_scaler.grad_multiplier
        if self._clip_coefficient is not None:
            clip, self._clip_coefficient = self._clip_coefficient, None
            # fp32 product, as the daemons take the multiplier (1/scale is a power of two).
            multiplier = float(torch.tensor(clip if multiplier is None else clip * multiplier, dtype=torch.float32))
        if not self.staleness:
            self.synchronize()
        if self.client.holders.lost and not parts and self.config.push_share[1] == 1:
            # Between steps: no push in flight, every shard at step_count (a replicated model's
            # lost daemon, back or replaced, gets its shards copied before this step's pushes).
            # With pushes in backward this step's parts are out already: see the end of step().
            self.client.repair_lost(self.step_count)
        if self._before_push is not None:
            self._before_push()
        step = self.step_count
        if self.staleness:
            self._sent_grads.copy_(self.flat.grads)  # backward writes the next gradients meanwhile
            _, pulls = self.io.submit(step, (groups, multiplier), grads=self._sent_grads, params=self._next_params)
            self._delayed = (step, groups, multiplier, list(pulls.values()))
            self.step_count = step + 1
            self._finish_step()
            self.io.hint_after(self._delayed[3])
            return loss
        audit = self.audit.before_push(step, groups, multiplier, self.flat.grads)  # before the shard's push
        pushes, pulls = self.io.submit(
            step, (groups, multiplier), grads=self.flat.grads, params=self.flat.values, parts=parts
        )
        self._pending_pulls.update(pulls)
        wait(pushes)
        error = first_error(pushes)
        if error is not None:
            # The step did not happen as a whole: drop its pulls (they fail with their push)
            # so the error is raised once, here, and the caller may retry step().
            wait(self._pending_pulls.values())
            self._pending_pulls.clear()
            raise error
        self.step_count = step + 1
        self._finish_step()
        self.io.hint_after(list(pulls.values()))
        if self.client.holders.lost and self._backward_pushes is not None and self.config.push_share[1] == 1:
            # Every shard acknowledged at step_count and the next parts not yet begun (the
            # next backward pushes them): the one point between steps in this mode.
            self.client.repair_lost(self.step_count)
        self.audit.after_step(audit)  # raises AuditMismatch
        return loss

    def _finish_step(self) -> None:
        if self.loss_scaler is not None:
            self.loss_scaler.update(False)

    def _settle_delayed(self) -> None:
        """Waits for the delayed step's pushes and pulls and moves its parameters in. If
        any failed, raises, and the next call submits that step again (a push is applied
        at most once per (shard, step), so resubmitting all of them is safe)."""
        if self._delayed is None:
            return
        step, groups, multiplier, tasks = self._delayed
        if tasks is None:
            _, pulls = self.io.submit(step, (groups, multiplier), grads=self._sent_grads, params=self._next_params)
            tasks = list(pulls.values())
        wait(tasks)
        error = first_error(tasks)
        if error is not None:
            self._delayed = (step, groups, multiplier, None)
            raise error
        self._delayed = None
        self.flat.values.copy_(self._next_params)

    # -- a model moved or re-created after offload() ----------------------------------------

    def _follow_model(self) -> None:
        """Adopts the model's new tensors when its parameters were moved, cast or re-created
        with the values they had here (model.to(), .cuda(), .to(dtype), load_state_dict(
        assign=True) of the same weights, a wrapper); raises ParameterChanged, before any
        push, for what cannot be followed. See ps_offload.trainer.offload.param_binding."""
        changes = self._binding.changes()
        if not changes:
            return
        self.synchronize()  # the buffer compared below holds the daemons' newest values
        untied = self._binding.untied()
        if untied:
            raise ParameterChanged(
                f"parameters {untied} were one tensor when offload() registered the model and are different tensors "
                "now (tied weights untied): re-tie them (model.tie_weights()) or build the optimizer after the change"
            )
        current = self._binding.current_params()
        try:
            check_uniform(current)
        except ValueError as exc:
            raise ParameterChanged(f"the model was moved in part: {exc}") from None
        device, dtype = current[0][1].device, current[0][1].dtype
        moved = (device, dtype) != (self.flat.values.device, self.flat.values.dtype)
        refusal = self._refuse_move(changes, dtype) if moved else None
        for change in changes:
            refusal = refusal or self._values_differ(change)
        if refusal:
            raise ParameterChanged(
                f"model {self.client.model!r}, before step {self.step_count}: parameter {refusal}. Nothing was pushed."
            )
        flat = FlatParams(current)  # re-points the model's tensors into new buffers
        old_groups = {id(old): new for old, (_, new) in zip(self.params, current, strict=True)}
        for group in self.param_groups:
            group["params"] = [old_groups.get(id(p), p) for p in group["params"]]
        self._groups.follow(self.param_groups)
        self.flat, self.params = flat, flat.params
        if moved:
            self.mover = ShardMover(flat.values, max(s.numel for s in self.plan), config=self._device_config)
            io = ShardIO(self.client, self.mover, pushes=self.io.pushes, hints=self.io.hints, compressor=None)
            io.bytes_pushed, old_io, self.io = self.io.bytes_pushed, self.io, io
            old_io.pool.shutdown(wait=True)
            # The compute copy is the daemons' master as this dtype rounds it (a bf16 model
            # cast to fp32 computes on the fp32 master, not on its widened bf16 values).
            after = self.mover.mark_compute()  # after FlatParams' fill of the new buffer
            versions = self.io.run_all(lambda s: self.io.pull(s, self.step_count, flat.values, after, None))
            if set(versions) != {self.step_count}:
                raise RuntimeError(f"re-pulling after the move found versions {sorted(set(versions))}")
            if self.staleness:
                self._next_params = torch.empty_like(flat.values)
                self._sent_grads = torch.empty_like(flat.grads)
        self._hooks.remove()
        self._hooks = self._install_forward_hooks(self._model)
        if self._backward_pushes is not None:
            self._backward_pushes.rebind(flat)
        self._binding.bind(flat)
        log.info("model %r: adopted the model's new tensors (%s on %s) before step %d: %s", self.client.model,
                 dtype, device, self.step_count, "; ".join(f"{c.name} {c.what}" for c in changes))  # fmt: skip

    def _refuse_move(self, changes: list, dtype: torch.dtype) -> str | None:
        """Why a change of device or dtype cannot be followed (None: it can)."""
        name = changes[0].name
        if dtype not in WIRE_DTYPES:
            return f"{name!r} is now {dtype}: offload() trains float32, bfloat16 or float16 parameters"
        if dtype == torch.float16 and self.loss_scaler is None:
            return f"{name!r} is now float16, which needs the loss scaling offload() sets up for a float16 model"
        if self.io.compressor is not None:
            return f"{name!r} {changes[0].what}: the compressor's error feedback lives on the old device and dtype"
        return None

    def _values_differ(self, change) -> str | None:
        """Why `change`'s new tensor is not the registered one moved or cast (None: it is)."""
        if change.removed:
            return f"{change.name!r} {change.what}"
        was = self.flat.value_view(change.index)
        now = change.current.detach()
        if tuple(now.shape) != tuple(was.shape):
            return f"{change.name!r} {change.what}"
        expected = was.to(now.device, now.dtype)
        if torch.equal(now, expected):
            return None
        difference = (now.float() - expected.float()).abs()
        return (
            f"{change.name!r} {change.what} and holds other values than the daemons' ({int((difference != 0).sum())} "
            f"of {now.numel()} elements differ, max |difference| {float(difference.max()):g}): the daemons would "
            "go on from their own values and silently discard these. To train from new weights, load them before "
            "offload() under a new model_name; if the model was moved while a step's pulls were landing, call "
            "opt.synchronize() first"
        )

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.synchronize()
        finally:
            self._hooks.remove()
            if self._backward_pushes is not None:
                self._backward_pushes.close()
            self.io.close()

    def __enter__(self) -> OffloadOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
