"""Expert parallelism across the ranks of a DEP group: each rank holds some of the routed
experts' slots; a MoE layer sends every (token, choice) to the rank that holds its slot, runs
the experts it holds, and sends the results back (design.md §1, DeepEP's dispatch / combine).

One function per direction, so that a DeepEP-style kernel can replace the exchange on GPUs:

    d = dispatch(hidden, slots, weights, slots_per_rank, group)   # counts, then rows
    y = <the local experts on d.hidden, d.local_slots, weighted by d.weights>
    out = combine(y, d, group)                                     # rows back, summed per token

Every rank of the group must call both, for every MoE layer, in the same order (an idle rank
with no tokens too): the exchange is a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch._dynamo  # before any process group exists: see EPGroup.init
import torch.distributed as dist


@dataclass(frozen=True)
class EPGroup:
    """This rank's view of its DEP group's process group (gloo on CPU, NCCL on GPU)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None: the default (world) group

    @classmethod
    def init(cls, size: int, rank: int, master: str, timeout_s: float = 30.0) -> EPGroup:
        """Join the group whose rank 0 listens at ``master`` (host:port). A rank that stops
        answering makes the others' collectives fail after ``timeout_s``.

        torch._dynamo is imported at the top of this module on purpose: imported after the
        group exists (building a model does), it keeps a reference to the group, so that
        destroy_process_group() in close() left gloo's threads and rank 0's TCPStore running
        until interpreter shutdown, where tearing them down now and then aborted the process
        ("terminate called without an active exception") after its work had succeeded."""
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master}",
            world_size=size,
            rank=rank,
            timeout=timedelta(seconds=timeout_s),
        )
        return cls(rank, size)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (a small collective every rank must call)."""
        return self.agree(flag, 0)[0]

    def agree(self, flag: bool, offer: int) -> tuple[bool, int]:
        """One collective for the start of a lockstep step: whether ``flag`` is true on any
        rank, and the smallest ``offer`` of all ranks."""
        t = torch.tensor([int(flag), -offer])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t[0].item()), -int(t[1].item())

    def close(self) -> None:
        """Leave the group together: a rank that tears its sockets down while a peer still
        reads its last exchange can abort that peer."""
        if dist.is_initialized():
            dist.barrier(group=self.group)
            dist.destroy_process_group()


@dataclass(frozen=True)
class Dispatched:
    """The rows this rank computes, and how to send their results back."""

    hidden: torch.Tensor  # [n_recv, hidden]
    local_slots: torch.Tensor  # [n_recv] int64, slot index on this rank
    weights: torch.Tensor  # [n_recv] float32 routing weight of each row
    order: torch.Tensor  # [T * K]: sorted position -> flat (token, choice) index
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    num_tokens: int
    top_k: int


def dispatch(
    hidden: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    slots_per_rank: int,
    group: EPGroup,
) -> Dispatched:
    """Send each (token, choice) row to the rank holding its slot. ``slots``: [T, K] global
    slot ids; ``weights``: [T, K] routing weights."""
    num_tokens, top_k = slots.shape
    flat = slots.reshape(-1)
    dest = flat // slots_per_rank
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=group.size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group.group)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    rows = hidden[order // top_k]
    recv_rows = hidden.new_empty(sum(rc), hidden.shape[1])
    dist.all_to_all_single(recv_rows, rows, rc, sc, group=group.group)
    # slot ids and weights travel together: float64 holds both exactly
    meta = torch.stack([flat[order].double(), weights.reshape(-1)[order].double()], dim=1)
    recv_meta = meta.new_empty(sum(rc), 2)
    dist.all_to_all_single(recv_meta, meta, rc, sc, group=group.group)
    local = recv_meta[:, 0].long() - group.rank * slots_per_rank
    return Dispatched(recv_rows, local, recv_meta[:, 1].float(), order, sc, rc, num_tokens, top_k)


def combine(expert_out: torch.Tensor, d: Dispatched, group: EPGroup) -> torch.Tensor:
    """Send each computed row back to its token's rank and sum a token's choices: [T, hidden]."""
    back = expert_out.new_empty(sum(d.send_counts), expert_out.shape[1])
    dist.all_to_all_single(back, expert_out, d.send_counts, d.recv_counts, group=group.group)
    flat = torch.empty_like(back)
    flat[d.order] = back
    return flat.view(d.num_tokens, d.top_k, expert_out.shape[1]).sum(dim=1)
