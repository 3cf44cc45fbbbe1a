"""Pure planning: placement, boundary plans. Never imports torch.distributed."""

from megatron_hetero.plan.boundary import Block, BoundaryPlan, BoundaryShape, Transfer, plan_all, plan_boundary
from megatron_hetero.plan.placement import Coord, coord_of, group_ranks, rank_map, rank_of, stage_ranks

__all__ = [
    "Block",
    "BoundaryPlan",
    "BoundaryShape",
    "Coord",
    "Transfer",
    "coord_of",
    "group_ranks",
    "plan_all",
    "plan_boundary",
    "rank_map",
    "rank_of",
    "stage_ranks",
]
