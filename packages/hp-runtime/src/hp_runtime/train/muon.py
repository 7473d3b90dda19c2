"""Muon: `torch.optim.Muon`'s maths on parameters that FSDP, TP and EP have sharded.

Momentum, weight decay and the update are elementwise, so each rank applies them to its own
shard. The Newton-Schulz orthogonalisation needs each whole matrix: a sharded matrix's update
is gathered (in the iteration's dtype, bfloat16 by default, which it starts by rounding to:
the same bits, half float32's bytes) to one of the ranks holding its shards, orthogonalised
there, and the result scattered back. The rank is chosen round-robin over those ranks, one
matrix per rank at a time: a window of matrices is gathered, each rank orthogonalises the one
it owns while the others do theirs, and the window is scattered back. A rank holds at most
one whole matrix of a window (a few copies of it while it iterates). Replicated mesh dims
(HSDP's replicas, TP's replicated experts) each do the same work on their own, as do pipeline
stages. Matrices held whole (one process, experts split only by expert) are orthogonalised
where they are.

Gathers run over the mesh dims that shard the matrix, one dim at a time (innermost first), so
only the mesh's own process groups are used. Where each rank's shard sits in the matrix comes
from DTensor's own splitting rule (`_StridedShard` included: private, as DTensor has no public
way to say where another rank's shard sits), as indices a tensor dim, computed once."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from hp_runtime.train.config.schema import Muon as MuonSettings

A, B, C = 3.4445, -4.7750, 2.0315  # torch.optim.Muon's (Keller Jordan's) quintic coefficients
EPS = 1e-7  # torch.optim.Muon's
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
SHARDS = (Shard, _StridedShard)  # not a subclass of Shard (FSDP's shard of TP's shard)


def newton_schulz(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's iteration, op for op (the same bits in bfloat16, its dtype): the
    matrix scaled to a norm of at most 1, wide side last, then `steps` quintic steps."""
    x = update.to(dtype=dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=EPS))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=B, alpha=C), x, beta=A)
    return x.T if tall else x


def orthogonalise(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """A matrix's iteration, or each matrix's of a stack (an expert weight's experts)."""
    if update.ndim == 2:
        return newton_schulz(update, steps, dtype)
    out = torch.empty(update.shape, dtype=dtype, device=update.device)
    for i, matrix in enumerate(update):
        out[i] = newton_schulz(matrix, steps, dtype)
    return out


def adjusted_lr(lr: float, rule: str, rows: int, cols: int) -> float:
    """torch.optim.Muon's rate for a rows x cols matrix under `adjust_lr_fn` = `rule`."""
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if rule == "spectral_unclamped":
        return lr * math.sqrt(rows / cols)
    return lr * math.sqrt(max(1, rows / cols))  # "original"


@dataclass
class _Layout:
    """How a DTensor's matrix is spread over the ranks that shard it: the mesh dims that shard
    it (`dims`, in mesh order) and, for every coordinate over them, the indices of its shard
    along each tensor dim (`pieces`, in row-major order of the coordinates)."""

    mesh: object
    dims: list[int]
    sizes: list[int]
    here: list[int]  # this rank's coordinate on each of `dims`
    pieces: list[list[Index]]
    longest: int  # the most elements a shard has (shards are padded to it to be sent)
    _on: list[list[Index]] | None = field(default=None, repr=False)  # `on`'s, made once

    def on(self, device: torch.device) -> list[list[Index]]:
        """`pieces` with the index tensors on `device` (made once, on a rank that owns the
        matrix; a contiguous run of indices is a slice and needs none)."""
        if self._on is None:
            self._on = [
                [i if isinstance(i, slice) else i.to(device) for i in p] for p in self.pieces
            ]
        return self._on


Index = slice | torch.Tensor  # a shard's place along one tensor dim


def _length(index: Index, n: int) -> int:
    return len(range(n)[index]) if isinstance(index, slice) else len(index)


def _compact(index: torch.Tensor) -> Index:
    """A contiguous run of indices as a slice (FSDP's and TP's plain shards): nothing to
    store or copy to the device; a strided shard's stay a tensor."""
    if len(index) == 0:
        return slice(0, 0)
    first, last = int(index[0]), int(index[-1])
    if last - first + 1 == len(index) and bool((index.diff() == 1).all()):
        return slice(first, last + 1)
    return index


def _chunk(index: torch.Tensor, chunks: int, i: int) -> torch.Tensor:
    """torch.chunk's piece `i` (empty past the last: an uneven split has fewer pieces)."""
    pieces = torch.chunk(index, chunks)
    return pieces[i] if i < len(pieces) else index[:0]


def _indices(shape: torch.Size, mesh, placements, coordinate: list[int]) -> list[torch.Tensor]:
    """The indices along each tensor dim of the shard at `coordinate` (one entry a mesh dim),
    as DTensor splits a tensor (`distribute_tensor`, `Shard._split_tensor`): mesh dims left to
    right, each splitting what the earlier left with torch.chunk; a `_StridedShard` (FSDP's
    shard of TP's shard) first cuts into `split_factor` pieces and takes its chunk of each."""
    indices: list[torch.Tensor] = [torch.arange(n) for n in shape]
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, SHARDS):
            continue
        dim, ranks, at = placement.dim, mesh.size(mesh_dim), coordinate[mesh_dim]
        if isinstance(placement, _StridedShard):
            pieces = torch.chunk(indices[dim], placement.split_factor)
            indices[dim] = torch.cat([_chunk(piece, ranks, at) for piece in pieces])
        else:
            indices[dim] = _chunk(indices[dim], ranks, at)
    return indices


def _layout(param: DTensor) -> _Layout | None:
    """None when each rank holds whole matrices: no mesh dim splits a matrix dim (the last
    two), so the shards are orthogonalised where they are."""
    mesh, placements = param.device_mesh, param.placements
    matrix_dims = (param.ndim - 2, param.ndim - 1)
    if not any(isinstance(p, SHARDS) and p.dim in matrix_dims for p in placements):
        return None
    dims = [i for i, p in enumerate(placements) if isinstance(p, SHARDS)]
    sizes = [mesh.size(i) for i in dims]
    own = list(mesh.get_coordinate())  # from the mesh alone (no process group: the planner's)
    pieces = []
    for flat in range(math.prod(sizes)):
        coordinate = list(own)
        for i, c in zip(dims, _unravel(flat, sizes), strict=True):
            coordinate[i] = c
        pieces.append([_compact(i) for i in _indices(param.shape, mesh, placements, coordinate)])
    shapes = [[_length(i, n) for i, n in zip(piece, param.shape, strict=True)] for piece in pieces]
    here = [own[i] for i in dims]
    mine = shapes[sum(c * math.prod(sizes[k + 1 :]) for k, c in enumerate(here))]
    if mine != list(param.to_local().shape):  # a split this rule does not know: refuse it
        raise RuntimeError(
            f"Muon: a {tuple(param.shape)} parameter's shard is {tuple(param.to_local().shape)} "
            f"where its placements {param.placements} say {tuple(mine)}"
        )
    longest = max(math.prod(shape) for shape in shapes)
    return _Layout(mesh, dims, sizes, here, pieces, longest)


def _unravel(flat: int, sizes: list[int]) -> list[int]:
    out = []
    for size in reversed(sizes):
        out.append(flat % size)
        flat //= size
    return out[::-1]


def _grid(piece: list[Index]) -> tuple[Index, ...]:
    """`piece` as an index: `full[_grid(piece)]` is the shard (slices as they are, one index
    tensor as it is, several shaped to broadcast against each other)."""
    tensors = [ix for ix in piece if not isinstance(ix, slice)]
    if len(tensors) <= 1:
        return tuple(piece)
    n, device = len(piece), tensors[0].device  # all as tensors: a slice between would move dims
    whole = [torch.arange(ix.start, ix.stop, device=device) if isinstance(ix, slice) else ix
             for ix in piece]  # fmt: skip
    return tuple(ix.view([-1 if d == k else 1 for d in range(n)]) for k, ix in enumerate(whole))


def _joins(here: list[int], owner: list[int], level: int) -> bool:
    """Whether a rank at `here` joins the collective over a matrix's sharding dim `level`: it
    sits where the owner does on every dim after it (those are gathered first)."""
    return here[level + 1 :] == owner[level + 1 :]


class _Exchange:
    """One sharded matrix's trip: its update gathered to its owner, orthogonalised there, the
    result scattered back. Collectives run dim by dim over the mesh's groups; at each dim only
    the ranks that sit where the owner sits on the dims already done take part."""

    def __init__(
        self, layout: _Layout, owner: list[int], local: torch.Tensor, dtype: torch.dtype
    ) -> None:
        self.layout, self.owner, self.dtype = layout, owner, dtype
        self.shape, self.device = local.shape, local.device
        flat = torch.zeros(layout.longest, dtype=dtype, device=local.device)
        flat[: local.numel()] = local.reshape(-1)
        self.buffer: torch.Tensor | None = flat.unsqueeze(0)  # [pieces gathered so far, longest]

    def _takes_part(self, level: int) -> bool:
        return _joins(self.layout.here, self.owner, level)

    def gather(self) -> None:
        lay = self.layout
        for level in reversed(range(len(lay.dims))):
            if not self._takes_part(level):
                self.buffer = None
                return
            group = lay.mesh.get_group(lay.dims[level])
            root = self.owner[level]
            assert self.buffer is not None
            mine = lay.here[level] == root
            parts = [torch.empty_like(self.buffer) for _ in range(lay.sizes[level])] if mine else []
            dist.gather(
                self.buffer,
                parts if mine else None,
                dst=dist.get_global_rank(group, root),
                group=group,
            )
            if not mine:
                self.buffer = None
                return
            self.buffer = torch.cat(parts)

    def owns(self) -> bool:
        return self.buffer is not None and self.layout.here == self.owner

    def orthogonalise(self, full_shape: torch.Size, ns_steps: int) -> None:
        """On the owner: the whole matrix from its pieces, orthogonalised, cut back up."""
        assert self.buffer is not None
        full = torch.empty(full_shape, dtype=self.dtype, device=self.device)
        pieces = self.layout.on(self.device)
        for row, piece in zip(self.buffer, pieces, strict=True):
            shape = [_length(ix, n) for ix, n in zip(piece, full_shape, strict=True)]
            full[_grid(piece)] = row[: math.prod(shape)].view(shape)
        done = orthogonalise(full, ns_steps, self.dtype)
        out = torch.zeros_like(self.buffer)
        for row, piece in zip(out, pieces, strict=True):
            shard = done[_grid(piece)].reshape(-1)
            row[: shard.numel()] = shard
        self.buffer = out

    def scatter(self) -> torch.Tensor:
        """This rank's shard of the orthogonalised update."""
        lay = self.layout
        for level in range(len(lay.dims)):
            if not self._takes_part(level):
                continue  # not on the way down yet (nor was it on the way up)
            group = lay.mesh.get_group(lay.dims[level])
            root = self.owner[level]
            mine = lay.here[level] == root
            rows = math.prod(lay.sizes[level + 1 :])
            received = torch.empty(rows, lay.longest, dtype=self.dtype, device=self.device)
            dist.scatter(
                received,
                list(self.buffer.chunk(lay.sizes[level])) if mine else None,
                src=dist.get_global_rank(group, root),
                group=group,
            )
            self.buffer = received
        assert self.buffer is not None
        return self.buffer[0, : math.prod(self.shape)].view(self.shape)


def _windows(layouts: list[_Layout | None]) -> Iterator[list[tuple[int, list[int]]]]:
    """The sharded matrices (by index) a window at a time, each with its owner's coordinate:
    matrices sharded over the same ranks, as many a window as those ranks, owned in turn."""
    groups: dict[tuple, list[int]] = {}
    for i, layout in enumerate(layouts):
        if layout is not None:
            groups.setdefault((layout.mesh, tuple(layout.dims)), []).append(i)
    for members in groups.values():
        sizes = layouts[members[0]].sizes  # type: ignore[union-attr]
        ranks = math.prod(sizes)
        for start in range(0, len(members), ranks):
            yield [
                (i, _unravel(turn, sizes)) for turn, i in enumerate(members[start : start + ranks])
            ]


def layouts_of(params: Iterable[torch.Tensor]) -> list[_Layout | None]:
    """Each parameter's `_Layout` (None: held whole here), as `Muon.step` makes them."""
    return [_layout(p) if isinstance(p, DTensor) else None for p in params]


def sent_elements(layouts: list[_Layout | None]) -> int:
    """The elements this rank sends in one step's gathers and scatters (padded shards) of one
    Muon's parameters (their `layouts`), as `Muon.step` sends them: what `hp-train plan`
    counts."""
    sent = 0
    for window in _windows(layouts):
        for i, owner in window:
            lay = layouts[i]
            assert lay is not None
            for level in range(len(lay.dims)):
                if not _joins(lay.here, owner, level):
                    continue
                rows = math.prod(lay.sizes[level + 1 :]) * lay.longest
                root = lay.here[level] == owner[level]
                sent += (lay.sizes[level] - 1) * rows if root else rows  # scatter / gather
    return sent


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon over the hidden matrices of one model part, whatever their sharding:
    the same updates, to the bit, as one process running torch.optim.Muon on whole matrices
    (given the same gradients). Each group's `lr` is set every step by `Optimizers.set_lr`
    (`optim.muon.lr`'s schedule). A 3-D parameter is a stack of
    matrices (experts), each orthogonalised and its rate adjusted alone."""

    def __init__(self, params: Iterable[nn.Parameter], settings: MuonSettings) -> None:
        super().__init__(params, asdict(settings))  # each group's keys: the settings' fields
        self._layouts: dict[nn.Parameter, _Layout | None] = {}
        self._windows: dict[int, list[list[tuple[int, list[int]]]]] = {}  # by group

    def _layout(self, param: nn.Parameter) -> _Layout | None:
        if param not in self._layouts:
            self._layouts[param] = _layout(param) if isinstance(param, DTensor) else None
        return self._layouts[param]

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Muon takes no closure"
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if len(params) < len(group["params"]):  # a rank without it would leave a gather
                raise RuntimeError("Muon: a parameter without a gradient (every rank needs one)")
            if group["lr"] == 0:  # DCP's state initialisation: the momentum, no update
                for param in params:
                    self._momentum(param, group)
                continue
            dtype = DTYPES[group["ns_dtype"]]
            layouts = [self._layout(p) for p in params]
            for param, layout in zip(params, layouts, strict=True):  # whole here: one by one
                if layout is None:
                    update = self._momentum(param, group)
                    self._apply(param, orthogonalise(update, group["ns_steps"], dtype), group)
            if index not in self._windows:  # the same every step: made once
                self._windows[index] = list(_windows(layouts))
            for window in self._windows[index]:  # sharded: a window's updates at a time
                trips = []
                for i, owner in window:
                    update = self._momentum(params[i], group)
                    trips.append(_Exchange(layouts[i], owner, update, dtype))  # type: ignore[arg-type]
                    trips[-1].gather()
                for (i, _), trip in zip(window, trips, strict=True):
                    if trip.owns():
                        trip.orthogonalise(params[i].shape, group["ns_steps"])
                for (i, _), trip in zip(window, trips, strict=True):
                    self._apply(params[i], trip.scatter(), group)

    def _momentum(self, param: nn.Parameter, group: dict) -> torch.Tensor:
        """This rank's shard of the update the iteration starts from (torch's lerps)."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad)
        grad, buf = _local(param.grad), _local(state["momentum_buffer"])
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    @staticmethod
    def _apply(param: nn.Parameter, update: torch.Tensor, group: dict) -> None:
        """Decoupled decay at the group's rate, then the update at the rate adjusted by the
        matrix's shape (an expert's, for a stack of them)."""
        local = _local(param)
        local.mul_(1 - group["lr"] * group["weight_decay"])
        local.add_(update, alpha=-adjusted_lr(group["lr"], group["adjust_lr"], *param.shape[-2:]))
