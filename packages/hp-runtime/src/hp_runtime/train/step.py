"""Forward and backward of one global batch on this rank's share of the model, with or without
a pipeline, and the validation loss.

The loss is the cross-entropy summed over the tokens whose `loss_mask` is 1, divided by the
number of such tokens in the whole global batch (all accumulation steps, all data-parallel
ranks). Each micro-batch's loss is scaled by `dp_cp_size / tokens` because FSDP averages
gradients over the data-parallel and context-parallel ranks (a context-parallel rank holds some
rows of each sample and counts their tokens); the result is the same loss and gradients
whatever the layout and accumulation. The count and the reported loss travel in collectives on
the device: no host sync.

The model computes each token's cross-entropy itself, given the labels (`model/loss.py`): the
head runs a chunk of the sequence at a time, inside the forward, so the fp32 logits of a whole
micro-batch never exist. `TokenLoss` only sums and scales.

A MoE model's balancing (`train/balance.py`) brackets the micro-batches: the auxiliary loss's
weight before them, the global expert load after the backward. Each MoE layer's figures then
reach every rank in the step's one all-reduce, beside the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hp_runtime.model.attention import documents_after_eod
from hp_runtime.model.loss import IGNORE, mtp_inputs  # IGNORE: a token whose loss_mask is 0
from hp_runtime.parallel import Assembly
from hp_runtime.parallel.pp import carry_positions, pipeline_step
from hp_runtime.train.balance import Balance
from hp_runtime.train.errors import TrainError

Batch = dict[str, torch.Tensor]


class TokenLoss:
    """Cross-entropy summed over a micro-batch's loss tokens, times `scale` (the weight of one
    token in the step's loss, set before each step), from the per-token losses the model
    returns given the labels (0 at IGNORE). It is the pipeline's `loss_fn` too, so it exists
    before the model is assembled; the pipeline passes the labels again, unused here."""

    def __init__(self, device: torch.device) -> None:
        self.scale = torch.ones((), device=device)

    def __call__(self, losses: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        total = losses.sum()
        if isinstance(total, DTensor):  # vocabulary-parallel loss
            total = total.full_tensor()
        return total * self.scale


class Stepper:
    """Runs a step's micro-batches through `assembly` and reports global values."""

    def __init__(
        self,
        assembly: Assembly,
        loss_fn: TokenLoss,
        pp_microbatches: int,
        autocast_dtype: torch.dtype | None,
        loss_parallel: bool,
        reset_position_ids: bool,
        document_end: int | None,
        loss_chunk_tokens: int,
    ) -> None:
        self.assembly = assembly
        self.loss_fn = loss_fn
        self.device = assembly.device
        self.pp_microbatches = pp_microbatches
        self.autocast_dtype = autocast_dtype
        self.loss_parallel = loss_parallel
        # What the model reads of a batch besides its tokens: the position ids where they are
        # not 0..s-1, and with `document_end` (the EOD id: document masking) the documents
        # that end at each EOD token, whether or not the positions restart there (Megatron's
        # reset_attention_mask and reset_position_ids are independent too).
        self.document_end = document_end
        self.reads = ("position_ids",) * reset_position_ids + ("documents",) * (
            document_end is not None
        )
        self.loss_chunk_tokens = loss_chunk_tokens  # the head's tokens at a time (model/loss.py)
        # What travels with the activations through a pipeline: what the model reads, and
        # under context parallelism at least the position ids (whole, while the activations
        # hold a rank's rows: each stage takes its rows from their length).
        self.carried = self.reads or ("position_ids",) * (assembly.cp is not None)
        if assembly.schedule is not None and self.carried:
            carry_positions(assembly.stages, assembly.total_stages, self.carried, assembly.cp)
        # Only one rank per tensor-parallel group on the last stage reports a loss.
        self.reports = assembly.has_last_stage and assembly.tp_rank == 0
        self.balance = Balance(assembly.modules, assembly.dp_group)
        config = assembly.modules[0].config
        # Every MoE layer of the model, in order: the rows of the figures `train_step` returns.
        self.moe_layers = [i for i in range(config.total_layers) if config.is_moe_layer(i)]
        mine = [self.moe_layers.index(layer) for layer, _ in self.balance.layers]
        self._moe_rows = torch.tensor(mine, dtype=torch.long, device=self.device)
        # A layer's figures are alike on its stage's data- and tensor-parallel ranks (Balance
        # sums the load over the first): one of them adds them to the step's all-reduce.
        self._moe_reports = assembly.dp_rank == 0 and assembly.tp_rank == 0
        # Multi-token prediction (model.mtp): its modules' inputs made from the whole rows,
        # and their mean losses of the last step, on the device (`mtp_loss`).
        self.mtp_depth = config.mtp_depth
        self.mtp_weight = config.mtp.loss_weight / config.mtp.depth if config.mtp else 0.0
        self.mtp_loss = torch.zeros(self.mtp_depth, device=self.device)

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.autocast_dtype is not None:
                stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype))
            if self.loss_parallel:
                stack.enter_context(loss_parallel())
            yield

    def _shard(self, micro: list[Batch]) -> list[Batch]:
        """This rank's rows of each micro-batch under context parallelism (`parallel/cp.py`)."""
        cp = self.assembly.cp
        return micro if cp is None else [cp.shard(mb) for mb in micro]

    def _tokens(self, micro: list[Batch]) -> tuple[torch.Tensor, dist.Work | None]:
        """Loss tokens of the global batch (on the last stage; 1 elsewhere), summed over the
        data- and context-parallel ranks by an all-reduce that is still in flight: wait on
        the handle."""
        if not self.assembly.has_last_stage:
            return torch.ones((), device=self.device), None
        count = torch.stack([mb["loss_mask"].sum() for mb in micro]).sum().float()
        if self.assembly.dp_cp_group is None:
            return count, None
        return count, dist.all_reduce(count, group=self.assembly.dp_cp_group, async_op=True)

    def _set_scale(self, count: torch.Tensor, work: dist.Work | None) -> None:
        if work is not None:
            work.wait()
        self.loss_fn.scale = self.assembly.dp_cp_size / count.clamp(min=1.0)

    def _documents(self, micro: list[Batch]) -> list[Batch]:
        """Each micro-batch with the number of each token's document, under document
        masking (on the device: no sync)."""
        if self.document_end is None:
            return micro
        end = self.document_end
        return [{**mb, "documents": documents_after_eod(mb["tokens"], end)} for mb in micro]

    def _predictions(self, micro: list[Batch]) -> list[Batch]:
        """Each micro-batch with its multi-token prediction inputs (`loss.mtp_inputs`)."""
        if not self.mtp_depth:
            return micro
        out = []
        for mb in micro:
            ahead, targets = mtp_inputs(
                mb["tokens"], mb["labels"], mb["loss_mask"], self.mtp_depth, mb.get("documents")
            )
            out.append({**mb, "mtp_tokens": ahead, "mtp_labels": targets})
        return out

    def _mtp_modules(self) -> list[torch.Tensor]:
        """This rank's models' `mtp_losses` buffers (each stage has one; the last fills it)."""
        return [m.mtp_losses for m in self.assembly.modules]

    @staticmethod
    def _labels(mb: Batch) -> torch.Tensor:
        """The micro-batch's labels, IGNORE where its loss_mask is 0."""
        return mb["labels"].masked_fill(mb["loss_mask"] == 0, IGNORE)

    def _token_losses(self, mb: Batch) -> torch.Tensor:
        """Each token's cross-entropy (b, s) of one micro-batch, 0 where loss_mask is 0 (with
        the multi-token prediction's where the micro-batch has its inputs: in training)."""
        predict = {name: mb[name] for name in ("mtp_tokens", "mtp_labels") if name in mb}
        return self.assembly.model(
            mb["tokens"],
            labels=self._labels(mb),
            loss_chunk_tokens=self.loss_chunk_tokens,
            rows=mb.get("rows"),
            **{name: mb[name] for name in self.reads},
            **predict,
        )

    def _pipeline(self, micro: list[Batch], count: int, backward: bool) -> torch.Tensor:
        """`count` micro-batches through the schedule, `pp_microbatches` per schedule step.
        Ranks without data (middle stages) pass no `micro` but run the same steps."""
        a, n = self.assembly, self.pp_microbatches
        total = torch.zeros((), device=self.device)
        for start in range(0, count, n):
            group = micro[start : start + n]
            inputs = None
            if a.has_first_stage:
                inputs = torch.cat([mb["tokens"] for mb in group])
                if self.carried:  # they travel with the activations to every stage
                    carried = [torch.cat([mb[name] for mb in group]) for name in self.carried]
                    inputs = (inputs, *carried)
            targets = None
            if a.has_last_stage:
                targets = torch.cat([self._labels(mb) for mb in group])
            # The last stage's forward takes the labels too: it returns per-token losses (and
            # with them the prediction modules' inputs, in training).
            forward = None
            if targets is not None:
                forward = {"labels": targets, "loss_chunk_tokens": self.loss_chunk_tokens}
                for name in ("mtp_tokens", "mtp_labels"):
                    if name in group[0]:
                        forward[name] = torch.cat([mb[name] for mb in group])
            loss = pipeline_step(
                a.schedule,
                a.stage_ids,
                a.total_stages,
                inputs,
                targets,
                n,
                backward=backward,
                kwargs=forward,
            )
            if loss is not None:
                total = total + loss.detach()
        return total

    def _global(self, local: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
        """Sum over ranks of the reporting ranks' values (the same on every rank), followed
        by the sum of every rank's `shared` values, in one all-reduce."""
        value = local if self.reports else torch.zeros_like(local)
        if shared is not None:
            value = torch.cat([value.reshape(-1), shared.reshape(-1)])
        dist.all_reduce(value)
        return value

    def _moe_figures(self) -> torch.Tensor:
        """After the backward: this rank's share of every MoE layer's figures (layers, 3),
        zeros where another rank reports a layer (`Balance.finish_step`'s columns)."""
        figures = torch.zeros(len(self.moe_layers), 3, device=self.device)
        if self.balance.layers:
            mine = self.balance.finish_step()
            if self._moe_reports:
                figures.index_copy_(0, self._moe_rows, mine.to(figures.dtype))
        return figures

    def train_step(
        self, micro: list[Batch], count: int, flag: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward and backward of the global batch: this rank's `count` micro-batches
        (`micro`, empty on a rank that reads no data). Returns the global loss, the sum of
        every rank's `flag` (a stop request travels with the loss: no collective of its own)
        and each MoE layer's figures over the global batch, (MoE layers, 3): [mean auxiliary
        loss, max / mean tokens per expert, tokens routed], on the device; gradients are left
        for `Assembly.finish_gradients`, the bias for `balance.update_bias` after the update."""
        a = self.assembly
        micro = self._shard(self._predictions(self._documents(micro)))  # of whole sequences
        self.balance.start_step(count)  # a pipeline's every stage runs `count` micro-batches
        for buffer in self._mtp_modules():
            buffer.zero_()
        tokens, work = self._tokens(micro)
        with self._context():
            if a.schedule is not None:
                self._set_scale(tokens, work)
                local = self._pipeline(micro, count, backward=True)
            else:
                local = torch.zeros((), device=self.device)
                for i, mb in enumerate(micro):
                    losses = self._token_losses(mb)
                    if i == 0:  # the count's all-reduce ran during the first forward
                        self._set_scale(tokens, work)
                    loss = self.loss_fn(losses)
                    loss.backward()
                    local = local + loss.detach()
        shared = torch.cat(
            [torch.full((1,), flag, device=self.device), self._moe_figures().view(-1)]
        )
        reported = (local / a.dp_cp_size).float().reshape(1)
        if self.mtp_depth:  # each module's mean loss, and the main loss without them
            mtp = sum(self._mtp_modules()) * self.loss_fn.scale / a.dp_cp_size
            reported = torch.cat([reported - self.mtp_weight * mtp.sum(), mtp.float()])
        total = self._global(reported, shared)
        depth = self.mtp_depth
        self.mtp_loss = total[1 : 1 + depth]
        return total[0], total[1 + depth], total[2 + depth :].view(-1, 3)

    @torch.no_grad()
    def sample_losses(self, micro: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy sum, loss tokens) of each sample of this rank's micro-batches, in
        order, from a forward without a graph: what `hp-train replay --dump` writes. Whole
        samples only: not under a pipeline or context parallelism, which split them."""
        if self.assembly.schedule is not None or self.assembly.cp is not None:
            raise TrainError("per-sample losses need pp = 1 and cp = 1: replay on such a layout")
        sums, counts = [], []
        with self._context():
            for mb in self._documents(micro):
                losses = self._token_losses(mb)
                if isinstance(losses, DTensor):  # vocabulary-parallel loss
                    losses = losses.full_tensor()
                sums.append(losses.float().sum(dim=1))
                counts.append(mb["loss_mask"].sum(dim=1).float())
        if not sums:
            return torch.zeros(0), torch.zeros(0)
        return torch.cat(sums), torch.cat(counts)

    @torch.no_grad()
    def eval_sums(self, micro: list[Batch], count: int) -> torch.Tensor:
        """[cross-entropy sum, loss tokens] of this rank's `count` micro-batches, for
        `eval_loss` (zeros on ranks that do not report)."""
        a = self.assembly
        micro = self._shard(self._documents(micro))  # documents of the whole sequence
        self.loss_fn.scale = torch.ones((), device=self.device)
        zero = torch.zeros((), device=self.device)
        # Under no_grad the MoE layers neither weigh an auxiliary loss nor count the load
        # (`MoE.forward`): a step's figures and the bias are the training tokens'.
        with self._context():
            if a.schedule is not None:
                summed = self._pipeline(micro, count, backward=False)
            else:
                summed = sum((self.loss_fn(self._token_losses(mb)) for mb in micro), zero)
        tokens = sum((mb["loss_mask"].sum().float() for mb in micro), zero)
        return torch.stack([summed.float(), tokens if a.has_last_stage else zero])

    def eval_loss(self, sums: torch.Tensor) -> torch.Tensor:
        """The global mean cross-entropy per loss token from summed `eval_sums`."""
        total = self._global(sums)
        return total[0] / total[1].clamp(min=1.0)
