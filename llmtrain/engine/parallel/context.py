"""Context parallelism on CPU and GPU: the project's own attention over the ``cp`` group.

torch's built-in ``context_parallel`` has no sharding rule for the CPU flash-attention op
(CPU facts note, trap 1), so the three methods are implemented here, each as the model's
``attn_fn(q, k, v)`` on the local sequence shard (q ``[b, heads, s_local, d]``). GQA: ring and
all-gather take K/V with their local ``kv_heads`` (``[b, kv_heads, s_local, d]``, the attribute
``takes_kv_heads``) and exchange them so, repeating them to the query heads only after the
exchange, just before the kernels: ``heads / kv_heads`` times fewer bytes on the wire (16x for
Llama 3 405B under TP 8), as Megatron-Core and Llama 3 (arXiv:2407.21783, sec. 3.3.2: "K and V
tensors are much smaller than Q due to GQA"). The repeat's backward sums the copies' gradients
locally, so dK/dV travel with ``kv_heads`` too. Ulysses takes them with their ``kv_heads`` as well
and exchanges them so when they divide by cp (its all-to-all re-shards heads), else repeated first
(:func:`ulysses_attention`). Every collective that carries gradients is either an autograd
op from ``torch.distributed._functional_collectives`` or a custom autograd Function below; never
``torch.distributed.nn.functional`` (wrong gradients on gloo for non-contiguous grads, trap 2).

Sequence sharding (:func:`cp_positions`): ``ring`` and ``allgather`` use the load-balanced
"zigzag" split — the sequence is cut into ``2 cp`` chunks and cp rank ``r`` holds chunks ``r`` and
``2 cp - 1 - r``, so under a causal mask every rank has the same amount of work; ``ulysses`` uses
contiguous chunks (each rank runs the whole sequence of its heads: balanced anyway). Inputs,
labels and RoPE positions are sharded identically and positions stay global, so the model
computes exactly the full-sequence attention.

- ``allgather`` (Llama 3's CP, Dubey et al. 2024, arXiv:2407.21783, section 3.3.2: "2 x CP
  chunks so each CP rank receives two chunks for better load balancing"): K and V are
  all-gathered with their kv_heads (backward: reduce-scatter), reordered from rank order into
  global order (still kv_heads: each kernel block repeats its key range), and each
  of the rank's two query chunks attends to the prefix of the sequence up to itself, causally
  aligned bottom-right: two kernel blocks per chunk merged by their log-sum-exp, no mask tensor
  (``context_blocks.PrefixCausalAttention``, one call for both chunks). Balanced like the ring
  (:func:`allgather_attention`); K/V memory is the full sequence (kv_heads). With a mask (packed
  rows' samples, a sliding window) or Gemma 2's soft-cap, the rank's rows of the model's mask
  (``models/masks.py``) go to one masked kernel call over the gathered K/V: why Llama 3 chose it.
- ``ulysses`` (Jacobs et al. 2023, arXiv:2309.14509): an all-to-all turns sequence shards of all
  heads into the full sequence of ``heads / cp`` heads, plain causal attention runs locally, and
  a second all-to-all turns it back. Needs heads (and kv_heads) divisible by tp x cp.
- ``ring`` (Liu et al. 2023, "Ring Attention", arXiv:2310.01889; zigzag balancing as in
  Megatron-Core / torchtitan), in ``context_ring.py``: K/V blocks travel around the ring with P2P
  send/recv while each rank merges partial attention results with the online-softmax
  (log-sum-exp) rule, repeating each received block's kv_heads for its kernel call; backward
  sends K/V around again together with the accumulating dK/dV (kv_heads: each block's repeated
  heads' gradients summed first), which end at their owner. Every block is a fused SDPA kernel call that returns its lse
  (``context_blocks.py``), unmasked or ``is_causal`` on the diagonal: working memory O(s_local d),
  never an ``[s_local, s_local]`` score block. With a mask (packed rows, a window) or the soft-cap,
  the model's mask of this rank's rows with the keys in ring order, and each block a masked kernel
  call on its view of it (``context_ring.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from llmtrain.engine.models.llama import causal_sdpa
from llmtrain.engine.models.masks import zigzag_rows
from llmtrain.engine.models.softcap import softcap_attention
from llmtrain.engine.models.window_attention import local_window_attention, runs_local
from llmtrain.engine.parallel.context_blocks import PrefixCausalAttention
from llmtrain.engine.parallel.context_ring import RingAttention, ring_attention  # noqa: F401 (re-exported)
from llmtrain.engine.parallel.context_exchange import window_exchange_attention
from llmtrain.engine.parallel.context_ring_window import windowed_ring_attention
from llmtrain.engine.parallel.funcol_names import all_gather_autograd
from llmtrain.plan.ringwindow import use_exchange


def cp_positions(seq_len: int, cp: int, cp_rank: int, method: str) -> torch.Tensor:
    """Global positions of the tokens this cp rank holds, in local order."""
    if cp == 1:
        return torch.arange(seq_len)
    if method in ("ring", "allgather"):  # zigzag (module docstring)
        return zigzag_rows(seq_len, cp, cp_rank)
    chunk = seq_len // cp
    return torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)


def shard_sequence(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Select this rank's tokens (dim 1) of inputs or labels."""
    return x.index_select(1, positions.to(x.device))


# ---------------------------------------------------------------------------------------------
def allgather_offsets(s_local: int, cp: int, cp_rank: int) -> tuple[int, int]:
    """Global offsets of this rank's two zigzag query chunks (``c = s_local / 2`` tokens each, in
    local order): chunks ``r`` and ``2 cp - 1 - r`` of the ``2 cp`` (:func:`cp_positions`)."""
    c = s_local // 2
    return cp_rank * c, (2 * cp - 1 - cp_rank) * c


def zigzag_order(cp: int) -> list[int]:
    """For each global chunk ``g`` of the ``2 cp``, its index in the all-gathered rank order
    ``[r0.c0, r0.c1, r1.c0, r1.c1, ...]`` (rank ``r``'s first local chunk is global ``r``, its
    second ``2 cp - 1 - r``)."""
    return [2 * g if g < cp else 2 * (2 * cp - 1 - g) + 1 for g in range(2 * cp)]


def allgather_attention(q, k, v, group: dist.ProcessGroup, cp: int, cp_rank: int,
                        mask: torch.Tensor | None = None, softcap: float | None = None):
    """Queries of the local zigzag shard (global chunks ``r`` and ``2 cp - 1 - r``) against the
    all-gathered K/V of the whole sequence ``S``, reordered into global order.

    Work (``c = S / 2 cp``; a causal diagonal block executes half its scores): the chunk at offset
    ``o`` runs ``c o`` unmasked scores plus ``c^2 / 2`` on its diagonal, so rank ``r`` executes
    ``c (r c) + c (2 cp - 1 - r) c + c^2 = 2 cp c^2 = s_local S / 2``: exactly 1/2 of a full
    ``[s_local, S]`` block on every rank, as the ring (contiguous shards gave rank ``r``
    ``(r + 1/2) / cp``: the last rank nearly twice the average, and every layer's gather waits for
    it). Key ranges: ``(r + 1) c + (2 cp - r) c = (2 cp + 1) c`` keys read on every rank.

    GQA: ``k``/``v`` come with the local kv_heads (``[b, kv_heads, s_local, d]``); they are
    gathered, reordered, saved and reduce-scattered so: ``PrefixCausalAttention`` repeats each
    kernel block's key range to the query heads just for the kernel call and sums the repeated
    heads' gradients back into dK/dV of kv_heads.

    Memory: the saved tensors are those of the contiguous version (q, the output, the lse and K/V
    of the whole sequence with kv_heads — the reordered copies; the gathered rank-order buffers
    are freed as soon as they are reordered, since neither the gather's nor the reorder's
    backward needs them). The reorder costs one more full-sequence K (then V) buffer for the
    moment of the copy in forward, and one full-sequence dK (then dV) in backward (the gradient
    put back into rank order for the reduce-scatter); the call's peak stays in the attention's
    backward, where the largest block's repeated K/V and their gradients are live
    (``plan/activations.cp_transient_bytes``).

    ``mask`` (packed rows, a sliding window: the model's additive mask of this rank's rows against
    the whole row, ``models/masks.py``) and ``softcap`` (Gemma 2, with its causal mask as rows): one
    call of masked SDPA, or of the soft-capped kernel, over the gathered K/V repeated to the query
    heads, as the model's own masked attention without CP: every score block runs (no causal skip),
    and the repeated full-sequence K/V are what the kernel keeps."""
    order = zigzag_order(cp)
    # GQA: gathered with their kv_heads; PrefixCausalAttention repeats each kernel block's keys
    k_full = _gather_seq(k, group, cp, order)
    v_full = _gather_seq(v, group, cp, order)
    if mask is None and softcap is None:
        return PrefixCausalAttention.apply(q, k_full, v_full, allgather_offsets(q.shape[2], cp, cp_rank))
    return masked_rows_attention(q, k_full, v_full, mask, softcap)


def masked_rows_attention(q, k, v, mask: torch.Tensor | None, softcap: float | None = None) -> torch.Tensor:
    """The queries of some rows (``q`` ``[b, heads, s, d]``) against the whole sequence's K/V (``[b, kv_heads,
    S, d]``) under ``mask``, the additive mask of those rows (``[s, S]`` or ``[b, 1, s, S]``: models/masks.py):
    masked SDPA, or the soft-capped kernel (its mask then required: rows are not square). K/V are repeated
    to the query heads first, as the model's own masked attention does (models/llama.py)."""
    if k.shape[1] != q.shape[1]:  # the masked kernels take equal head counts
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if softcap is not None:
        return softcap_attention(q, k, v, mask, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _gather_seq(x: torch.Tensor, group, cp: int, order: list[int] | None = None) -> torch.Tensor:
    # all_gather_tensor gathers along dim 0: move the sequence there and back
    flat = x.permute(2, 0, 1, 3).contiguous()  # [s, b, h, d]
    # wait here, while ``flat`` (a temporary) is alive: the collective then never outlives the
    # buffers it reads (a gloo send thread once segfaulted reading freed memory in a CP job under
    # heavy load; not proven to be this, but nothing overlaps here anyway: SDPA waits next)
    gathered = wait_tensor(all_gather_autograd(flat, gather_dim=0, group=group))  # [cp*s, b, h, d]
    del flat
    if order is not None:  # rank order -> global order; the rank-order buffer is freed on rebinding
        gathered = ChunkOrder.apply(gathered, order)
    return gathered.permute(1, 2, 0, 3)


class ChunkOrder(torch.autograd.Function):
    """``x`` (contiguous, sequence on dim 0, ``len(order)`` equal chunks) with its chunks put in
    ``order`` (output chunk ``i`` = input chunk ``order[i]``): one copy, and a backward that is the
    inverse reorder (autograd through slices or ``index_select`` would build full-size zeros per
    slice, or ``index_add`` into zeros). Saves no tensor."""

    @staticmethod
    def forward(ctx, x, order: list[int]):
        ctx.inverse = [0] * len(order)
        for i, j in enumerate(order):
            ctx.inverse[j] = i
        return _take_chunks(x, order)

    @staticmethod
    def backward(ctx, grad):
        return _take_chunks(grad.contiguous(), ctx.inverse), None


def _take_chunks(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    # one cat of views: no index tensor (on CUDA, building one from a list is a blocking copy)
    c = x.shape[0] // len(order)
    return torch.cat([x.narrow(0, j * c, c) for j in order])


# ---------------------------------------------------------------------------------------------
def ulysses_attention(q, k, v, group: dist.ProcessGroup, cp: int, mask: torch.Tensor | None = None,
                      softcap: float | None = None, window: int | None = None):
    """All-to-all from (all heads, local sequence) to (heads / cp, full sequence) and back.

    ``mask``: the model's additive mask over the whole sequence, built once per forward: a sliding
    window's band (``[S, S]``, ``models.llama.window_mask``) and / or packed rows' sample mask
    (``[b, 1, S, S]``, ``models.llama.packed_mask``, from the whole row's sample ids): each rank
    holds whole sequences, in order, of its heads, so the mask is the one without CP. ``softcap``: Gemma 2's capped scores, by the
    model's own kernel (``models/softcap.py``) on the whole sequences of this rank's heads.

    GQA's K/V arrive with their local ``kv_heads`` (``takes_kv_heads``). When those split over ``cp``
    they are exchanged as they are: rank ``j`` receives query heads ``j h / cp ...`` and K/V heads
    ``j kv / cp ...``, exactly the K/V heads its query heads use (query head ``i`` reads K/V head
    ``i // (h / kv)``), so the all-to-alls move ``heads / kv_heads`` times fewer K/V bytes and causal
    SDPA takes them unrepeated where the kernel can (``models/llama.py`` ``causal_sdpa``); a mask or
    the soft-capped kernel gets them repeated after the exchange. K/V heads that do not split over
    ``cp`` are repeated to the query heads first, as before the thirty-eighth session. ``window``: a
    windowed layer's, whose whole rows run only their score boxes (``models/window_attention.py``,
    forty-second session; the dense band before) where the row's chunks fit."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads and kv_heads % cp:
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    qh, kh, vh = (_seq_to_heads(t, group, cp) for t in (q, k, v))
    if softcap is None and mask is None:
        return _heads_to_seq(causal_sdpa(qh, kh, vh), group, cp)
    if kh.shape[1] != qh.shape[1]:
        rep = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    if mask is not None and runs_local(qh.shape[2], window):  # a window: its boxes, soft-capped or not
        out = local_window_attention(qh, kh, vh, mask, window, softcap)
    elif softcap is not None:
        out = softcap_attention(qh, kh, vh, mask, softcap)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return _heads_to_seq(out, group, cp)


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).permute(1, 0, 2, 3, 4).contiguous()  # [cp(dst), b, h/cp, s, d]
    recv = wait_tensor(all_to_all_single_autograd(send.reshape(cp, -1), None, None, group))  # [cp(src seq chunk), ...]
    recv = recv.reshape(cp, b, h // cp, s, d)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    b, hc, S, d = x.shape
    s = S // cp
    send = x.reshape(b, hc, cp, s, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp(dst seq chunk), b, h/cp, s, d]
    recv = wait_tensor(all_to_all_single_autograd(send.reshape(cp, -1), None, None, group))  # [cp(src head group), ...]
    recv = recv.reshape(cp, b, hc, s, d)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, cp * hc, s, d)


def make_cp_attention(method: str, group: dist.ProcessGroup, cp: int, cp_rank: int, seq_len: int,
                      window: int | None = None):
    """The ``attn_fn`` for this rank's blocks. Ring and all-gather take K/V with their local
    ``kv_heads`` (``takes_kv_heads``: the model does not repeat them, ``models/llama.py``);
    Ulysses takes them too; every method takes the model's mask (``takes_mask``: a sliding
    window, packed rows) and Gemma 2's soft-cap (``takes_softcap``). ``window``: a windowed layer's
    sliding window: the ring runs only the chunk pairs inside it (``context_ring_window.py``), and where
    that window needs few chunks (``plan/ringwindow.py`` ``use_exchange``, decided from this call's chunk
    length) each rank fetches just those from their owners instead (``context_exchange.py``)."""
    if method == "ulysses":
        def ulysses(q, k, v, mask=None, softcap=None):
            return ulysses_attention(q, k, v, group, cp, mask, softcap, window)
        ulysses.takes_mask = ulysses.takes_softcap = ulysses.takes_kv_heads = True
        return ulysses
    if method == "ring":
        def ring(q, k, v, mask=None, softcap=None):
            if window is not None:  # a windowed layer: only the chunk pairs inside the window
                if use_exchange(cp, q.shape[2] // 2, window):  # ... and only the chunks they read
                    return window_exchange_attention(q, k, v, group, cp, window, mask, softcap)
                return windowed_ring_attention(q, k, v, group, cp, window, mask, softcap)
            return ring_attention(q, k, v, group, cp, mask, softcap)
        ring.takes_mask = ring.takes_softcap = ring.takes_kv_heads = True
        return ring

    def allgather(q, k, v, mask=None, softcap=None):
        return allgather_attention(q, k, v, group, cp, cp_rank, mask, softcap)
    allgather.takes_mask = allgather.takes_softcap = allgather.takes_kv_heads = True
    return allgather


def apply_context_parallel(model, cp_mesh, method: str, seq_len: int) -> None:
    """Swap every block's core attention for the CP one (before AC/compile/FSDP wrap blocks)."""
    cp, cp_rank, group = cp_mesh.size(), cp_mesh.get_local_rank(), cp_mesh.get_group()
    model.seq_shards = cp  # a row is cp shards: the window's band (Ulysses) and longrope's regime use its length
    if method in ("allgather", "ring"):  # masks of this rank's zigzag rows (models/masks.py), keys in ring order
        model.cp_rows = (cp, cp_rank)
        model.cp_ring_keys = method == "ring"
    for block in model.layers.values():
        window = model.window if block.windowed else None  # the ring runs only the chunk pairs inside it
        block.attention.attn_fn = make_cp_attention(method, group, cp, cp_rank, seq_len, window)
