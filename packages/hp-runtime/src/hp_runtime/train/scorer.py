"""The model's answers to downstream requests, on the run's own layout: log-probabilities of
given tokens and greedy continuations, for `train/lm_eval_model.py`.

Every rank holds every request (lm-eval builds them alike on each); the data-parallel ranks
split the batches, a batch at a time each, and every rank of a tensor-parallel group runs the
same batch, as in training. A rank without a batch left runs a one-row stand-in, so FSDP's
gathers and TP's collectives meet on every rank; one all-reduce at the end gives every rank
every answer (only tensor-parallel rank 0 adds its own). Batches hold sequences of similar
length (sorted longest first, as lm-eval's HF backend sorts them), padded on the right: the
model is causal, so padding changes no position before it. Identical inputs run once (a
multiple-choice item whose answers are one token each reads one forward's last position).

A pipeline or context parallelism splits a sequence across ranks, and this module needs each
sequence's logits whole on one rank: `config.check_eval_layout` refuses them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp_runtime.parallel import Assembly
from hp_runtime.train.config import check_eval_layout

PAD = 0  # right padding's token id: no position before it sees it
ROUND = 8  # lengths padded to a multiple of this (times tp): fewer distinct shapes


class Scorer:
    """`assembly`'s model as lm-eval's requests need it: `logprobs` and `generate`."""

    def __init__(
        self,
        assembly: Assembly,
        autocast_dtype: torch.dtype | None,
        max_length: int,
        batch_size: int,
    ) -> None:
        check_eval_layout(assembly.dims.pp, assembly.dims.cp, "parallel")
        self.assembly = assembly
        self.model = assembly.model
        self.device = assembly.device
        self.autocast_dtype = autocast_dtype
        self.tp = assembly.dims.tp
        # the positions a padded batch may take: a multiple of tp (sequence parallelism)
        self.max_length = max_length // self.tp * self.tp
        self.batch_size = batch_size
        self.reports = assembly.tp_rank == 0

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if self.autocast_dtype is not None:
                stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype))
            yield

    def _length(self, longest: int) -> int:
        """A batch's padded length: a multiple of tp (sequence parallelism splits it), and of
        `ROUND` x tp where the model's positions allow."""
        step = ROUND * self.tp
        padded = math.ceil(longest / step) * step
        if padded > self.max_length:
            padded = math.ceil(longest / self.tp) * self.tp
        return padded

    def _logits(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """The model's logits (b, s, vocab) of `rows`, padded on the right, whole on every
        rank; a rank's stand-in is one token."""
        rows = rows or [[PAD]]
        length = self._length(max(len(r) for r in rows))
        tokens = torch.full((len(rows), length), PAD, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        logits = self.model(tokens.to(self.device, non_blocking=True))
        if isinstance(logits, DTensor):  # a tensor-parallel head's (vocabulary-sharded) logits
            logits = logits.full_tensor()
        return logits

    def _rounds(self, count: int) -> Iterator[range | None]:
        """This rank's batches (ranges of `count` sorted items), one a round, and None where
        it has none left while another data-parallel rank still has one."""
        a = self.assembly
        starts = range(0, count, self.batch_size)
        mine = starts[a.dp_rank :: a.dp_size]
        for round_ in range(math.ceil(len(starts) / a.dp_size)):
            if round_ < len(mine):
                yield range(mine[round_], min(mine[round_] + self.batch_size, count))
            else:
                yield None

    def _everywhere(self, values: torch.Tensor) -> torch.Tensor:
        """The answers every reporting rank filled in, summed over the world (zeros elsewhere)."""
        if not self.reports:
            values.zero_()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values)
        return values

    def logprobs(
        self, inputs: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]
    ) -> tuple[list[float], list[bool]]:
        """For each request: the summed log-probability of `targets[i]`, the tokens that end
        `inputs[i]` plus one more (each predicted from the tokens before it), and whether every
        one of them is the model's greedy choice."""
        rows = sorted({tuple(row) for row in inputs}, key=lambda r: (-len(r), r))
        readers: list[list[int]] = [[] for _ in rows]  # the requests each row answers
        place = {row: i for i, row in enumerate(rows)}
        for request, row in enumerate(inputs):
            readers[place[tuple(row)]].append(request)
        # per request: [summed log-probability, target tokens that are not the greedy choice]
        values = torch.zeros(len(inputs), 2, dtype=torch.float64, device=self.device)
        with self._context():
            for batch in self._rounds(len(rows)):
                chosen = [rows[i] for i in batch] if batch is not None else []
                logits = self._logits(chosen)
                if batch is not None:
                    reads = [(j, len(rows[i]), r) for j, i in enumerate(batch) for r in readers[i]]
                    self._score(logits, reads, targets, values)
        values = self._everywhere(values).cpu()
        return values[:, 0].tolist(), (values[:, 1] < 0.5).tolist()

    def _score(
        self,
        logits: torch.Tensor,
        reads: list[tuple[int, int, int]],
        targets: Sequence[Sequence[int]],
        values: torch.Tensor,
    ) -> None:
        """Adds each request's answer to `values` from its batch's `logits`: `reads` are
        (row in the batch, the row's length, request); a request's targets are predicted by
        its row's last `len(target)` positions. One copy to the device a batch, no sync."""
        rows, places, wanted, owners = [], [], [], []
        for row, length, request in reads:
            target = targets[request]
            rows += [row] * len(target)
            places += range(length - len(target), length)
            wanted += target
            owners += [request] * len(target)
        index = torch.tensor([rows, places, wanted, owners], dtype=torch.long)
        row, place, want, owner = index.to(self.device, non_blocking=True)
        scores = logits[row, place].float().log_softmax(-1)
        picked = scores.gather(-1, want.unsqueeze(-1)).squeeze(-1)
        missed = scores.argmax(-1) != want
        values[:, 0].index_add_(0, owner, picked.double())
        values[:, 1].index_add_(0, owner, missed.double())

    def generate(
        self,
        contexts: Sequence[Sequence[int]],
        max_new: int,
        stop: Callable[[int, list[int]], bool],
    ) -> list[list[int]]:
        """Greedy continuations of `contexts`, up to `max_new` tokens each, ended early where
        `stop(request, tokens so far)` says so. Every rank runs a forward for as long as any
        data-parallel rank still generates."""
        order = sorted(range(len(contexts)), key=lambda i: (-len(contexts[i]), i))
        out: list[list[int]] = [[] for _ in contexts]
        with self._context():
            for batch in self._rounds(len(order)):
                chosen = [] if batch is None else [order[i] for i in batch]
                self._generate_batch(chosen, contexts, max_new, stop, out)
        return self._share(out, max_new)

    def _generate_batch(
        self,
        chosen: list[int],
        contexts: Sequence[Sequence[int]],
        max_new: int,
        stop: Callable[[int, list[int]], bool],
        out: list[list[int]],
    ) -> None:
        live = list(chosen)
        while True:
            going = torch.tensor([float(bool(live))], device=self.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(going, op=dist.ReduceOp.MAX)
            if not going.item():
                return
            rows = [list(contexts[i]) + out[i] for i in live]
            logits = self._logits(rows)
            if not live:
                continue
            ends = torch.tensor([len(r) - 1 for r in rows], device=self.device)
            picked = logits[torch.arange(len(rows), device=self.device), ends].argmax(-1)
            for i, token in zip(live, picked.tolist(), strict=True):
                out[i].append(token)
            live = [i for i in live if len(out[i]) < max_new and not stop(i, out[i])]

    def _share(self, out: list[list[int]], max_new: int) -> list[list[int]]:
        """Every rank's continuations on every rank (-1 pads a short one)."""
        table = torch.full((len(out), max_new), -1, dtype=torch.long)
        for i, tokens in enumerate(out):
            table[i, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
        shifted = self._everywhere((table + 1).to(self.device).double()).long().cpu() - 1
        return [[t for t in row if t >= 0] for row in shifted.tolist()]
