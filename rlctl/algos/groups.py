"""Groups of completions (consecutive rows, G per prompt) and which of their members count: a row with no
real response token (a multi-turn conversation masked whole by a tool's outage) is no member of its
group, whose baseline, spread and ties are then those of the present members."""

from __future__ import annotations

import torch


def grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) -> (B/G, G), consecutive rows forming a group."""
    if group_size < 1 or x.shape[0] % group_size:
        raise ValueError(f"a batch of {x.shape[0]} sequences does not split into groups of {group_size}")
    return x.view(-1, group_size)


def present_members(mask: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """(B/G, G) True for the rows of the (B, T) ``mask`` with a real token; None when every row has one
    or groups are of one. A row with none would otherwise pull its group's baseline toward its reward of
    0 and move every other member's advantage."""
    present = grouped(mask.bool().any(dim=-1), group_size)
    return None if group_size == 1 or bool(present.all()) else present


def present_mean(r: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """(B/G, 1) the mean of each group's present members (0 for none)."""
    n = present.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.where(present, r, torch.zeros_like(r)).sum(dim=1, keepdim=True) / n


def present_std(r: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """(B/G, 1) the unbiased std of each group's present members (0 for one or none)."""
    n = present.sum(dim=1, keepdim=True)
    dev = torch.where(present, r - present_mean(r, present), torch.zeros_like(r))
    return (dev.square().sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()


def present_ties(r: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """(B/G, 1) True where the present members' rewards all tie (or one or none is present)."""
    inf = torch.full_like(r, float("inf"))
    hi = torch.where(present, r, -inf).max(dim=1, keepdim=True).values
    lo = torch.where(present, r, inf).min(dim=1, keepdim=True).values
    return (hi == lo) | (present.sum(dim=1, keepdim=True) <= 1)


def ties(groups: torch.Tensor) -> torch.Tensor:
    """(B/G, G) -> (B/G, 1) True where every reward of the group equals the first (exactly)."""
    return (groups == groups[:, :1]).all(dim=1, keepdim=True)


def group_baseline(groups: torch.Tensor) -> torch.Tensor:
    """(B/G, G) -> (B/G, 1) group mean; 0 for groups of one, as verl (the raw reward is kept)."""
    if groups.shape[1] == 1:
        return torch.zeros_like(groups)
    return groups.mean(dim=1, keepdim=True)


def baseline(r: torch.Tensor, present: torch.Tensor | None) -> torch.Tensor:
    """The group mean of ``group_baseline``, of the present members only (``present_members``)."""
    return group_baseline(r) if present is None else present_mean(r, present)
