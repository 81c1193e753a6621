"""Speculative rejection sampling for point-mass drafts (n-gram drafts propose one token with
certainty): draft `d` is accepted with probability `p(d)`, else a token is drawn from the residual
`norm(max(p - onehot(d), 0))` (p with d removed). Either way the token follows p exactly:
P(t) = p(d) [t = d] + (1 - p(d)) p(t) / (1 - p(d)) [t != d] = p(t)."""

from __future__ import annotations

import torch

NO_DRAFT = -1


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[rows] indices drawn from unnormalised `probs` [rows, n] given `uniform` [rows] in [0, 1);
    a row without mass gives some index (callers do not use it)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the first cdf entry above it belongs to an index with mass.
    target = torch.minimum(uniform[:, None] * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def accept_or_resample(probs: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
                       u_draw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `probs` [rows, vocab] (normalised target distributions) with the draft token
    `drafts[row]` proposed there (`NO_DRAFT`: none, the bonus position): (accepted [rows] bool,
    token [rows]) where `token` is the residual draw of a row whose draft is rejected, or a draw
    from `probs` of a row without a draft. `u_accept`, `u_draw` [rows]: uniforms in [0, 1). No
    host sync."""
    has_draft = drafts != NO_DRAFT
    column = drafts.clamp(min=0)[:, None]
    p_draft = probs.gather(1, column).squeeze(1) * has_draft
    accepted = has_draft & (u_accept < p_draft)
    residual = probs.scatter(1, column, torch.where(has_draft[:, None], 0.0,
                                                    probs.gather(1, column)))
    return accepted, inverse_cdf(residual, u_draw)
