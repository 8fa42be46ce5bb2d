"""Measure what the engine really holds, per rank, for several layouts in ONE torchrun job.

For each case: build the model and optimizer exactly as the trainer does (``build_parts``: PP
split, TP, CP, EP, activation checkpointing, FSDP2; ``build_optimizer``: AdamW, ZeRO-1 groups,
gradient all-reduce). Without PP, run one micro batch forward while recording every tensor
produced (a TorchDispatchMode keeping weak references) and count the bytes still alive after
the loss, by unique storage, without the parameters' storages (FSDP's all-gathered weights
included): the memory held for backward. For layouts without recomputation the bytes packed by
``saved_tensors_hooks`` are counted too. Before counting, the harness waits until gloo's worker
threads are idle (:func:`wait_for_idle_comm_threads`): a finished collective's buffer can stay
referenced by the worker thread for milliseconds on a loaded machine. Then backward (PP: one pipelined step), gradient sync,
one optimizer step, and the local bytes (``_local_tensor`` for DTensors) of parameters,
gradients and optimizer states. Results of every rank go to a JSON file.

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/costmodel_worker.py SPEC.json
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import weakref
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from llmtrain.engine.dp_optimizer import CombinedOptimizer, build_optimizer
from llmtrain.engine.main import init_distributed, shutdown
from llmtrain.engine.mesh import build_meshes
from llmtrain.engine.parallel.context import cp_positions, shard_sequence
from llmtrain.engine.parallel.pipeline import build_schedule, stage_io_shapes
from llmtrain.engine.parallel.zero1 import ZeRO1Optimizer
from llmtrain.engine.parallelize import build_parts, uses_fsdp
from llmtrain.engine.step import StepLoss, compute_context, pipelined_step
from llmtrain.engine.trainer import resolve_dims
from llmtrain.recipe.load import load_recipe
from llmtrain.recipe.schema import bf16_compute

def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def storages_of(t: torch.Tensor) -> list:
    """The real storages behind ``t``: wrapper subclasses (DTensor, functional collectives'
    AsyncCollectiveTensor) are unwrapped to their inner tensors."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return [s for x in inner if isinstance(x, torch.Tensor) for s in storages_of(x)]
    st = t.untyped_storage()
    return [st] if st.nbytes() else []  # FSDP's freed (resized-to-0) storages have no data pointer


def nbytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def state_nbytes(t: torch.Tensor) -> int:
    """Stored bytes of an optimizer state: a quantized moment (torchao OptimState8bit, whose
    dtype is only an appearance) counts its inner codes, scales and code map."""
    t = local(t)
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(state_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


class LiveTensors(TorchDispatchMode):
    """Weak references to every tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t))
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        storages = {}
        for ref in self.refs:
            t = ref()
            if t is None:
                continue
            for s in storages_of(t):
                if s.data_ptr() not in exclude:
                    storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())


def _comm_threads_busy() -> bool:
    """Whether one of this process's gloo worker threads (``pt_gloo_runloop``) is runnable."""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
        if name == "pt_gloo_runloop" and state not in "SI":
            return True
    return False


def wait_for_idle_comm_threads(timeout_s: float = 10.0) -> bool:
    """Wait until every gloo worker thread sleeps, i.e. has let go of the collectives it finished.

    A gloo worker thread completes a collective's future (the caller's ``wait()`` returns) and
    only then, once it is scheduled again, drops its reference to the work object, which holds
    the collective's input and output tensors. On a loaded 2-core machine that can take
    milliseconds, so a buffer the caller already freed (FSDP's flat all-gather output of the last
    block: 738,304 bytes for debug-dense over 4 ranks; a TP all-reduce output) is still alive
    after forward and would be counted as held for backward (measured: ~7 % of synchronous
    all-gathers still held their output 3 ms later beside two CPU hogs; 0 % after this wait).
    A sleeping worker holds nothing: it drops the work before it waits for the next one. Returns
    False if the threads did not settle in ``timeout_s`` (or /proc is missing: not Linux)."""
    if not os.path.isdir("/proc/self/task"):
        return False
    deadline = time.monotonic() + timeout_s
    while _comm_threads_busy():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)  # give the CPU to the worker thread
    return True


class _Held:
    """A tensor autograd saved, as :class:`SavedPeak` packs it: released with the graph node."""

    __slots__ = ("x", "counts")

    def __init__(self, x, counts):
        self.x, self.counts = x, counts  # [(tracker, storage pointers it counted)]

    def __del__(self):
        for owner, ptrs in self.counts:
            owner.release(ptrs)


class SavedPeak:
    """Bytes autograd holds for backward (``total`` now, ``peak`` the most), by unique storage,
    parameters (FSDP's gathered weights included) excluded: every tensor a forward packs
    (``saved_tensors_hooks``) is held until its graph node is freed after its backward. After one
    forward: what the planner's saved activations predict; over a pipelined step: the planner's
    in-flight micro batches per chunk (plan/inflight.py) times a micro batch's saved bytes."""

    def __init__(self, parts, also: "SavedPeak | None" = None):
        self.parts, self.refs, self.total, self.peak = parts, {}, 0, 0
        self.also = also  # a second tracker that also counts recomputed tensors (:meth:`recompute_caches`)

    def _trackers(self):
        return (self,) if self.also is None else (self, self.also)

    def pack(self, x):
        if isinstance(x, nn.Parameter) or isinstance(getattr(x, "_base", None), nn.Parameter):
            return x  # a weight (FSDP's all-gathered ones included), not an activation
        # detached: holding ``x`` itself (an op's output, with its grad_fn) would close a cycle through
        # the graph node that saves it, which autograd only breaks when backward frees the node (never
        # under the zero-bubble schedules' input-gradient pass, retain_graph=True): a leak of the tracker
        weights = param_storages(self.parts)
        return _Held(x.detach(), [(t, t._take(x, weights)) for t in self._trackers()])

    def _take(self, x, weights: set[int]) -> list[int]:
        """Count ``x``'s storages except ``weights`` (:func:`param_storages`: a local view of a weight,
        ``to_local()`` of an expert shard or slices of it; FSDP's unsharded storages exist only during
        forward, so they are looked up at each pack)."""
        ptrs = []
        for st in storages_of(x):
            ptr = st.data_ptr()
            if ptr in weights:
                continue
            n, k = self.refs.get(ptr, (st.nbytes(), 0))
            if k == 0:
                self.total += n
            self.refs[ptr] = (n, k + 1)
            ptrs.append(ptr)
        self.peak = max(self.peak, self.total)
        return ptrs

    def hold(self, x: torch.Tensor) -> None:
        """Count ``x`` (a selective-checkpoint cache entry) until the tensor object dies: it is
        handed to the recomputed forward in backward and lives as long as that graph needs it."""
        weights = param_storages(self.parts)
        for t in self._trackers():
            weakref.finalize(x, t.release, t._take(x, weights))

    @contextlib.contextmanager
    def recompute_caches(self):
        """Also count what selective recomputation caches (torch's ``_CachingTorchDispatchMode``
        storage, and the engine's discarding subclass of it: engine/parallel/checkpointing.py), which
        ``saved_tensors_hooks`` do not see: the checkpoint packs its region's saved tensors itself.
        ``also`` counts, besides, every tensor a recomputation stores for its backward (the
        non-reentrant checkpoint's ``_recomputation_hook``) until it dies: the plan's working set of
        the recomputed block, and whatever a recomputation leaves unused until its graph is freed."""
        from torch.utils import checkpoint as ckpt

        from llmtrain.engine.parallel import checkpointing as engine_ckpt

        classes = [c for c in (ckpt._CachingTorchDispatchMode, getattr(engine_ckpt, "_DiscardingMode", None)) if c]
        originals = {c: c.__dict__["__torch_dispatch__"] for c in classes}
        tracker = self

        def wrap(orig):
            def dispatch(mode, func, types, args=(), kwargs=None):
                depth = mode.__dict__.get("_tracked_depth", 0)
                mode._tracked_depth = depth + 1
                try:
                    out = orig(mode, func, types, args, kwargs)
                finally:
                    mode._tracked_depth = depth
                if depth == 0 and func not in ckpt.SAC_IGNORED_OPS:  # the outermost call: its final entry
                    key = ckpt._sac_storage_key(func, args)
                    entry = mode.storage[key][mode.func_counter[key] - 1]
                    for leaf in tree_leaves(entry):
                        if isinstance(leaf, ckpt._VersionWrapper) and isinstance(leaf.val, torch.Tensor):
                            tracker.hold(leaf.val)
                return out
            return dispatch

        for c in classes:
            c.__torch_dispatch__ = wrap(originals[c])
        init = ckpt._recomputation_hook.__init__
        if self.also is not None:
            def recomputation_init(hook, frame_ref, gid):
                init(hook, frame_ref, gid)
                pack = hook.pack_hook

                def counted(x):
                    out = pack(x)
                    if isinstance(out, torch.Tensor):
                        tracker.also.hold(out)
                    return out
                hook.pack_hook = counted
            ckpt._recomputation_hook.__init__ = recomputation_init
        try:
            yield
        finally:
            for c in classes:
                c.__torch_dispatch__ = originals[c]
            ckpt._recomputation_hook.__init__ = init

    @staticmethod
    def unpack(h):
        return h.x if isinstance(h, _Held) else h

    def release(self, ptrs):
        for ptr in ptrs:
            n, k = self.refs[ptr]
            if k == 1:
                del self.refs[ptr]
                self.total -= n
            else:
                self.refs[ptr] = (n, k - 1)


def param_storages(parts) -> set[int]:
    return {st.data_ptr() for part in parts.parts for p in part.parameters() for st in storages_of(p)}


def optimizer_state_bytes(optimizer) -> int:
    inners = optimizer.optimizers if isinstance(optimizer, CombinedOptimizer) else [optimizer]
    total = 0
    for opt in inners:
        opt = opt.inner if isinstance(opt, ZeRO1Optimizer) else opt
        if opt is None:
            continue
        for state in opt.state.values():
            total += sum(state_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


MESHES: dict = {}  # cases with the same degrees share one set of process groups (creating them dominates)


def run_case(recipe, device) -> dict:
    dims = resolve_dims(recipe, dist.get_world_size())
    meshes = MESHES.get(dims) or MESHES.setdefault(dims, build_meshes(dims, device.type))
    t = recipe.train
    torch.manual_seed(t.seed)
    parts = build_parts(recipe, meshes, device)
    for part in parts.parts:
        part.train()
    params = parts.parameters()
    fsdp = uses_fsdp(recipe, meshes)
    optimizer, grad_sync = build_optimizer(parts, recipe, meshes, fsdp)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank() // (dims.tp * dims.cp))
    grad_accum = (t.global_batch_size or t.micro_batch_size * dims.dp) // (t.micro_batch_size * dims.dp)
    shape = (t.micro_batch_size, t.seq_len)
    batches = [(torch.randint(0, recipe.model.vocab_size, shape, generator=gen),
                torch.randint(0, recipe.model.vocab_size, shape, generator=gen)) for _ in range(grad_accum)]
    if dims.cp > 1 or dims.pp > 1:
        positions = cp_positions(t.seq_len, dims.cp, meshes.cp.get_local_rank(), recipe.parallel.cp_method)
        for part in parts.parts:
            part.positions = positions
        batches = [(shard_sequence(x, positions), shard_sequence(y, positions)) for x, y in batches]
    tp_loss = dims.tp > 1
    amp = compute_context(t.precision, fsdp, device)  # as the trainer: bf16 autocast for zero 0/1 in bf16
    held = hooked = comm_idle = pp_peak_saved = pp_peak_all = None
    if dims.pp > 1:  # model state, and the peak of what the pipelined step's micro batches keep
        # as the trainer builds it: the chunked loss over the head and the stages' shapes given (without
        # them torch's shape inference runs a real forward whose saved tensors outlive the step)
        p, m = recipe.parallel, recipe.model
        shapes = partial(stage_io_shapes, n_stages=parts.n_stages, micro=t.micro_batch_size, seq=t.seq_len // dims.cp,
                         hidden=m.hidden, vocab=m.vocab_size, sp_shards=dims.tp if dims.tp > 1 and p.sequence_parallel else 1,
                         head_in_loss=True)
        act_dtype = torch.bfloat16 if bf16_compute(t.precision) else torch.float32
        schedule, stages = build_schedule(parts.parts, parts.stage_ids, parts.n_stages, p.pp_schedule, grad_accum,
                                          StepLoss.for_parts(parts), device, meshes.pp.get_group(), shapes=shapes,
                                          dtype=act_dtype)
        tracker = SavedPeak(parts, also=SavedPeak(parts))
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack), tracker.recompute_caches():
            pipelined_step(parts, schedule, batches, device, tp_loss, amp)
        pp_peak_saved, pp_peak_all = tracker.peak, tracker.also.peak
        del schedule, stages
    else:
        model = parts.parts[0]
        inputs, labels = batches[0]

        def forward():  # the trainer's chunked loss over the head; like accumulation_step, h is not kept
            with amp:
                hidden = model(inputs, return_hidden=True)
                return None, StepLoss(head=model.output)(hidden, labels)

        def backward(loss):
            with loss_parallel() if tp_loss else contextlib.nullcontext():
                loss.backward()

        if t.activation_checkpointing == "none":  # what autograd packs for backward, held after forward
            tracker = SavedPeak(parts)
            with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
                logits, loss = forward()
            hooked = tracker.total
            backward(loss)
            del logits, loss
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
        live = LiveTensors()
        with live:
            logits, loss = forward()
        comm_idle = wait_for_idle_comm_threads()
        held = live.alive_bytes(param_storages(parts))
        backward(loss)
        del logits, loss, live
    if grad_sync is not None:
        grad_sync(params)
    grads = sum(nbytes(p.grad) for p in params if p.grad is not None)
    optimizer.step()
    out = {"rank": dist.get_rank(), "coords": dims.coord_dict(dist.get_rank()), "dp_cp_index": meshes.dp_cp.get_local_rank(),
           # every parameter the rank stores (LoRA: the frozen base too; ``params`` are the trainable ones)
           "params": sum(nbytes(p) for part in parts.parts for p in part.parameters()), "grads": grads, "optimizer": optimizer_state_bytes(optimizer),
           "held_after_forward": held, "saved_hooks": hooked, "comm_idle": comm_idle, "pp_peak_saved": pp_peak_saved,
           "pp_peak_all": pp_peak_all}
    del parts, optimizer, params
    gc.collect()
    return out


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    device = init_distributed()
    results = {}
    for case in spec["cases"]:
        recipe = load_recipe(spec["recipe"], spec.get("set", []) + case["set"])
        start = time.perf_counter()
        mine = run_case(recipe, device)
        mine["seconds"] = time.perf_counter() - start
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results[case["name"]] = gathered
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(results, f)
    shutdown()


if __name__ == "__main__":
    main()
