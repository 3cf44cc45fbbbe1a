"""Which real data `train --data-path DIR` reads, and the stage runner that reads it.

`job_data(req, spec)` (`req`: train's data flags as its door read them, `config.data.DataRequest`):
a conversation dataset (`chat_batches.is_chat_dataset`: an energon crude dataset, as `megatron-hetero
data digits --chat` writes) goes to `chat_runner.chat_job_data`, the spoken digits (`data digits
--speech`: its `speech.json`) to `speech_runner.speech_job_data`, anything else (and no --data-path) to
`caption_runner.caption_job_data`. `runner_factory(data, ...)` picks the runner of the resulting
config's `kind` ("chat": `chat_runner.chat_runner_factory`, "speech": `speech_runner.speech_runner_factory`, else
`caption_runner.caption_runner_factory`). Both sides stay unaware of each other.
"""

from __future__ import annotations

from typing import Callable, Optional

from megatron_hetero.config.data import CaptionDataConfig, DataRequest
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.data.digits_speech import is_speech_dataset


def job_data(
    req: DataRequest, spec: LlavaSpec, global_batch: Optional[int] = None
) -> tuple[LlavaSpec, Optional[CaptionDataConfig]]:
    """(spec fitted to the data, data config) for train's data flags `req` (None: the synthetic data).
    `global_batch`: the job's; conversation data checks its first global batch against --seq-length."""
    from megatron_hetero.data.chat_batches import is_chat_dataset

    if req.data_path and is_speech_dataset(req.data_path):
        from megatron_hetero.models.speech_runner import speech_job_data

        return speech_job_data(req, spec, global_batch)
    if req.data_path and is_chat_dataset(req.data_path):
        from megatron_hetero.models.chat_runner import chat_job_data

        return chat_job_data(req, spec, global_batch)
    from megatron_hetero.models.caption_runner import caption_job_data

    return caption_job_data(req, spec)


def runner_factory(data: CaptionDataConfig, spec: LlavaSpec, global_batch: int, heldout: bool = False) -> Callable:
    """The (plan, states) -> stage runner function for `data` (a config from `job_data`)."""
    if data.kind == "speech":
        from megatron_hetero.models.speech_runner import speech_runner_factory

        return speech_runner_factory(data, spec, global_batch, heldout=heldout)
    if data.kind == "chat":
        from megatron_hetero.models.chat_runner import chat_runner_factory

        return chat_runner_factory(data, spec, global_batch, heldout=heldout)
    from megatron_hetero.models.caption_runner import caption_runner_factory

    return caption_runner_factory(data, spec, global_batch, heldout=heldout)
