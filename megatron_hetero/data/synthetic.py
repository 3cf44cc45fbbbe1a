"""The synthetic data source of a `DataConfig`: one sample per row (`data.samples`) or EOD-separated
documents (`data.documents`, `DataConfig.documents` >= 1). The four calls a runner or a check makes
(`validate`, `batch`, `image_tiles`, `loss_tokens`) pick the source here, so neither module imports
the other's."""

from __future__ import annotations

from megatron_hetero.data import samples as data, documents
from megatron_hetero.data.samples import DataConfig


def validate(cfg: DataConfig) -> None:
    """ValueError for a config its source cannot draw."""
    if cfg.documents:
        documents.validate_documents(cfg)
    else:
        cfg.validate()


def batch(cfg: DataConfig, start: int, count: int) -> dict:
    """Rows [start, start+count) (`data.samples.batch`'s keys)."""
    if cfg.documents:
        return data.stack(cfg, documents.document_rows(cfg, start, count))
    return data.batch(cfg, start, count)


def image_tiles(cfg: DataConfig, start: int, count: int) -> dict[str, list[int]]:
    """Tiles per row of each variable encoder, read without any feature."""
    if cfg.documents:
        return documents.document_tiles(cfg, start, count)
    return data.image_tiles(cfg, start, count)


def loss_tokens(cfg: DataConfig, start: int, count: int) -> int:
    """Loss tokens of rows [start, start+count)."""
    if cfg.documents:
        return documents.document_loss_tokens(cfg, start, count)
    return data.loss_tokens(cfg, start, count)
