"""Pure batch arithmetic: which samples a DP rank owns, and how a step splits into micro-batches.

One rule everywhere (boundary plans, both schedules, the data): DP rank d of a module owns the
contiguous rows [d*B/dp, (d+1)*B/dp) of any batch of B rows crossing or entering that module.
"""

from __future__ import annotations

from dataclasses import dataclass


def dp_rows(batch: int, dp: int, dp_rank: int) -> range:
    """Rows of a `batch`-row tensor that DP rank `dp_rank` of `dp` owns (contiguous, in order).
    ValueError when dp does not divide the batch."""
    if dp < 1 or not 0 <= dp_rank < dp:
        raise ValueError(f"dp rank {dp_rank} is not in [0, dp={dp})")
    if batch % dp:
        raise ValueError(f"a batch of {batch} rows is not divisible by dp({dp}) (remainder {batch % dp})")
    per = batch // dp
    return range(dp_rank * per, (dp_rank + 1) * per)


def sample_range(first: int, batch: int, dp: int, dp_rank: int) -> range:
    """Global sample indices owned by DP rank `dp_rank` of the batch of `batch` samples starting at
    global sample `first`."""
    rows = dp_rows(batch, dp, dp_rank)
    return range(first + rows.start, first + rows.stop)


@dataclass(frozen=True)
class MicroBatching:
    """How one step's global batch G splits: `count` micro-batches of `samples` global samples each
    (micro-batch i = samples [step*G + i*samples, step*G + (i+1)*samples)); a module with DP size dp
    holds samples/dp rows of each micro-batch per DP rank."""

    global_batch: int
    count: int

    @property
    def samples(self) -> int:
        return self.global_batch // self.count

    def first_sample(self, step: int, mb: int = 0) -> int:
        return step * self.global_batch + mb * self.samples

    def rows(self, dp: int, dp_rank: int, mb: int, step: int) -> range:
        """Global samples of micro-batch `mb` of `step` owned by DP rank `dp_rank` of `dp`."""
        return sample_range(self.first_sample(step, mb), self.samples, dp, dp_rank)


def micro_batching(
    global_batch: int, dp: int, micro_batch_size: int, what: str = "the language model"
) -> MicroBatching:
    """Megatron's arithmetic: M = G / dp / micro_batch_size micro-batches per step for the module
    (`what`) whose DP size and per-rank micro-batch size define it. ValueError with the arithmetic."""
    for name, v in (("--global-batch-size", global_batch), ("--micro-batch-size", micro_batch_size), ("dp", dp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if global_batch % dp:
        raise ValueError(
            f"{what}: --global-batch-size {global_batch} is not divisible by dp({dp}) (remainder {global_batch % dp})"
        )
    share = global_batch // dp
    if share % micro_batch_size:
        raise ValueError(
            f"{what}: its DP share {global_batch}/dp({dp}) = {share} samples is not divisible by "
            f"--micro-batch-size {micro_batch_size}"
        )
    return MicroBatching(global_batch=global_batch, count=share // micro_batch_size)


def check_divides(mb: MicroBatching, dp: int, what: str) -> None:
    """ValueError unless every micro-batch of `mb` splits over `dp` DP ranks."""
    if mb.samples % dp:
        raise ValueError(
            f"{what}: a micro-batch holds {mb.global_batch}/{mb.count} = {mb.samples} samples, "
            f"which is not divisible by dp({dp}) (remainder {mb.samples % dp})"
        )


def megatron_micro_batch(first: int, global_batch: int, dp: int, dp_rank: int, micro_batch_size: int, mb: int) -> range:
    """Megatron's data-parallel order (the colocated language model): DP rank d takes the contiguous
    share [first + d*G/dp, first + (d+1)*G/dp) of the step and runs it as micro-batches of
    `micro_batch_size` in order; returns the global samples of its micro-batch `mb`."""
    share = sample_range(first, global_batch, dp, dp_rank)
    start = share.start + mb * micro_batch_size
    if start + micro_batch_size > share.stop:
        raise ValueError(f"micro-batch {mb} of {micro_batch_size} samples is past the DP share {share}")
    return range(start, start + micro_batch_size)
