"""Training a model larger than the trainer: only a window of blocks on the device at a time.

    with torch.device("meta"):
        model = build_gpt(n_layer=48, n_embd=2560)          # no memory is allocated
    opt = ps_offload.offload(model, daemons=[...], optimizer=ps_offload.AdamW(lr=3e-4),
                             stream=ps_offload.Streaming(blocks=model.blocks, window_bytes=2 << 30))
    for micro_batch in batches:                              # any number of backward passes
        model(x).loss.backward()
    opt.step(); opt.zero_grad()

The daemons hold the fp32 master and the optimizer state, as for `offload()`; the trainer
holds, besides its activations, the parameters outside the blocks (resident) and at most a
window of blocks in the compute dtype (trainer/stream/units.py):

* Creation. A model built on the meta device is materialised, initialised (its modules'
  `reset_parameters`, or `Streaming.init`) and pushed one unit at a time, then freed.
* Forward. A block's pre-hook pulls its shards (version = the optimizer's step) unless a
  prefetch already has, and prefetches the blocks after it, in the order the first forward
  ran them, while their bytes fit in `window_bytes`; its post-hook frees it.
* Backward. A hook on the block's outputs pulls it again before its backward (and prefetches
  the blocks before it); each parameter's post-accumulate-grad hook copies its gradient into
  the block's flat gradient buffer and drops `.grad`; when the block's last parameter is done,
  the buffer is pushed (GRADIENT_PART, part = the backward pass's number since the last step)
  and the block is freed. Activation checkpointing composes: the re-forward inside backward
  finds the block already pulled and keeps it.
* Gradient accumulation. Each backward pass pushes every block once; the daemons add the
  parts in fp32 in part order (ps_daemon/store/accumulate.py) and `step()` applies them (APPLY, with
  the param groups' settings of that step). The trainer never holds a full-model gradient.
* One backward per step (`Streaming(micro_batches=1)`): each block's gradient is pushed as a
  GRADIENT with the param groups' settings at backward time, so the daemons step a block
  while backward goes on to the next, hold no accumulator, and `step()` only waits for them.

`step()` raises `StepLost` when a daemon no longer holds a part it was sent (it restarted
between micro-batches): run the step's micro-batches again, on the same data, and call
`step()` again. Parts the other daemons still hold are not added twice (a part is applied at
most once per shard, step and number), so the result equals a step that never failed: no
daemon applies a step before every daemon has confirmed it holds all of the step's parts
(APPLY check_only). A daemon that restarts in the moment between that check and its APPLY
leaves the step applied by some daemons only: `StepTorn` says so and names them. (With
micro_batches=1 a push is applied when it arrives, so there is nothing to lose between
micro-batches; a push that fails for good after its retries fails the step, as in offload().)

In a PipelineTrainer stage (trainer/pipeline/trainer.py) the stage's dp replicas sum each block's
gradient of a pass over their group (`reduce_gradient`) and each pushes its share of the
shards; the check before APPLY is agreed by every rank of the job (`any_rank`), so a lost part
fails the step everywhere, and the APPLY scales the sum by 1 / (dp x micro-batches).

Not yet: float16 (loss scaling), compression, staleness=1, and clip_grad_norm_ over more than
one backward pass; each is refused at offload() or at the call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten

from ps_offload.proto import ps_pb2
from ps_offload.proto.memory import mem_available, return_freed_blocks
from ps_offload.proto.plan import ShardSlice
from ps_offload.proto.push import Push
from ps_offload.trainer.config import ClientConfig, DeviceConfig, OffloadConfig, OptimizerConfig, expect_config
from ps_offload.trainer.io.device import ShardMover, byte_view
from ps_offload.trainer.io.shard_io import ShardIO, first_failure
from ps_offload.trainer.offload.daemon_optimizer import DaemonOptimizer
from ps_offload.trainer.stream.apply import PartsApplier
from ps_offload.trainer.stream.grads import BlockGradients
from ps_offload.trainer.stream.settings import Streaming
from ps_offload.trainer.stream.units import StreamUnit, initialise, share_units, stream_units
from ps_offload.trainer.stream.window import BlockWindow, wait_all

log = logging.getLogger(__name__)


class StreamedOptimizer(DaemonOptimizer):
    """A torch.optim.Optimizer for a model streamed block by block (the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        stream: Streaming,
        *,
        daemons: list[str],
        optimizer: OptimizerConfig,
        no_weight_decay: Callable[[str, nn.Parameter], bool] | None = None,
        config: OffloadConfig | None = None,
        client: ClientConfig | None = None,
        device: DeviceConfig | None = None,
        reduce_gradient: Callable[[torch.Tensor], None] | None = None,
        any_rank: Callable[[bool], bool] | None = None,
        gradient_scale: float = 1.0,
    ) -> None:
        """The last three are a PipelineTrainer stage's (trainer/pipeline/trainer.py), whose dp replicas
        share the pushes (`config.push_share`): `reduce_gradient(buffer)` sums a block's
        gradient over the replicas in place before each pushes its share; `any_rank(flag)`
        says whether any rank of the job has `flag` set (a step fails on every rank or on none);
        `gradient_scale` multiplies the accumulated gradient in the APPLY (1 / (dp x micro-batches))."""
        config = expect_config(config, OffloadConfig, "config")
        device_config = expect_config(device, DeviceConfig, "device")
        if config.staleness or config.push_in_backward:
            raise ValueError(
                "streaming pushes each block in its backward and applies at step(): it takes staleness=0 and "
                "push_in_backward=False"
            )
        if config.audit_every:
            raise ValueError(
                "OffloadConfig.audit_every is not run for streamed models yet (their pushes are applied as parts): "
                "set audit_every=0 with stream=..."
            )
        if config.push_share != (0, 1) and stream.micro_batches == 1:
            raise ValueError("Streaming(micro_batches=1) applies pushes on arrival: it takes push_share=(0, 1)")
        first = next(model.parameters(), None)
        if first is not None and first.dtype == torch.float16:
            raise ValueError("streaming float16 models (loss scaling) is not supported yet: use bfloat16 or float32")
        where = _device_of(model, stream.device)
        self.units, self._owners = stream_units(model, stream.blocks, where)
        named = [(n, p) for unit in self.units for n, p in zip(unit.names, unit.params, strict=True)]
        super().__init__(
            named, daemons=daemons, optimizer=optimizer, no_weight_decay=no_weight_decay, config=config,
            client=client, loss_scaling=None, starts_shard={unit.names[0] for unit in self.units[1:]},
        )  # fmt: skip
        for unit in self.units:
            unit.shards = [s for s in self.plan if unit.start <= s.offset < unit.end]
            if sum(s.numel for s in unit.shards) != unit.numel:
                raise RuntimeError(f"the shard plan does not start a shard at unit {unit.names[0]!r}")
        self.stream = stream
        self.params = [p for _, p in named]
        like = torch.empty(0, dtype=named[0][1].dtype, device=where)
        # In windows of the node's pool, so the node's daemon pulls into and pushes from them in
        # place: a CPU model's blocks (at fixed addresses over a few reused slots, as many as the
        # window holds blocks), and the host buffers (a GPU's staging).
        self.shared_blocks = share_units(
            self.units, self.client.transports.host_windows.slot_region, window_bytes=stream.window_bytes
        )
        # What a block's forward and backward free (its temporaries: a widened weight, a
        # gradient, a large activation) goes back to the kernel (ps_proto/memory.py) where the
        # host is short of memory: kept in malloc's heap, between small allocations that live
        # on until backward, it stays resident, and RSS grows with the depth (the scale run's
        # blocks, n_embd 2560, bf16: peak RSS 1.50 GB at 6 blocks and 1.81 at 12 kept, 1.31
        # and 1.35 returned; 3.78 GiB at 54 kept). Returned, every such allocation faults a page
        # at a time when written: 550k faults and 1.6-1.9 s of system time in a 7 s step of
        # zero_infinity_large's trainer. Streaming.returns_freed decides.
        model_bytes = sum(unit.nbytes for unit in self.units)
        self.returns_freed = stream.returns_freed(model_bytes, mem_available())
        if self.returns_freed:
            return_freed_blocks()
        log.info(
            "streamed model of %d MiB: freed host memory %s", model_bytes >> 20,
            "goes back to the kernel" if self.returns_freed else "stays in malloc's heap",
        )  # fmt: skip
        self.mover = ShardMover(
            like,
            max(s.numel for s in self.plan),
            config=device_config,
            resizable=True,
            shared=self.client.transports.shared_host_tensor,
        )
        share, of = config.push_share
        self._mine = [s for i, s in enumerate(self.plan) if i % of == share]  # the shards this rank pushes
        self.io = ShardIO(
            self.client, self.mover, pushes={s.shard_id for s in self._mine}, hints=False, compressor=None
        )
        self.applier = PartsApplier(self.client, self.io.pool, self._mine, any_rank)
        self._gradient_scale = gradient_scale
        self.window = BlockWindow(
            self.units, client=self.client, mover=self.mover, pool=self.io.pool, window_bytes=stream.window_bytes,
            prefetch=stream.prefetch,
        )  # fmt: skip
        self.grads = BlockGradients(
            self.units, client=self.client, mover=self.mover, io=self.io, window_bytes=stream.window_bytes,
            reduce=reduce_gradient, shared=self.client.transports.shared_host_tensor if self.shared_blocks else None,
        )  # fmt: skip
        self._unit_of = {id(p): (unit, i) for unit in self.units for i, p in enumerate(unit.params)}
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self._backward_units: set[int] = set()  # units whose backward has begun in this pass
        self._kept: list[StreamUnit] = []  # blocks a forward ended with, kept for the backward
        self._gradless = False  # this backward pass gives the parameters no gradient
        self._in_backward = False
        self._pass_gradients = 0  # parameter gradients this pass has handed over
        self._parts = 0  # backward passes since the last step: the next part's number
        self._pass_groups: list[ps_pb2.GroupHyperparams] | None = None  # micro_batches=1: this pass's settings
        self._push_failures: list[BaseException] = []
        self._clip_coefficient: float | None = None  # from clip_grad_norm_, for the next step
        self._apply_seconds = 0.0  # step()'s APPLY rounds, in all (stats)
        self.step_count = self._attach(stream.init)
        self.say_if_resumed()
        self.window.version = self.step_count
        self._hooks = self._install_hooks(model)

    @property
    def stats(self) -> dict[str, float]:
        """Block pulls prefetched and made when a hook needed them, the most block bytes held at
        once, and the seconds this process's training thread waited on the wire since the start:
        for pulls (pull_wait_seconds: latency prefetch did not hide), for pushes (push_wait_seconds:
        gradients waiting past window_bytes, and step() draining the last ones), and for step()'s
        APPLY round (apply_seconds: the daemons' update, when micro_batches=0). What a step takes
        beyond its compute and these waits is CPU work: the trainer's and, on a shared host, the
        daemon's (docs/trainer.md)."""
        return {
            **self.window.stats,
            "push_wait_seconds": self.grads.wait_seconds,
            "apply_seconds": self._apply_seconds,
        }

    # -- start-up ------------------------------------------------------------------------

    def _attach(self, init: Callable[[nn.Module], None] | None) -> int:
        """A fresh model: each unit initialised (a meta one), pushed and freed, one at a time.
        A known model: the resident units pulled; returns their version."""
        if self.io.fresh():
            for unit in self.units:
                if unit.from_meta:
                    unit.allocate()
                    initialise(unit, self._owners, init)
                after = self.mover.mark_compute()  # the copies follow the initialisation
                wait_all([self.io.pool.submit(self._push_initial, unit, s, after) for s in unit.shards])
                unit.release()
            return 0
        # A known model: its version is the first shard's; every pull checks its own against it.
        first = self.plan[0]
        scratch = torch.empty(first.numel, dtype=self.units[0].values.dtype)
        version = self.client.pull(first, min_version=0, out=byte_view(scratch), dtype=self.mover.wire_dtype)
        self.window.version = version
        for unit in self.units:
            unit.release()
            if not unit.streamed:
                unit.allocate()
                wait_all(self.window.submit_pulls(unit, version))
        return version

    def _push_initial(self, unit: StreamUnit, shard: ShardSlice, after: object) -> None:
        with self.mover.host_copy(unit.values, unit.local(shard), after) as host:
            # A copy: a byte view of the unit's own storage would keep it from being released.
            piece = host.to(torch.float32, copy=True)
        self.client.push(shard, Push.parameters(self.client.model, shard.shard_id, byte_view(piece)))

    def _install_hooks(self, model: nn.Module) -> list:
        hooks = [model.register_forward_pre_hook(lambda _m, _a: self._before_model_forward())]
        for unit in self.units:
            if unit.streamed:
                hooks.append(unit.block.register_forward_pre_hook(lambda _m, _a, u=unit: self._before_forward(u)))
                hooks.append(unit.block.register_forward_hook(lambda _m, _a, out, u=unit: self._after_forward(u, out)))
                hooks.append(
                    unit.block.register_state_dict_post_hook(
                        lambda m, sd, prefix, _meta, u=unit: self._fill_state_dict(u, m, sd, prefix)
                    )
                )
            for p in unit.params:
                hooks.append(p.register_post_accumulate_grad_hook(self._gradient_ready))
        return hooks

    def _fill_state_dict(self, unit: StreamUnit, block: nn.Module, state: dict, prefix: str) -> None:
        """model.state_dict() (or a block's) holds the block's pulled values, not its freed
        memory: the block is pulled for the copy and released again."""
        with self.window.held(unit):
            for name, p in block.named_parameters():
                if prefix + name in state:
                    state[prefix + name] = p.detach().clone()

    # -- forward and backward --------------------------------------------------------------

    def _before_model_forward(self) -> None:
        if self.stream.micro_batches == 1 and self._parts and torch.is_grad_enabled():
            raise RuntimeError(
                "a second forward for backward before step() with Streaming(micro_batches=1): the first backward "
                "applied every block already; call step(), or use micro_batches=0 to accumulate"
            )
        if not self._in_backward:
            # Another forward before the backward that was to use the kept blocks (a pipeline
            # schedule's next micro-batch): they give their room in the window back.
            for unit in self._kept:
                self.window.release(unit)
            self._kept.clear()
        self.window.wait_resident()

    def _before_forward(self, unit: StreamUnit) -> None:
        if unit.index in self._backward_units:  # a re-forward in backward (checkpointing)
            self.window.ready(unit)
            return
        self.window.record(unit)
        self.window.ready(unit)
        self.window.prefetch(unit, forward=True)

    def _after_forward(self, unit: StreamUnit, output: object) -> None:
        if unit.index in self._backward_units:
            return  # the backward that re-ran it still needs it
        if torch.is_grad_enabled():
            outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            for tensor in outputs:
                tensor.register_hook(lambda grad, u=unit: self._before_backward(u))
            if self.window.needed_first_in_backward(unit):
                self._kept.append(unit)
                return  # backward starts with it: kept, not pulled again
        self.window.release(unit)

    def _before_backward(self, unit: StreamUnit) -> None:
        if not self._in_backward:
            self._begin_backward()
            # A pass that gives the parameters no gradient: torch.autograd.grad for inputs
            # only, as the pipeline schedule's shape inference runs once (the engine will not
            # run the parameters' gradient accumulators).
            self._gradless = not any(torch._C._will_engine_execute_node(get_gradient_edge(p).node) for p in unit.params)
        if unit.index not in self._backward_units:
            if self._gradless:
                # No gradient hook will free the blocks whose backward began before this one;
                # in a chain of blocks (a pipeline stage is one) this block's output gradient
                # is complete only once theirs is done, so they are no longer needed.
                for earlier in self._backward_units:
                    self.window.release(self.units[earlier])
            self._backward_units.add(unit.index)
            self.window.ready(unit)
            self.window.prefetch(unit, forward=False)

    def _begin_backward(self) -> None:
        if self._parts:
            # The parts of one shard go in order (the daemon refuses part k before part k-1
            # is held): the last pass's pushes finish before this pass's first one starts.
            self._push_failures.extend(self.grads.drain())
        if self.stream.micro_batches == 1:
            if self._parts:
                raise RuntimeError(
                    "a second backward before step() with Streaming(micro_batches=1): the first backward applied "
                    "every block already; call step(), or use micro_batches=0 to accumulate"
                )
            self._pass_groups = self._groups.hyperparams(self.param_groups)
        self._in_backward = True
        self._pass_gradients = 0
        self.window.fix_order()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _gradient_ready(self, p: nn.Parameter) -> None:
        if not self._in_backward:
            self._begin_backward()
        self._pass_gradients += 1
        unit, i = self._unit_of[id(p)]
        norm_index = self._index_of[id(p)] if self._parts == 0 else None
        complete = self.grads.add(unit, i, p.grad, norm_index=norm_index)
        p.grad = None
        if complete:
            self._unit_done(unit)

    def _unit_done(self, unit: StreamUnit) -> None:
        """The unit's gradient of this pass is complete: push it, and free the block."""
        self.grads.push(unit, step=self.step_count, part=self._parts, groups=self._pass_groups)
        if unit.streamed:
            self.window.release(unit)

    def _end_backward(self) -> None:
        """After the pass: a unit whose gradient is incomplete (parameters the pass did not
        reach) or absent is pushed as it is, so every shard gets this pass's part. A pass
        that gave no parameter a gradient (torch.autograd.grad for the inputs only, as the
        pipeline schedule's shape inference runs on its first step) is no part at all."""
        counted = self._pass_gradients > 0
        if counted:
            for unit in self.grads.unpushed():
                self._unit_done(unit)
        self.window.release_all()
        self._kept.clear()
        self.grads.end_pass()
        self._backward_units.clear()
        self._in_backward = False
        self._parts += counted

    # -- the torch.optim.Optimizer face ----------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients never stay on the trainer (each block's is pushed in its backward): there
        is nothing to zero. Between micro-batches of one step it is refused, for the parts
        pushed so far cannot be taken back from the daemons."""
        if self._parts:
            raise RuntimeError(
                f"zero_grad() after {self._parts} backward passes without step(): their gradients are on the "
                "daemons already; call step() first"
            )

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the model's gradients, for a step of one backward
        pass: the total 2-norm of the per-parameter norms taken as the gradients left (torch's
        expression), and the clip coefficient applied by the daemons with the next step() (an
        fp32 product, bit for bit torch's for fp32 gradients). Returns the total norm. (The
        model's own `.grad`s are gone by then: call this, not torch's, on a streamed model.)"""
        if self.stream.micro_batches == 1:
            raise ValueError(
                "clip_grad_norm_ needs Streaming(micro_batches=0): with 1 each block is applied in backward"
            )
        if float(norm_type) != 2.0:
            raise ValueError(f"a streamed model's gradients are clipped by their 2-norm, not norm_type={norm_type}")
        if self._parts > 1:
            raise ValueError(
                f"clip_grad_norm_ after {self._parts} backward passes: the sum of several passes lives on the "
                "daemons only, and clipping it is not supported yet; clip with one pass per step"
            )
        if not self.grads.norms:
            return torch.tensor(0.0)
        norms = [self.grads.norms[i] for i in sorted(self.grads.norms)]
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2.0)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's own expression
        self._clip_coefficient = float(coefficient.float())
        return total

    def synchronize(self) -> None:
        """Waits for the resident parameters' pulls (streamed blocks are pulled when used)."""
        self.window.wait_resident()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Applies the parts pushed by the backward passes since the last step (returns once
        every daemon has), then starts pulling the resident parameters' new values. Raises
        StepLost when a daemon lost some of them (see the module docstring)."""
        self.check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self._groups.hyperparams(self.param_groups)  # refuses what the daemons cannot follow
        if self._in_backward:
            raise RuntimeError("step() inside backward")
        if not self._parts:  # no backward since the last step: torch.optim steps nothing either
            return loss
        failures = self._wait_pushes()
        parts, self._parts = self._parts, 0
        step = self.step_count
        if self.stream.micro_batches == 1:  # each push was applied on arrival
            if failures:
                raise first_failure(failures)
        else:
            clip, self._clip_coefficient = self._clip_coefficient, None
            multiplier = None if clip is None and self._gradient_scale == 1.0 else (clip or 1.0) * self._gradient_scale
            started = time.perf_counter()
            try:
                self.applier.apply(step, groups, parts, multiplier, failures)  # (trainer/stream/apply.py)
            finally:
                self._apply_seconds += time.perf_counter() - started
        self.grads.norms.clear()
        self.step_count = self.window.version = step + 1
        if self.client.holders.lost and self.config.push_share[1] == 1:
            # Between steps (every shard applied at step_count, the next backward's parts not
            # begun): a replicated model's lost daemon, back or replaced, is caught up here.
            self.client.repair_lost(self.step_count)
        self.window.pull_resident()
        self.window.prefetch_first()  # the next forward's first blocks, while the caller goes on
        return loss

    def _wait_pushes(self) -> list[BaseException]:
        failures, self._push_failures = self._push_failures, []
        return failures + self.grads.drain()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's current values, on the CPU in the compute dtype, pulled one unit
        at a time. (The model's own state_dict() also pulls the blocks, through a hook on each,
        but keeps its tensors on the device.)"""
        self.synchronize()
        out = {}
        for unit in self.units:
            with self.window.held(unit):
                for name, p in zip(unit.names, unit.params, strict=True):
                    out[name] = p.detach().to("cpu", copy=True)
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._wait_pushes()
            self.synchronize()
        finally:
            for hook in self._hooks:
                hook.remove()
            self.grads.close()
            self.io.close()

    def __enter__(self) -> StreamedOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device_of(model: nn.Module, requested: str | torch.device | None) -> torch.device:
    first = next(model.parameters(), None)
    if first is not None and not first.is_meta:
        return first.device
    if requested is not None:
        return torch.device(requested)
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator if accelerator is not None else torch.device("cpu")
